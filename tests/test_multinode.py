"""Multi-node training, simulated on one machine: two torchrun launchers side by side, one process each, meeting
through torchrun's c10d rendezvous on loopback, as two nodes of a cluster meet at the first node's address.

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT -m tformer train ...

With FSDP the two nodes follow the loss curve of one process and of one node with two processes (the tolerances of
test_distributed.py). A node that dies after a checkpoint (its launcher and its rank killed) stops the other node
with the clear collective error, and the job resumes from that DCP checkpoint on two nodes again or on the one node
left, on the same curve.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from tempfile import TemporaryFile

import pytest
from conftest import free_port
from helpers import ENV, run_processes, torchrun
from test_distributed import NO_DROPOUT, RESUME_AT, STEPS, assert_same_curve, copy_checkpoint, losses

from tformer.checkpoints import checkpoint_dir, list_checkpoints
from tformer.training.sharded import SHARDED_DIR

WORKER = Path(__file__).with_name("node_worker.py")  # `tformer train`, with a node that dies after a checkpoint
FSDP = "train.parallel=fsdp"


def node_launcher(nnodes: int, port: int) -> list[str]:
    """One node's torchrun: one process, joining the others at the c10d store on 127.0.0.1:`port`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=tformer-test",
    ]


def run_nodes(nnodes: int, *args: str, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """`args` (a script or `-m module ...`) on `nnodes` simulated nodes, launched side by side; each node's result.

    Their output goes to files: a pipe left unread while the test waits for the other node could fill and block."""
    command = [*node_launcher(nnodes, free_port()), *args]
    with ExitStack() as files:
        logs = [
            (files.enter_context(TemporaryFile("w+")), files.enter_context(TemporaryFile("w+"))) for _ in range(nnodes)
        ]
        nodes = [subprocess.Popen(command, stdout=out, stderr=err, text=True, env=ENV) for out, err in logs]
        try:
            for node in nodes:
                node.wait(timeout=timeout)
        finally:
            for node in nodes:
                node.kill()
                node.wait()
        outputs = []
        for out, err in logs:
            out.seek(0)
            err.seek(0)
            outputs.append((out.read(), err.read()))
    return [subprocess.CompletedProcess(command, n.returncode, *o) for n, o in zip(nodes, outputs, strict=True)]


def train_args(recipe: Path, run_dir: Path, *overrides: str) -> list[str]:
    return ["train", str(recipe), f"train.out_dir={run_dir}", *NO_DROPOUT, *overrides]


@pytest.fixture(scope="module")
def recipe(dist_reference: tuple[Path, Path]) -> Path:
    return dist_reference[0]  # test_distributed.py's recipe; the run directories here have names of their own


@pytest.fixture(scope="module")
def one_process(dist_reference: tuple[Path, Path]) -> Path:
    return dist_reference[1]


@pytest.fixture(scope="module")
def one_node(recipe: Path) -> Path:
    """One node with two processes (torchrun --standalone), FSDP."""
    run_dir = recipe.parent / "one-node"
    result = run_processes(torchrun(2, "-m", "tformer", *train_args(recipe, run_dir, FSDP)))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def node_died(recipe: Path) -> Path:
    """Two nodes training with FSDP until the node of rank 1 dies, right after the checkpoint of step RESUME_AT."""
    run_dir = recipe.parent / "two-nodes"
    # a short collective timeout: the survivor sees the dropped connection at once, this only bounds a hang
    results = run_nodes(
        2, str(WORKER), "1", str(RESUME_AT), *train_args(recipe, run_dir, FSDP, "train.dist_timeout=30")
    )
    dead = [r for r in results if r.returncode == -9]
    survivor = [r for r in results if r.returncode != -9]
    assert len(dead) == 1 and len(survivor) == 1, [(r.returncode, r.stderr[-2000:]) for r in results]
    assert survivor[0].returncode != 0
    assert "tformer: error: rank 0 of 2: a collective failed" in survivor[0].stderr, survivor[0].stderr[-3000:]
    assert [p.name for p in list_checkpoints(run_dir)] == [checkpoint_dir(run_dir, RESUME_AT).name]
    shards = list((checkpoint_dir(run_dir, RESUME_AT) / SHARDED_DIR).glob("*.distcp"))
    assert len(shards) == 2, "one DCP shard from each node"
    return run_dir


def test_two_nodes_resume_after_one_dies_on_the_curve_of_one_node_and_of_one_process(
    recipe: Path, one_process: Path, one_node: Path, node_died: Path
) -> None:
    """The whole two-node curve: steps 1..RESUME_AT before the node died, the rest after both nodes restarted."""
    assert sorted(losses(node_died)) == list(range(1, RESUME_AT + 1))
    results = run_nodes(2, "-m", "tformer", *train_args(recipe, node_died, FSDP))
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    assert sum(f"resumed from {checkpoint_dir(node_died, RESUME_AT)}" in r.stdout for r in results) == 1
    assert sum("finished at step" in r.stdout for r in results) == 1, "only rank 0 reports"
    assert_same_curve(node_died, one_process, range(1, STEPS + 1))
    assert_same_curve(node_died, one_node, range(1, STEPS + 1))


def test_after_a_node_dies_the_job_resumes_on_the_node_left(
    recipe: Path, one_process: Path, one_node: Path, node_died: Path
) -> None:
    run_dir = recipe.parent / "node-left"
    copy_checkpoint(node_died, RESUME_AT, run_dir)  # the step the other test resumes from: it keeps that checkpoint
    (result,) = run_nodes(1, "-m", "tformer", *train_args(recipe, run_dir, FSDP))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {checkpoint_dir(run_dir, RESUME_AT)}" in result.stdout
    assert_same_curve(run_dir, one_process, range(RESUME_AT + 1, STEPS + 1))
    assert_same_curve(run_dir, one_node, range(RESUME_AT + 1, STEPS + 1))
