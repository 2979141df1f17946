"""Distributed training on the CPU with gloo, as a user launches it: torchrun, 2 (or 4) real processes.

The reference is one process training the same recipe. Every strategy walks the same global batches, so
with dropout off their loss curves must agree with it up to float summation order; tensor parallelism
must give the unsharded model's logits and gradients; checkpoints resume at another world size; and a
rank that dies or hangs makes the others stop with a clear error instead of waiting forever.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port
from helpers import ENV, run_processes, torchrun, write_recipe
from safetensors.torch import load_file

from tformer.checkpoints import checkpoint_dir, list_checkpoints
from tformer.config import ConfigError
from tformer.models import WEIGHTS_FILE, CheckpointError, build_model, load
from tformer.training import TrainConfig
from tformer.training.distributed import init_distributed, shard_tensor_parallel
from tformer.training.sharded import SHARDED_DIR, load_sharded

STEPS, RESUME_AT = 8, 4
NO_DROPOUT = ("model.dropout=0", "model.attn_dropout=0")
LOSS_TOLERANCE = 1e-5  # relative; measured differences are below 1e-7 (summation order of the reductions)
WEIGHT_TOLERANCE = 1e-5


def train(recipe: Path, out_dir: Path, nproc: int = 1, *overrides: str) -> subprocess.CompletedProcess:
    """`tformer train` in one process, or under torchrun with `nproc` ranks."""
    args = ["-m", "tformer", "train", str(recipe), f"train.out_dir={out_dir}", *NO_DROPOUT, *overrides]
    command = [sys.executable, *args] if nproc == 1 else torchrun(nproc, *args)
    result = run_processes(command)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint_dir(run_dir, STEPS) / WEIGHTS_FILE)


def assert_same_curve(run_dir: Path, reference: Path, steps: range) -> None:
    got, expected = losses(run_dir), losses(reference)
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_TOLERANCE), f"step {step}"


def one_process_reference(directory: Path) -> tuple[Path, Path]:
    """The recipe in `directory` and its run in one process (conftest's `dist_reference` shares them with
    test_multinode.py): two batches a step (grad_accum 2), so that 2 data-parallel ranks each train on one."""
    recipe = write_recipe(directory, max_steps=STEPS, save_every=RESUME_AT, log_every=1, grad_accum=2, keep_last=5)
    train(recipe, directory / "single")
    return recipe, directory / "single"


@pytest.fixture(scope="module")
def recipe(dist_reference: tuple[Path, Path]) -> Path:
    return dist_reference[0]


@pytest.fixture(scope="module")
def reference(dist_reference: tuple[Path, Path]) -> Path:
    return dist_reference[1]


STRATEGIES = {  # name -> (ranks, overrides)
    "ddp": (2, ["train.parallel=ddp"]),
    # with dev BLEU every 3 steps: rank 0 evaluates the gathered weights, a new best is saved by all ranks
    "fsdp": (2, ["train.parallel=fsdp", "train.eval_every=3", "train.eval_sentences=20", "train.dev_corpus={corpus}"]),
    "fsdp-grad-op": (2, ["train.parallel=fsdp", "train.fsdp_sharding=grad-op"]),
    "tp": (2, ["train.parallel=tp"]),
    "fsdp+tp (2 x 2 mesh)": (4, ["train.parallel=fsdp+tp", "train.tp_size=2"]),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_follows_the_single_process_loss_curve(strategy: str, recipe: Path, reference: Path) -> None:
    ranks, overrides = STRATEGIES[strategy]
    run_dir = recipe.parent / strategy.split()[0]
    overrides = [o.format(corpus=recipe.parent / "corpus.tsv") for o in overrides]
    result = train(recipe, run_dir, ranks, *overrides)
    assert result.stdout.count("finished at step") == 1, "only rank 0 reports"
    if "train.eval_every=3" in overrides:  # evaluating changes nothing in training
        assert result.stdout.count("dev BLEU (all 200 sentences") == 1
        assert json.loads((run_dir / "best.json").read_text())["step"] in (3, 6, 8)
    assert_same_curve(run_dir, reference, range(1, STEPS + 1))
    expected = final_weights(reference)
    got = final_weights(run_dir)  # the consolidated export, whatever the sharding
    assert got.keys() == expected.keys()
    for name in expected:
        if name.endswith("k_proj.bias"):
            # softmax ignores a bias shared by all keys, so its true gradient is 0: Adam turns the rounding
            # noise left in it into full-size steps, which differ with the summation order
            continue
        torch.testing.assert_close(got[name], expected[name], atol=WEIGHT_TOLERANCE, rtol=0, msg=name)
    assert load(checkpoint_dir(run_dir, STEPS)).config.family == "encoder-decoder"


def test_fsdp_bf16_mixed_precision_trains_close_to_fp32(recipe: Path, reference: Path) -> None:
    run_dir = recipe.parent / "fsdp-bf16"
    train(recipe, run_dir, 2, "train.parallel=fsdp", "train.fsdp_param_dtype=bfloat16")
    got, expected = losses(run_dir), losses(reference)
    assert got[1] == pytest.approx(expected[1], rel=1e-2)  # bf16 compute: ~3 significant digits
    assert got[STEPS] < got[1] - 0.5, "it still learns"


def copy_checkpoint(source_run: Path, step: int, run_dir: Path) -> None:
    """A run directory holding one checkpoint of another run (and its tokenizer), to resume from."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint_dir(source_run, step), checkpoint_dir(run_dir, step))
    shutil.copy(source_run / "tokenizer.json", run_dir / "tokenizer.json")


# a two-rank FSDP checkpoint resuming in one process: tests/test_multinode.py (its two nodes' checkpoint, resumed on
# the node left)


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_a_one_process_checkpoint_resumes_on_two_ranks(strategy: str, recipe: Path, reference: Path) -> None:
    run_dir = recipe.parent / f"resumed-on-2-{strategy}"
    copy_checkpoint(reference, RESUME_AT, run_dir)
    result = train(recipe, run_dir, 2, f"train.parallel={strategy}")
    assert f"resumed from {checkpoint_dir(run_dir, RESUME_AT)}" in result.stdout
    assert_same_curve(run_dir, reference, range(RESUME_AT + 1, STEPS + 1))


def test_tensor_parallel_logits_and_gradients_equal_the_unsharded_model(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    worker = Path(__file__).with_name("tp_worker.py")
    result = run_processes(torchrun(2, str(worker), str(out)))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report) == 5
    for case, diffs in report.items():
        assert diffs["sharded_parameters"] > 0, case
        assert diffs["logits"] < 1e-5, case
        assert diffs["gradients"] < 1e-5, case


# ---- failures ------------------------------------------------------------------------------------------------


def start_two_ranks(recipe: Path, run_dir: Path, timeout: float) -> list[subprocess.Popen]:
    """Two ranks of `tformer train` started by hand (as a multi-node launcher would), training until stopped."""
    port = free_port()
    processes = []
    for rank in (0, 1):
        env = {
            **ENV,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
        }
        command = [
            sys.executable,
            "-m",
            "tformer",
            "train",
            str(recipe),
            f"train.out_dir={run_dir}",
            *NO_DROPOUT,  # the recipe that resumes below: a run directory keeps to one recipe
            "train.parallel=fsdp",
            "train.max_steps=100000",
            "train.save_every=2",
            f"train.dist_timeout={timeout}",
        ]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return processes


def stop_rank_1(recipe: Path, run_dir: Path, timeout: float, how: signal.Signals) -> list[subprocess.Popen]:
    """Two ranks training until their first checkpoint, then rank 1 killed or stopped (`how`)."""
    processes = start_two_ranks(recipe, run_dir, timeout)
    deadline = time.monotonic() + 120
    while not list_checkpoints(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list_checkpoints(run_dir), processes[0].communicate(timeout=5)
    processes[1].send_signal(how)
    return processes


def assert_failed_fast_and_resumes(
    recipe: Path, run_dir: Path, rank_0: subprocess.Popen, stopped: float, timeout: float
) -> None:
    """Rank 0 ended with the clear error within its timeout (and a margin) of rank 1's end at `stopped` (monotonic
    seconds); its last checkpoint resumes."""
    _, stderr = rank_0.communicate(timeout=max(1.0, stopped + timeout + 60 - time.monotonic()))
    assert time.monotonic() - stopped < timeout + 30
    assert rank_0.returncode == 2, stderr[-2000:]
    assert "tformer: error: rank 0 of 2: a collective failed" in stderr
    assert "Traceback" not in stderr
    latest = list_checkpoints(run_dir)[-1]
    model = load(latest)
    assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    result = train(recipe, run_dir, 1, f"train.max_steps={int(latest.name[5:]) + 1}")
    assert f"resumed from {latest}" in result.stdout


def test_when_a_rank_dies_or_hangs_the_other_fails_fast_and_the_checkpoint_survives(
    recipe: Path, tmp_path: Path
) -> None:
    """Two ranks started by hand (as a multi-node launcher would); rank 1 is stopped (SIGSTOP) mid-training, and while
    rank 0 waits out its timeout, another pair runs in which rank 1 is killed."""
    # the hung pair waits the timeout out; it still leaves rank 0 time to prepare the data and write checkpoints,
    # which the other rank waits for at a barrier
    timeout, pairs = 8, []
    try:
        pairs.append(hung := stop_rank_1(recipe, tmp_path / "hung", timeout, signal.SIGSTOP))
        hung_at = time.monotonic()
        pairs.append(killed := stop_rank_1(recipe, tmp_path / "killed", timeout, signal.SIGKILL))
        assert_failed_fast_and_resumes(recipe, tmp_path / "killed", killed[0], time.monotonic(), timeout)
        assert_failed_fast_and_resumes(recipe, tmp_path / "hung", hung[0], hung_at, timeout)
    finally:
        for process in (process for pair in pairs for process in pair):
            process.kill()
            process.communicate()


# ---- bad configs and files (in process) ----------------------------------------------------------------------


def test_the_global_batch_must_split_evenly_over_data_parallel_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"grad_accum \(1\).*multiple of 2"):
        init_distributed(TrainConfig(grad_accum=1, parallel="ddp"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="fsdp\\+tp.*tp_size"):
        init_distributed(TrainConfig(grad_accum=2, parallel="fsdp+tp", tp_size=2), torch.device("cpu"))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("parallel", "zero3", "unknown parallel 'zero3'"),
        ("fsdp_sharding", "half", "unknown fsdp_sharding"),
        ("fsdp_param_dtype", "fp8", "unknown fsdp_param_dtype"),
        ("dist_timeout", 0.0, "dist_timeout must be"),
        ("tp_size", -1, "tp_size must be"),
    ],
)
def test_bad_distributed_keys_are_config_errors(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{key: value})


class _TwoWayMesh:  # the divisibility check runs before the mesh is used
    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0


def test_tensor_parallel_needs_heads_that_split_evenly() -> None:
    from tformer.config import ModelConfig

    model = build_model(ModelConfig.from_dict({"preset": "tiny-gpt2", "n_heads": 1, "d_model": 32}))
    with pytest.raises(ConfigError, match=r"model.n_heads \(1\) evenly"):
        shard_tensor_parallel(model, _TwoWayMesh())


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch should-not-exist",))


def test_a_tampered_dcp_metadata_file_is_refused_without_running_code(
    recipe: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sharded = tmp_path / SHARDED_DIR
    shutil.copytree(checkpoint_dir(reference, RESUME_AT) / SHARDED_DIR, sharded)
    (sharded / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    model = load(checkpoint_dir(reference, RESUME_AT)).train()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="os.system|posix.system"):
        load_sharded(sharded, model, optimizer)
    assert not (tmp_path / "should-not-exist").exists()
