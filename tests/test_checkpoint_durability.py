"""Nothing a crash does loses a checkpoint; a run directory belongs to one run and one recipe; a malformed weights
file is an error that names the file and the field.

The crash tests kill `tformer train` (SIGKILL, from inside, at a named file operation of a save) in a subprocess
and look at what is left; the references are an uninterrupted run of the same recipe (whose weights a resumed run
must reach bit for bit) and the files themselves. Evaluations are scripted (a dev BLEU per step), so that the run
has a best checkpoint, then a worse one, then a new best whose save is the one killed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import ENV, steps, trainer, write_corpus, write_recipe
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tformer.checkpoints import (
    BEST_FILE,
    COMPLETE_FILE,
    STATE_FILE,
    best_checkpoint,
    checkpoint_dir,
    incomplete_reason,
    list_checkpoints,
    resolve_checkpoint,
)
from tformer.errors import CheckpointError, ConfigError
from tformer.interop.hf_files import open_weights, weight_files
from tformer.models import WEIGHTS_FILE
from tformer.models.safetensors_header import check_safetensors_header
from tformer.training import trainer as trainer_module
from tformer.training.checkpoint import RunLock, commit_checkpoint, recover_checkpoints
from tformer.training.evaluate import TranslationResult

pytestmark = pytest.mark.usefixtures("one_thread")

SCORES = {5: 1.0, 10: 0.5, 15: 2.0, 20: 1.5}  # dev BLEU by step: a best at 5, worse at 10, a new best at 15
STEPS = 20

# `tformer train` with the scripted scores; KILL_AT="before:NAME:N" (or "after:") kills the process with SIGKILL
# just before (after) the Nth os.replace onto a file or directory called NAME; SLOW=seconds sleeps after each step
SCRIPT = f"""
import os, signal, sys, time
from pathlib import Path
from tformer.cli import main
from tformer.training import trainer
from tformer.training.evaluate import TranslationResult

SCORES = {SCORES}
real_evaluate, real_step, real_replace, seen = trainer.Trainer._evaluate, trainer.Trainer.train_step, os.replace, []

def evaluate(self, n_sentences, final=False):
    def scripted(model, tokenizer, pairs, beam_size, alpha):
        sources, references = [s for s, _ in pairs], [r for _, r in pairs]
        return TranslationResult(SCORES[self.step], "scripted", sources, references, references)
    trainer.evaluate_translation = scripted
    return real_evaluate(self, n_sentences, final)

def train_step(self, batches):
    result = real_step(self, batches)
    time.sleep(float(os.environ.get("SLOW", "0")))
    return result

def replace(src, dst, *args, **kwargs):
    when, name, count = (os.environ.get("KILL_AT") or "never:-:0").split(":")
    hit = Path(dst).name == name and len(seen) + 1 == int(count)
    if Path(dst).name == name:
        seen.append(dst)
    if hit and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst, *args, **kwargs)
    if hit and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)

trainer.Trainer._evaluate, trainer.Trainer.train_step, os.replace = evaluate, train_step, replace
sys.exit(main(sys.argv[1:]))
"""


def scripted_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same scripted evaluations in this process."""
    real_evaluate = trainer_module.Trainer._evaluate

    def evaluate(self, n_sentences, final=False):
        def scripted(model, tokenizer, pairs, beam_size, alpha) -> TranslationResult:
            sources, references = [s for s, _ in pairs], [r for _, r in pairs]
            return TranslationResult(SCORES[self.step], "scripted", sources, references, references)

        monkeypatch.setattr(trainer_module, "evaluate_translation", scripted)
        return real_evaluate(self, n_sentences, final)

    monkeypatch.setattr(trainer_module.Trainer, "_evaluate", evaluate)


def run_script(recipe: Path, run_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "train", str(recipe), f"train.out_dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, **env},
    )


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / WEIGHTS_FILE)


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert not [name for name in a if not torch.equal(a[name], b[name])]


def recorded_step(run_dir: Path) -> int:
    return json.loads((run_dir / BEST_FILE).read_text())["step"]


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A recipe with a scored dev set (keeping 1 checkpoint besides the best), and an uninterrupted run of it."""
    directory = tmp_path_factory.mktemp("scored")
    dev = write_corpus(directory / "dev.tsv", n=4)
    recipe = write_recipe(
        directory, max_steps=STEPS, eval_every=5, keep_last=1, dev_corpus=str(dev), eval_sentences=4, beam_size=1
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one_thread does, and the subprocesses (ENV): the same arithmetic
    with pytest.MonkeyPatch.context() as monkeypatch:
        scripted_scores(monkeypatch)
        trainer(recipe).fit()
    torch.set_num_threads(threads)
    return recipe, directory / "run"


def test_the_uninterrupted_reference_keeps_its_best_and_its_last(scored) -> None:
    _, run_dir = scored
    assert steps(run_dir) == [15, 20]
    assert json.loads((run_dir / BEST_FILE).read_text()) == {"step": 15, "bleu": 2.0, "dev_sentences": 4}
    for checkpoint in list_checkpoints(run_dir):
        assert incomplete_reason(checkpoint) is None
        files = json.loads((checkpoint / COMPLETE_FILE).read_text())["files"]
        on_disk = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
        assert set(files) == on_disk - {COMPLETE_FILE, STATE_FILE}


# where the new best's save (step 15) is killed -> (checkpoints left, the step best.json names, resumed from)
KILLS = {
    "before its rename": ("before:step-00000015:1", [5, 10], 5, 10),
    "after its rename, before best.json": ("after:step-00000015:1", [5, 10, 15], 5, 15),
    "during best.json": ("before:best.json:2", [5, 10, 15], 5, 15),
}


@pytest.fixture(scope="module")
def killed_runs(scored, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """The runs KILLS names, started side by side (each mostly Python starting and training alone on one thread):
    moment -> (the process, its run directory)."""
    recipe, _ = scored
    runs = {}
    for i, (moment, (kill_at, *_)) in enumerate(KILLS.items()):
        run_dir = tmp_path_factory.mktemp("killed") / f"run-{i}"
        runs[moment] = run_script(recipe, run_dir, KILL_AT=kill_at), run_dir
    yield runs
    for process, _ in runs.values():
        process.kill()
        process.communicate()


@pytest.mark.parametrize("moment", KILLS)
def test_a_kill_during_a_new_best_save_keeps_the_best_and_resumes_from_the_newest_valid(
    scored, killed_runs, moment, monkeypatch, capsys
) -> None:
    recipe, reference = scored
    _, left, best, resumed_from = KILLS[moment]
    process, run_dir = killed_runs[moment]
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGKILL, stderr
    assert steps(run_dir) == left
    assert all(incomplete_reason(c) is None for c in list_checkpoints(run_dir))
    assert recorded_step(run_dir) == best  # best.json still names a checkpoint that exists
    assert best_checkpoint(run_dir) == resolve_checkpoint(run_dir) == checkpoint_dir(run_dir, best)
    if moment == "before its rename":  # the new checkpoint was whole, only not yet named
        assert incomplete_reason(run_dir / "checkpoints" / "step-00000015.tmp") is None

    scripted_scores(monkeypatch)
    resumed = trainer(recipe, f"train.out_dir={run_dir}")
    assert resumed.step == resumed_from
    if resumed_from == 15:  # a new best committed but not recorded is recorded on resume
        assert recorded_step(run_dir) == 15
    assert not (run_dir / "checkpoints" / "step-00000015.tmp").exists()
    resumed.fit()
    assert f"resumed from {checkpoint_dir(run_dir, resumed_from)}" in capsys.readouterr().out
    assert steps(run_dir) == [15, 20]
    assert (run_dir / BEST_FILE).read_text() == (reference / BEST_FILE).read_text()
    assert_bit_equal(weights(checkpoint_dir(run_dir, STEPS)), weights(checkpoint_dir(reference, STEPS)))


@pytest.mark.parametrize(
    "damage", ["missing", "empty", "corrupt", "a missing step", "an incomplete step", "not a step number"]
)
def test_a_damaged_best_json_is_derived_from_the_trainer_states(scored, damage, tmp_path: Path, caplog) -> None:
    _, reference = scored
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    best = run_dir / BEST_FILE
    if damage == "missing":
        best.unlink()
    elif damage == "empty":
        best.write_text("")
    elif damage == "corrupt":
        best.write_text('{"step": 15, "bl')
    elif damage == "a missing step":
        best.write_text(json.dumps({"step": 10, "bleu": 9.0, "dev_sentences": 4}))
    elif damage == "an incomplete step":
        (checkpoint_dir(run_dir, 20) / WEIGHTS_FILE).write_bytes(b"torn")
        best.write_text(json.dumps({"step": 20, "bleu": 9.0, "dev_sentences": 4}))
    else:
        best.write_text(json.dumps({"step": "15", "bleu": 2.0}))
    with caplog.at_level(logging.WARNING, logger="tformer.checkpoints"):
        assert best_checkpoint(run_dir) == checkpoint_dir(run_dir, 15)  # the first to reach the highest best_bleu
        assert resolve_checkpoint(run_dir) == checkpoint_dir(run_dir, 15)
    assert "the best by the checkpoints' trainer states" in caplog.text


def test_resume_skips_incomplete_and_unreadable_checkpoints_with_a_warning(scored, tmp_path: Path, capsys) -> None:
    """Step 20's trainer state is torn and step 15 lost its complete.json: the run resumes from step 10 (kept here by
    a larger keep_last) and trains on to the reference's weights, replacing both."""
    recipe, reference = scored
    whole = trainer(recipe, f"train.out_dir={tmp_path / 'whole'}", "train.keep_last=10", "train.eval_every=1000")
    whole.fit()
    run_dir = tmp_path / "run"
    shutil.copytree(whole.run_dir, run_dir)
    state = checkpoint_dir(run_dir, 20) / STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    (checkpoint_dir(run_dir, 15) / COMPLETE_FILE).unlink()
    resumed = trainer(recipe, f"train.out_dir={run_dir}", "train.keep_last=10", "train.eval_every=1000")
    assert resumed.step == 10
    warning = capsys.readouterr().err
    assert "skipped checkpoints that cannot be resumed" in warning
    assert "step-00000020 (" in warning and STATE_FILE in warning
    assert f"step-00000015 (no {COMPLETE_FILE}" in warning
    resumed.fit()
    assert all(incomplete_reason(c) is None for c in list_checkpoints(run_dir))
    assert_bit_equal(weights(checkpoint_dir(run_dir, STEPS)), weights(checkpoint_dir(reference, STEPS)))


def test_a_run_whose_checkpoints_are_all_invalid_is_refused_rather_than_restarted(scored, tmp_path: Path) -> None:
    recipe, reference = scored
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    for checkpoint in list_checkpoints(run_dir):
        (checkpoint / COMPLETE_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"holds no checkpoint that can be resumed \(step-00000020 .*; delete"):
        trainer(recipe, f"train.out_dir={run_dir}")
    assert steps(run_dir) == [15, 20]


# ---- SIGTERM, the lock, the recipe --------------------------------------------------------------------------------


def test_sigterm_saves_a_checkpoint_exits_cleanly_and_resumes_bit_exactly(scored, tmp_path: Path) -> None:
    recipe, reference = scored
    run_dir = tmp_path / "run"
    process = run_script(recipe, run_dir, SLOW="0.05")
    deadline = time.monotonic() + 60
    while not list_checkpoints(run_dir) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    # meanwhile a second trainer on the same out_dir is refused, naming the first's pid
    with pytest.raises(CheckpointError, match=rf"in use by another training run \(pid {process.pid}\b"):
        trainer(recipe, f"train.out_dir={run_dir}")
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    saved = re.search(r"interrupted: saving a checkpoint at step (\d+)", stdout)
    assert saved, stdout
    step = int(saved.group(1))
    assert 5 <= step < STEPS and max(steps(run_dir)) == step
    assert incomplete_reason(checkpoint_dir(run_dir, step)) is None
    with pytest.MonkeyPatch.context() as monkeypatch:
        scripted_scores(monkeypatch)
        resumed = trainer(recipe, f"train.out_dir={run_dir}")
        assert resumed.step == step
        resumed.fit()
    assert_bit_equal(weights(checkpoint_dir(run_dir, STEPS)), weights(checkpoint_dir(reference, STEPS)))


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from tformer.training.checkpoint import RunLock; "
            "lock = RunLock(Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path))} is in use .*\(pid {holder.pid}, "):
            RunLock(tmp_path)
    finally:
        holder.kill()
        holder.communicate()
    first, second = RunLock(tmp_path), RunLock(tmp_path)  # the kernel released the dead holder's lock
    assert (tmp_path / "train.lock").read_text() == f"{os.getpid()}\n"  # trainers in one process share it
    first.release()
    assert held_elsewhere(tmp_path)
    second.release()
    assert not held_elsewhere(tmp_path)


def held_elsewhere(directory: Path) -> bool:
    """Whether the flock on `directory`'s train.lock is held (another open file of it cannot take it)."""
    with open(directory / "train.lock") as other:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def test_a_changed_recipe_is_refused_with_its_diff_unless_forced(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, max_steps=5)
    trainer(recipe).fit()
    with pytest.raises(ConfigError) as refused:
        trainer(recipe, "train.lr=0.002", "model.d_ff=48", "train.max_steps=10")
    message = str(refused.value)
    assert "model.d_ff: 64 -> 48; train.lr: 0.001 -> 0.002." in message
    assert "max_steps" not in message and "train.resume=force" in message
    # when to stop, evaluate, save and log may change; the refused tries left train.yaml and the lock alone
    allowed = trainer(recipe, "train.max_steps=10", "train.eval_every=7", "train.keep_last=2", "train.log_every=1")
    assert allowed.step == 5
    allowed.close()
    forced = trainer(recipe, "train.lr=0.002", "train.resume=force")
    assert forced.step == 5
    forced.close()
    written = (tmp_path / "run" / "train.yaml").read_text()
    assert "lr: 0.002" in written and "resume: force" in written


# ---- the file operations of a save --------------------------------------------------------------------------------


def test_every_file_and_directory_is_flushed_before_the_rename_and_the_marker_is_written_last(
    tmp_path: Path, monkeypatch
) -> None:
    run = trainer(write_recipe(tmp_path), "train.max_steps=1")
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(Path(dst).resolve())))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run._save()
    run.close()
    final = checkpoint_dir(run.run_dir, 0).resolve()
    tmp = final.with_name(final.name + ".tmp")
    rename = events.index(("replace", str(final)))
    flushed = {path for kind, path in events[:rename] if kind == "fsync"}
    written = [p.relative_to(final) for p in final.rglob("*")]
    assert len(written) > 5
    missing = [str(p) for p in written if not {str(tmp / p), f"{tmp / p}.tmp"} & flushed]  # atomic writes: .tmp
    assert not missing, f"not flushed before the rename: {missing}"
    assert str(tmp) in flushed and ("fsync", str(final.parent)) in events[rename:]
    marker = events.index(("replace", str(tmp / COMPLETE_FILE)))
    files_flushed = [i for i, (kind, path) in enumerate(events) if kind == "fsync" and path.startswith(f"{tmp}/")]
    assert all(i < marker for i in files_flushed if COMPLETE_FILE not in events[i][1])  # the marker comes last


def make_checkpoint(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / WEIGHTS_FILE).write_text(content)
    torch.save({"step": int(path.name.removeprefix("step-").split(".")[0]), "best_bleu": -1.0}, path / STATE_FILE)
    return path


def test_replacing_a_checkpoint_of_the_same_step_and_a_crash_between_its_renames(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    commit_checkpoint(make_checkpoint(root / "step-00000005.tmp", "old"))
    commit_checkpoint(make_checkpoint(root / "step-00000005.tmp", "new"))
    assert [p.name for p in root.iterdir()] == ["step-00000005"]
    assert (root / "step-00000005" / WEIGHTS_FILE).read_text() == "new"
    # killed after the old one was set aside, before the new one took its name: the old one comes back
    os.replace(root / "step-00000005", root / "step-00000005.old")
    make_checkpoint(root / "step-00000005.tmp", "newer")
    recover_checkpoints(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005"]
    assert (root / "step-00000005" / WEIGHTS_FILE).read_text() == "new"
    assert incomplete_reason(root / "step-00000005") is None
    # killed after the new one took its name, before the old one was deleted; killed while pruning step 1
    shutil.copytree(root / "step-00000005", root / "step-00000005.old")
    make_checkpoint(root / "step-00000001.deleting", "pruned")
    recover_checkpoints(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005"]


# ---- malformed safetensors files and indexes ----------------------------------------------------------------------


def safetensors_bytes(header: object, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
BAD_HEADERS = {  # what -> (file contents, the words the error must hold)
    "too short": (b"\x01\x02", "too short"),
    "huge header length": (struct.pack("<Q", 1 << 40) + b"{}", "header length field"),
    "header past the end": (struct.pack("<Q", 64) + b"{}", "only 2 follow it"),
    "not JSON": (safetensors_bytes(b"{nope"), "the header is not JSON"),
    "not an object": (safetensors_bytes([1, 2]), "a JSON list"),
    "deep nesting": (safetensors_bytes(b"[" * 100_000 + b"]" * 100_000), "not JSON"),
    "bad metadata": (safetensors_bytes({"__metadata__": {"a": 1}}), "__metadata__"),
    "no dtype": (safetensors_bytes({"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "'w' has no 'dtype'"),
    "unknown dtype": (safetensors_bytes({"w": {**F32x2, "dtype": "Q9"}}, bytes(8)), "'w': dtype 'Q9'"),
    "negative shape": (safetensors_bytes({"w": {**F32x2, "shape": [-2]}}, bytes(8)), "'w': shape [-2]"),
    "offsets past the data": (safetensors_bytes({"w": {**F32x2, "data_offsets": [0, 16]}}, bytes(8)), "outside"),
    "bad offsets": (safetensors_bytes({"w": {**F32x2, "data_offsets": [8]}}, bytes(8)), "'w': data_offsets [8]"),
    "shape against offsets": (safetensors_bytes({"w": {**F32x2, "shape": [3]}}, bytes(8)), "needs 12"),
    "overflowing shape": (safetensors_bytes({"w": {**F32x2, "shape": [2**62, 2**62]}}, bytes(8)), "needs"),
    "overlap": (
        safetensors_bytes({"a": F32x2, "b": {**F32x2, "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
        "'a' and 'b' overlap",
    ),
    "uncovered bytes": (safetensors_bytes({"w": F32x2}, bytes(12)), "bytes 8 to 12 belong to no tensor"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_a_malformed_safetensors_header_names_the_file_and_the_field(case, tmp_path: Path) -> None:
    contents, words = BAD_HEADERS[case]
    path = tmp_path / WEIGHTS_FILE
    path.write_bytes(contents)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: not a readable safetensors file (")) as err:
        check_safetensors_header(path)
    assert words in str(err.value)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: not a readable safetensors file (")):
        with open_weights(tmp_path):
            pass
    # the reference: the safetensors library refuses the same file, so the check refuses nothing it would read
    with pytest.raises(Exception):  # noqa: B017, PT011 - the library's own error types vary
        with safe_open(str(path), framework="pt") as f:
            [f.get_tensor(name) for name in f.keys()]


def test_a_well_formed_file_passes_and_declares_what_safetensors_reads(tmp_path: Path) -> None:
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 5),
        "i": torch.tensor([1, 2], dtype=torch.int64),
    }
    path = tmp_path / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = check_safetensors_header(path)
    with safe_open(str(path), framework="pt") as f:
        assert set(header) == set(f.keys())
        assert {name: header[name]["shape"] for name in header} == {
            n: list(f.get_slice(n).get_shape()) for n in f.keys()
        }


@pytest.mark.parametrize(
    "index, words",
    [
        ({"weight_map": {"w": "../outside.safetensors"}}, "outside the model directory"),
        ({"weight_map": {"w": "/etc/passwd"}}, "outside the model directory"),
        ({"weight_map": {"w": "sub/../../x.safetensors"}}, "outside the model directory"),
        ({"weight_map": {"w": "..\\x.safetensors"}}, "outside the model directory"),
        ({"weight_map": {"w": 3}}, "weight_map['w'] is 3"),
        ({"weight_map": ["w"]}, "weight_map field"),
        ({"metadata": {}}, "weight_map field (an object from tensor names to shard files) is missing"),
        ([1], "weight_map field"),
        ("{", "not JSON"),
    ],
)
def test_a_malformed_index_or_a_shard_outside_the_directory_is_refused(index, words, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "outside.safetensors"))  # what an escaping name would reach
    path = model / "model.safetensors.index.json"
    path.write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as err:
        weight_files(model)
    assert words in str(err.value)


def test_a_sharded_model_inside_its_directory_loads(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "./model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with open_weights(tmp_path) as found:
        assert torch.equal(found.get("a"), torch.ones(2)) and torch.equal(found.get("b"), torch.zeros(3))


def test_a_tformer_checkpoint_with_a_malformed_header_names_the_tensor(tmp_path: Path) -> None:
    from tformer import ModelConfig, build_model, load

    build_model(ModelConfig.from_preset("tiny-gpt2")).save(tmp_path)
    path = tmp_path / WEIGHTS_FILE
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    name = next(n for n in header if n != "__metadata__")
    header[name]["dtype"] = "F16"  # half the bytes its offsets hold
    path.write_bytes(safetensors_bytes(header, data[8 + length :]))
    with pytest.raises(Exception):  # noqa: B017, PT011 - the reference: the library refuses it too
        load_file(path)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: .*tensor '{re.escape(name)}': data_offsets"):
        load(tmp_path)
