"""The trainer survives what stops a run: bit-exact resume after kill -9 (even mid-checkpoint), Ctrl-C, divergence.

Runs are tiny (a 200-line synthetic corpus, the tiny-transformer preset) and the command-line ones run in
subprocesses with one thread, so that signals and exit codes are real. The reference is an uninterrupted run of
the same recipe: a resumed run must end with its weights, bit for bit, and log each step once.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ENV, steps, tformer_train, trainer, write_recipe
from safetensors.torch import load_file

from tformer.checkpoints import checkpoint_dir, list_checkpoints, resolve_checkpoint
from tformer.models import WEIGHTS_FILE, load
from tformer.training import TrainingDiverged
from tformer.training.checkpoint import load_trainer_state

pytestmark = pytest.mark.usefixtures("one_thread")


def start_training(*command: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )


def wait_for_checkpoint(process: subprocess.Popen, run_dir: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not list_checkpoints(run_dir):
        if process.poll() is not None:
            pytest.fail(f"training exited with {process.returncode} before a checkpoint: {process.stderr.read()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("no checkpoint appeared")
        time.sleep(0.005)


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


def test_divergence_on_the_command_line_is_one_error_and_its_remedies_with_exit_code_2(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, optimizer="adam-noam", lr=1e30, save_every=1)
    result = tformer_train(recipe)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = re.split(r"[\r\n]+", result.stderr.strip())
    start = next(i for i, line in enumerate(lines) if line.startswith("tformer: error:"))
    message, remedies = lines[start], lines[start + 1 :]
    diverged = re.fullmatch(r"tformer: error: step (\d+): loss .* is not finite; .*set clip_grad; in order:", message)
    assert diverged, result.stderr
    assert "First non-finite value: " in message and "not located" not in message
    assert [line.split(":")[0].strip() for line in remedies] == [
        "1. train.bf16",
        "2. train.lr",
        "3. train.clip_grad",
        "4. model.init",
    ]
    assert max(steps(tmp_path / "run")) == int(diverged.group(1)) - 1
    assert_complete(list_checkpoints(tmp_path / "run")[-1])
