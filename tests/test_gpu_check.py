"""benchmarks/gpu_check.sh --dry-run: every check of the prepared GPU check runs its CPU side, so that the script
and what it calls keep working between the runs on a lent GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["cuda-tests", "ddp", "mfu", "engine-vs-hf"]


def test_the_dry_run_gives_one_line_per_check(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.txt"
    env = {**os.environ, "GPU_CHECK_OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = out.read_text().splitlines()
    assert lines[0].startswith("gpu_check ") and lines[0].endswith("--dry-run")
    summary = [line.split(maxsplit=2) for line in lines[1:5]]
    assert [name for name, _, _ in summary] == CHECKS
    statuses = dict((name, status) for name, status, _ in summary)
    assert statuses["ddp"] == "PASS"  # two gloo ranks against one process, loss for loss
    assert "max |ddp - one process|" in lines[2]
    assert statuses["mfu"] == "SKIP" and "gpt2 -, transformer-base -" in lines[3]  # the tiny mode ran both
    assert all(status != "FAIL" for status in statuses.values())
    for name in CHECKS:  # each check's own output follows
        assert f"---- {name}" in out.read_text()
