"""The trainer as a user runs it: bit-exact resume after kill -9, Ctrl-C, divergence, checkpoint upkeep, bad input.

Runs are tiny (a 200-line synthetic corpus, the tiny-transformer preset) and the command-line ones run in
subprocesses with one thread, so that signals and exit codes are real.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tformer.config import ConfigError, ModelConfig
from tformer.data import Seq2SeqBatch, Tokenizer, teacher_forcing
from tformer.models import WEIGHTS_FILE, CheckpointError, build_model, load
from tformer.training import Trainer, TrainingDiverged, load_recipe
from tformer.training.checkpoint import (
    average_checkpoints,
    checkpoint_dir,
    list_checkpoints,
    load_trainer_state,
    resolve_checkpoint,
)
from tformer.training.evaluate import TranslationResult

WORDS = "zero one two three four five six seven eight nine".split()
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny tensors: threads only contend on a busy machine


pytestmark = pytest.mark.usefixtures("one_thread")


def write_corpus(path: Path, n: int = 200) -> Path:
    """A reversal task on number words: "three one four" -> "four one three"."""
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 5))]
        lines.append(f"{' '.join(words)}\t{' '.join(reversed(words))}\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def write_recipe(directory: Path, **train: object) -> Path:
    """A recipe for the tiny model on the synthetic corpus, with dropout so that resuming depends on the RNG."""
    directory.mkdir(parents=True, exist_ok=True)
    train = {
        "corpus": str(write_corpus(directory / "corpus.tsv")), "vocab_size": 300, "max_len": 32,
        "max_tokens": 256, "max_steps": 20, "save_every": 5, "eval_every": 10_000, "log_every": 5,
        "optimizer": "adamw-cosine", "lr": 1e-3, "warmup": 5, "out_dir": str(directory / "run"), **train,
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny-transformer", "dropout": 0.1}, "train": train}))
    return path


def trainer(recipe: Path, *overrides: str) -> Trainer:
    return Trainer(*load_recipe(recipe, list(overrides)))


def tformer_train(recipe: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tformer", "train", str(recipe), *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def start_training(*command: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)


def wait_for_checkpoint(process: subprocess.Popen, run_dir: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not list_checkpoints(run_dir):
        if process.poll() is not None:
            pytest.fail(f"training exited with {process.returncode} before a checkpoint: {process.stderr.read()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("no checkpoint appeared")
        time.sleep(0.005)


def steps(run_dir: Path) -> list[int]:
    return [int(p.name.removeprefix("step-")) for p in list_checkpoints(run_dir)]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / WEIGHTS_FILE)


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"tensors differ: {different}"


def assert_complete(checkpoint: Path) -> None:
    """Loads as a model and as trainer state, with finite weights."""
    model = load(checkpoint)
    assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    assert load_trainer_state(checkpoint)["step"] == int(checkpoint.name.removeprefix("step-"))


def last_line(stream: str) -> str:
    """The last line a terminal would show (tqdm redraws its bar with carriage returns)."""
    return re.split(r"[\r\n]+", stream.strip())[-1]


# ---- resume ------------------------------------------------------------------------------------------------------

RESUME_STEPS = 30


@pytest.fixture(scope="module")
def resume_recipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A recipe, and the final weights of an uninterrupted run of it."""
    recipe = write_recipe(tmp_path_factory.mktemp("resume"), max_steps=RESUME_STEPS)
    straight = trainer(recipe)
    straight.fit()
    return recipe, weights(checkpoint_dir(straight.run_dir, RESUME_STEPS))


def test_a_run_killed_mid_training_resumes_bit_exactly(resume_recipe, tmp_path: Path) -> None:
    recipe, expected = resume_recipe
    run_dir = tmp_path / "killed"
    process = start_training("-m", "tformer", "train", str(recipe), f"train.out_dir={run_dir}")
    wait_for_checkpoint(process, run_dir)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert 0 < max(steps(run_dir)) < RESUME_STEPS, "the run must be killed before it finished"
    for checkpoint in list_checkpoints(run_dir):
        assert_complete(checkpoint)
    result = tformer_train(recipe, f"train.out_dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    assert_bit_equal(weights(checkpoint_dir(run_dir, RESUME_STEPS)), expected)


def training_records(run_dir: Path) -> list[tuple[int, float, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["lr"]) for r in map(json.loads, lines) if "loss" in r]


def test_a_resumed_run_logs_each_step_once(resume_recipe, tmp_path: Path) -> None:
    """A run killed after logging steps past its last checkpoint: the resumed run's log drops them (and a torn
    last line) and logs them again, so the log equals an uninterrupted run's."""
    recipe, _ = resume_recipe
    straight = trainer(recipe, f"train.out_dir={tmp_path / 'straight'}", "train.keep_last=10")
    straight.fit()
    killed = tmp_path / "killed"
    shutil.copytree(straight.run_dir, killed)
    for checkpoint in list_checkpoints(killed):
        if int(checkpoint.name.removeprefix("step-")) > 10:
            shutil.rmtree(checkpoint)
    with open(killed / "metrics.jsonl", "a") as f:
        f.write('{"step": 27, "lo')  # a line torn by the kill
    resumed = trainer(recipe, f"train.out_dir={killed}", "train.keep_last=10")
    assert resumed.step == 10
    resumed.fit()
    expected = training_records(straight.run_dir)
    assert [step for step, _, _ in expected] == list(range(5, RESUME_STEPS + 1, 5))
    assert training_records(killed) == expected


KILL_IN_SECOND_SAVE = """
import os, signal, sys, torch
from tformer.cli import main
real_save, calls = torch.save, []
def save(obj, f, *args, **kwargs):  # the trainer state is the last file of a checkpoint
    calls.append(str(f).endswith("trainer_state.pt"))
    if sum(calls) == 2 and calls[-1]:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)
torch.save = save
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_while_writing_a_checkpoint_leaves_only_a_tmp_directory(resume_recipe, tmp_path: Path) -> None:
    recipe, expected = resume_recipe
    run_dir = tmp_path / "killed"
    process = start_training("-c", KILL_IN_SECOND_SAVE, "train", str(recipe), f"train.out_dir={run_dir}")
    process.communicate(timeout=120)
    assert process.returncode == -signal.SIGKILL
    half_written = run_dir / "checkpoints" / "step-00000010.tmp"
    assert (half_written / WEIGHTS_FILE).is_file() and not (half_written / "trainer_state.pt").exists()
    assert steps(run_dir) == [5]
    assert resolve_checkpoint(run_dir) == checkpoint_dir(run_dir, 5)
    result = tformer_train(recipe, f"train.out_dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert f"resumed from {checkpoint_dir(run_dir, 5)}" in result.stdout
    assert_bit_equal(weights(checkpoint_dir(run_dir, RESUME_STEPS)), expected)


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, max_steps=100_000)
    run_dir = tmp_path / "run"
    process = start_training("-m", "tformer", "train", str(recipe))
    wait_for_checkpoint(process, run_dir)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    saved = re.search(r"interrupted: saving a checkpoint at step (\d+)", stdout)
    assert saved, stdout
    step = int(saved.group(1))
    assert 5 <= step < 100_000 and max(steps(run_dir)) == step
    assert_complete(checkpoint_dir(run_dir, step))


# ---- divergence --------------------------------------------------------------------------------------------------


def test_a_non_finite_loss_stops_training_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    run = trainer(write_recipe(tmp_path), "train.max_steps=10", "train.save_every=3")
    forward, before_bad_step = run.model.forward, {}

    def poisoned(*args: torch.Tensor) -> torch.Tensor:
        if run.step < 4:
            return forward(*args)
        before_bad_step.update({k: v.clone() for k, v in run.model.state_dict().items()})
        return forward(*args) + float("nan")

    run.model.forward = poisoned
    with pytest.raises(TrainingDiverged, match=r"^step 5: loss nan .* not finite"):
        run.fit()
    assert steps(run.run_dir) == [3]
    assert_complete(checkpoint_dir(run.run_dir, 3))
    assert_bit_equal(run.model.state_dict(), before_bad_step)  # the bad step did not touch the weights


def test_divergence_on_the_command_line_is_one_error_line_with_exit_code_2(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, optimizer="adam-noam", lr=1e30, save_every=1)
    result = tformer_train(recipe)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    message = last_line(result.stderr)
    diverged = re.fullmatch(r"tformer: error: step (\d+): loss .* is not finite; .*set clip_grad", message)
    assert diverged, result.stderr
    assert max(steps(tmp_path / "run")) == int(diverged.group(1)) - 1
    assert_complete(list_checkpoints(tmp_path / "run")[-1])


# ---- checkpoint upkeep -------------------------------------------------------------------------------------------


def test_only_the_newest_checkpoints_and_the_best_one_are_kept(tmp_path: Path, monkeypatch) -> None:
    recipe = write_recipe(tmp_path)
    dev = write_corpus(tmp_path / "dev.tsv", n=4)
    run = trainer(recipe, f"train.dev_corpus={dev}", "train.max_steps=12", "train.save_every=2",
                  "train.eval_every=2", "train.keep_last=2")
    bleus = iter([1.0, 5.0, 3.0, 6.0, 2.0, 1.0, 0.0])  # dev BLEU at steps 2, 4, ..., 12, then the final one
    monkeypatch.setattr("tformer.training.trainer.evaluate_translation",
                        lambda *args: TranslationResult(next(bleus), "scripted", [], [], []))
    run.fit()
    assert steps(run.run_dir) == [8, 10, 12]  # the best (step 8) and the newest two; step 4, once best, is gone
    assert yaml.safe_load((run.run_dir / "best.json").read_text()) == {"step": 8, "bleu": 6.0, "dev_sentences": 4}
    assert resolve_checkpoint(run.run_dir) == checkpoint_dir(run.run_dir, 8)
    (run.run_dir / "best.json").unlink()
    assert resolve_checkpoint(run.run_dir) == checkpoint_dir(run.run_dir, 12)


def saved_models(directory: Path, configs: list[ModelConfig]) -> list[Path]:
    paths = []
    for seed, config in enumerate(configs):
        torch.manual_seed(seed)
        build_model(config).save(directory / f"model-{seed}")
        paths.append(directory / f"model-{seed}")
    return paths


def test_averaging_gives_the_mean_of_every_tensor(tmp_path: Path) -> None:
    config = ModelConfig.from_preset("tiny-transformer")  # tied and shared embeddings: one tensor, three names
    paths = saved_models(tmp_path, [config] * 3)
    averaged = load(average_checkpoints(paths, tmp_path / "average")).state_dict()
    inputs = [load(p).state_dict() for p in paths]
    assert averaged.keys() == inputs[0].keys()
    for name, tensor in averaged.items():
        torch.testing.assert_close(tensor, torch.stack([m[name] for m in inputs]).mean(0), msg=name)


def test_averaging_refuses_different_configs(tmp_path: Path) -> None:
    config = ModelConfig.from_preset("tiny-transformer")
    paths = saved_models(tmp_path, [config, ModelConfig.from_preset("tiny-transformer", d_ff=48)])
    with pytest.raises(CheckpointError, match="different configs"):
        average_checkpoints(paths, tmp_path / "average")
    with pytest.raises(CheckpointError, match="at least one"):
        average_checkpoints([], tmp_path / "average")


def test_averaging_keeps_the_whole_tokenizer_of_the_first_checkpoint(tmp_path: Path) -> None:
    paths = saved_models(tmp_path, [ModelConfig.from_preset("tiny-transformer")] * 2)
    plain = Tokenizer.train([" ".join(WORDS)] * 20, vocab_size=300)
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    chat = Tokenizer(plain.backend, add_bos=True, chat_template=template)
    chat.save(paths[0])
    plain.save(paths[1])  # a tokenizer without template and bos, which the average must not take
    averaged = Tokenizer.load(average_checkpoints(paths, tmp_path / "average"))
    assert averaged.chat_template == template and averaged.add_bos is True
    assert averaged.special_tokens == chat.special_tokens
    text = "three one four"
    assert averaged.encode(text) == chat.encode(text) == [chat.bos_id, *plain.encode(text)]
    messages = [{"role": "user", "content": "two"}]
    assert averaged.apply_chat_template(messages) == chat.apply_chat_template(messages) == "<|user|>two</s>"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the first checkpoint's files, byte for byte
        assert (tmp_path / "average" / name).read_bytes() == (paths[0] / name).read_bytes(), name


# ---- one optimizer step ------------------------------------------------------------------------------------------


def smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Mean over real tokens of -sum_i q_i log p_i, q = 1 - eps on the label and eps / (V - 1) elsewhere."""
    real = labels != -100
    log_p = torch.log_softmax(logits[real].double(), -1)  # (N, V)
    q = torch.full_like(log_p, epsilon / (log_p.shape[-1] - 1))
    q.scatter_(-1, labels[real][:, None], 1 - epsilon)
    return -(q * log_p).sum(-1).mean()


def two_batches(run: Trainer) -> tuple[list[Seq2SeqBatch], Seq2SeqBatch]:
    """Two batches of different sizes and token counts, and the one batch that joins them."""
    first, second = run.data.examples[:6], run.data.examples[6:9]
    batches = [teacher_forcing(first, run.vocab), teacher_forcing(second, run.vocab)]
    return batches, teacher_forcing(first + second, run.vocab)


def without_dropout(recipe: Path) -> Trainer:
    return trainer(recipe, "model.dropout=0.0", "model.attn_dropout=0.0")


def test_train_step_returns_the_mean_smoothed_loss_per_token(tmp_path: Path) -> None:
    run = without_dropout(write_recipe(tmp_path))
    batches, whole = two_batches(run)
    with torch.no_grad():
        logits = run.model.train()(whole.src, whole.tgt_in, whole.src_mask, whole.tgt_mask)
    loss, n_tokens = run.train_step(batches)
    assert n_tokens == int((whole.labels != -100).sum())
    assert loss == pytest.approx(smoothed_loss(logits, whole.labels, run.config.label_smoothing).item(), rel=1e-5)


def test_gradient_accumulation_equals_one_step_on_the_joined_batch(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    accumulated, joined = without_dropout(recipe), without_dropout(recipe)  # same seed: same initial weights
    batches, whole = two_batches(accumulated)
    loss, n_tokens = accumulated.train_step(batches)
    assert joined.train_step([whole]) == (pytest.approx(loss, rel=1e-5), n_tokens)
    for (name, p), q in zip(accumulated.model.named_parameters(), joined.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)
        # Adam's first update is about lr * sign(g): it turns the ~1e-9 rounding noise of key-bias gradients
        # (exactly 0 in exact arithmetic, softmax ignores them) into different steps. Compare the rest.
        informative = q.grad.abs() > 1e-6
        torch.testing.assert_close(p[informative], q[informative], rtol=0, atol=1e-6, msg=name)


# ---- bad input on the command line -------------------------------------------------------------------------------


def bad_corpus(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """Overrides that point a recipe at bad data, and the start of the error they must cause."""
    if case == "empty file":
        (tmp_path / "empty.tsv").write_text("")
        return [f"train.corpus={tmp_path / 'empty.tsv'}"], f"{tmp_path / 'empty.tsv'}: no source/target pairs"
    if case == "unaligned files":
        (tmp_path / "src.txt").write_text("one\ntwo\nthree\n")
        (tmp_path / "tgt.txt").write_text("eins\nzwei\n")
        return ([f"train.corpus={tmp_path / 'src.txt'}", f"train.corpus_tgt={tmp_path / 'tgt.txt'}"],
                f"{tmp_path / 'src.txt'}:3: line has no partner")
    (tmp_path / "latin1.tsv").write_bytes("one two\ttwo one\nfünf\tcinq\n".encode("latin-1"))
    return [f"train.corpus={tmp_path / 'latin1.tsv'}"], f"{tmp_path / 'latin1.tsv'}:2: bytes that are not UTF-8"


@pytest.mark.parametrize("case", ["empty file", "unaligned files", "not UTF-8", "misspelt key"])
def test_bad_input_is_one_error_line_naming_the_file(tmp_path: Path, case: str) -> None:
    recipe = write_recipe(tmp_path)
    if case == "misspelt key":
        overrides, expected = ["train.max_stpes=5"], f"{recipe} (train): unknown config key 'max_stpes'"
    else:
        overrides, expected = bad_corpus(tmp_path, case)
    result = tformer_train(recipe, *overrides)
    assert result.returncode == 2
    assert result.stderr.startswith(f"tformer: error: {expected}") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- recipes -----------------------------------------------------------------------------------------------------


def test_overrides_are_typed_as_yaml(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    model, train = load_recipe(recipe, ["train.max_steps=5", "model.d_model=64", "train.lr=3e-4", "train.bf16=true",
                                        "train.dev_corpus=null", "train.out_dir=runs/x y"])
    assert (train.max_steps, model.d_model, train.lr, train.bf16) == (5, 64, 3e-4, True)
    assert train.dev_corpus is None and train.out_dir == "runs/x y"
    assert model.n_heads == 4 and model.dropout == 0.1  # the rest still comes from the preset and the recipe


@pytest.mark.parametrize("override, message", [
    ("train.max_steps", "must look like"),
    ("max_steps=5", "must look like"),
    ("optim.lr=0.1", "must look like"),
    ("train.max_stpes=5", "did you mean 'max_steps'"),
    ("train.max_steps=many", "max_steps must be int"),
])
def test_malformed_overrides_raise_config_error(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_recipe(write_recipe(tmp_path), [override])


# ---- language-model objectives ---------------------------------------------------------------------------------


def test_a_causal_lm_learns_and_reports_dev_perplexity(tmp_path: Path) -> None:
    lines = [" ".join(random.Random(i).choice(WORDS) for _ in range(6)) for i in range(300)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "dev.txt").write_text("\n".join(lines[:40]) + "\n", encoding="utf-8")
    recipe = tmp_path / "recipe.yaml"
    train = {"corpus": str(tmp_path / "train.txt"), "dev_corpus": str(tmp_path / "dev.txt"), "objective": "clm",
             "vocab_size": 300, "max_len": 32, "max_tokens": 512, "max_steps": 40, "eval_every": 10_000,
             "save_every": 10_000, "optimizer": "adamw-cosine", "lr": 3e-3, "warmup": 5,
             "out_dir": str(tmp_path / "run")}
    recipe.write_text(yaml.safe_dump({"model": {"preset": "tiny-gpt2", "dropout": 0.0, "attn_dropout": 0.0},
                                      "train": train}))
    run = trainer(recipe)
    before = run._evaluate(None)["dev_ppl"]
    after = run.fit()["dev_ppl"]
    assert after < 0.5 * before  # the words repeat from a 10-word set: the model must learn that much
    vocab_size = run.data.tokenizer.vocab_size
    assert before < 2 * vocab_size  # an untrained model is near uniform, so the perplexity is sane


def test_an_objective_for_another_family_is_a_config_error(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    with pytest.raises(ConfigError, match="objective 'clm' trains a 'decoder' model, but the model's family is"):
        trainer(recipe, "train.objective=clm")
