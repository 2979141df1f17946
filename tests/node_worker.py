"""Run by tests/test_multinode.py under torchrun, one "node" of a multi-node job: `tformer train ARGS...`, except
that the node of rank DIE_RANK dies right after the checkpoint of step DIE_STEP is committed.

    node_worker.py DIE_RANK DIE_STEP train RECIPE key=value ...

The node dies as a machine that loses power: its torchrun agent and this worker get SIGKILL, with no chance to
say goodbye to the other node. Dying here rather than at a signal from the test makes the step certain: a tiny
model trains the rest of its steps faster than a test could notice the checkpoint and kill the node.
"""

from __future__ import annotations

import os
import signal
import sys

from tformer.cli import main
from tformer.training.trainer import Trainer


def die_after_checkpoint(rank: int, step: int) -> None:
    save = Trainer._save

    def save_then_die(self: Trainer, *args: object, **kwargs: object) -> None:
        save(self, *args, **kwargs)  # returns once every rank has the checkpoint committed (its last barrier)
        if self.dist.rank == rank and self.step == step:
            sys.stdout.flush()
            os.kill(os.getppid(), signal.SIGKILL)  # the node's torchrun agent
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer._save = save_then_die


if __name__ == "__main__":
    die_after_checkpoint(int(sys.argv[1]), int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
