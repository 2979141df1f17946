"""The trainer as a user runs it: checkpoint upkeep and averaging, one optimizer step, bad input, recipes, objectives.

Runs are tiny (a 200-line synthetic corpus, the tiny-transformer preset) and the command-line ones run in
subprocesses with one thread, so that exit codes are real. One optimizer step is checked against the label-smoothed
loss written out by hand, and gradient accumulation against one step on the joined batch.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml
from helpers import WORDS, steps, tformer_train, trainer, write_corpus, write_recipe

from tformer.checkpoints import checkpoint_dir, resolve_checkpoint
from tformer.config import ConfigError, ModelConfig
from tformer.data import Seq2SeqBatch, Tokenizer, teacher_forcing
from tformer.models import CheckpointError, build_model, load
from tformer.training import Trainer, load_recipe
from tformer.training.checkpoint import average_checkpoints
from tformer.training.evaluate import TranslationResult

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- checkpoint upkeep -------------------------------------------------------------------------------------------


def test_only_the_newest_checkpoints_and_the_best_one_are_kept(tmp_path: Path, monkeypatch) -> None:
    recipe = write_recipe(tmp_path)
    dev = write_corpus(tmp_path / "dev.tsv", n=4)
    run = trainer(
        recipe,
        f"train.dev_corpus={dev}",
        "train.max_steps=12",
        "train.save_every=2",
        "train.eval_every=2",
        "train.keep_last=2",
    )
    bleus = iter([1.0, 5.0, 3.0, 6.0, 2.0, 1.0, 0.0])  # dev BLEU at steps 2, 4, ..., 12, then the final one
    monkeypatch.setattr(
        "tformer.training.trainer.evaluate_translation",
        lambda *args: TranslationResult(next(bleus), "scripted", [], [], []),
    )
    run.fit()
    assert steps(run.run_dir) == [8, 10, 12]  # the best (step 8) and the newest two; step 4, once best, is gone
    assert yaml.safe_load((run.run_dir / "best.json").read_text()) == {"step": 8, "bleu": 6.0, "dev_sentences": 4}
    assert resolve_checkpoint(run.run_dir) == checkpoint_dir(run.run_dir, 8)
    (run.run_dir / "best.json").unlink()  # the best is found again from the checkpoints' trainer states
    assert resolve_checkpoint(run.run_dir) == checkpoint_dir(run.run_dir, 8)


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
    for (name, p), q in zip(accumulated.model.named_parameters(), joined.model.parameters(), strict=True):
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
        return (
            [f"train.corpus={tmp_path / 'src.txt'}", f"train.corpus_tgt={tmp_path / 'tgt.txt'}"],
            f"{tmp_path / 'src.txt'}:3: line has no partner",
        )
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
    model, train = load_recipe(
        recipe,
        [
            "train.max_steps=5",
            "model.d_model=64",
            "train.lr=3e-4",
            "train.bf16=true",
            "train.dev_corpus=null",
            "train.out_dir=runs/x y",
        ],
    )
    assert (train.max_steps, model.d_model, train.lr, train.bf16) == (5, 64, 3e-4, True)
    assert train.dev_corpus is None and train.out_dir == "runs/x y"
    assert model.n_heads == 4 and model.dropout == 0.1  # the rest still comes from the preset and the recipe


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps", "must look like"),
        ("max_steps=5", "must look like"),
        ("optim.lr=0.1", "must look like"),
        ("train.max_stpes=5", "did you mean 'max_steps'"),
        ("train.max_steps=many", "max_steps must be int"),
    ],
)
def test_malformed_overrides_raise_config_error(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_recipe(write_recipe(tmp_path), [override])


# ---- language-model objectives ---------------------------------------------------------------------------------


def test_a_causal_lm_learns_and_reports_dev_perplexity(tmp_path: Path) -> None:
    lines = [" ".join(random.Random(i).choice(WORDS) for _ in range(6)) for i in range(300)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "dev.txt").write_text("\n".join(lines[:40]) + "\n", encoding="utf-8")
    recipe = tmp_path / "recipe.yaml"
    train = {
        "corpus": str(tmp_path / "train.txt"),
        "dev_corpus": str(tmp_path / "dev.txt"),
        "objective": "clm",
        "vocab_size": 300,
        "max_len": 32,
        "max_tokens": 512,
        "max_steps": 40,
        "eval_every": 10_000,
        "save_every": 10_000,
        "optimizer": "adamw-cosine",
        "lr": 3e-3,
        "warmup": 5,
        "out_dir": str(tmp_path / "run"),
    }
    recipe.write_text(
        yaml.safe_dump({"model": {"preset": "tiny-gpt2", "dropout": 0.0, "attn_dropout": 0.0}, "train": train})
    )
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
