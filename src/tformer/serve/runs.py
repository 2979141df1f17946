"""The training runs under a directory, read for the playground's dashboard (`tformer serve --runs DIR`).

A run is a directory holding a `metrics.jsonl` (see `tformer.training.checkpoint`): one JSON object per line, a
loss record (`step`, `loss`, `lr`, ...) or an evaluation record (`step`, `dev_bleu` or `dev_ppl`, ...). A running
training appends lines while the page reads, so a reader asks for the bytes after the offset it has already read
and gets only whole lines back; a resumed run rewrites the file shorter, which the reader is told about (`reset`).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
MAX_DEPTH = 3  # runs/<group>/<run>/metrics.jsonl at most; checkpoints/ and hidden directories are not searched
SKIPPED = {"checkpoints", "__pycache__", "node_modules"}
LIVE_SECONDS = 120.0  # a run whose metrics.jsonl changed this recently is shown as running
MAX_CHUNK = 8 << 20  # bytes of metrics.jsonl per answer; the page asks again from the offset it got


@dataclass(frozen=True)
class RunMetrics:
    """Whole records of a run's metrics.jsonl after a byte offset, and the offset to ask from next."""

    records: list[dict[str, Any]]
    offset: int  # the byte after the last whole line read
    size: int  # the file's size when read
    updated: float  # the file's modification time (seconds since the epoch)
    reset: bool  # the file is shorter than the offset asked for (a resumed run rewrote it): read from 0
    skipped: int  # lines that were not JSON objects with a step


class RunsDir:
    """The runs under `root`, found by their metrics.jsonl, and their records, read on each request."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()

    def list(self) -> list[dict[str, Any]]:
        """One entry per run, the most recently updated first: id (the path under root), updated, running, bytes."""
        now = time.time()
        entries = []
        for run_id, path in self._find().items():
            try:
                stat = path.stat()
            except OSError:  # removed since the walk
                continue
            entries.append(
                {
                    "id": run_id,
                    "updated": stat.st_mtime,
                    "running": now - stat.st_mtime < LIVE_SECONDS,
                    "bytes": stat.st_size,
                }
            )
        return sorted(entries, key=lambda e: (-e["updated"], e["id"]))

    def metrics_path(self, run_id: str) -> Path | None:
        """The metrics.jsonl of the run `run_id` names, or None: only runs the walk finds, never a path from outside."""
        return self._find().get(run_id)

    def read(self, run_id: str, offset: int = 0) -> RunMetrics | None:
        """The whole records after `offset` bytes of the run's metrics.jsonl; None for an unknown run."""
        path = self.metrics_path(run_id)
        if path is None:
            return None
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            size = stat.st_size
            reset = offset > size
            start = 0 if reset else offset
            f.seek(start)
            data = f.read(min(size - start, MAX_CHUNK))
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        records, skipped = parse_records(whole)
        return RunMetrics(records, start + len(whole), size, stat.st_mtime, reset, skipped)

    def _find(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        if not self.root.is_dir():
            return found
        for directory, names, files in os.walk(self.root):
            here = Path(directory)
            depth = len(here.relative_to(self.root).parts)
            names[:] = [] if depth >= MAX_DEPTH else sorted(n for n in names if n not in SKIPPED and n[0] != ".")
            if METRICS_FILE in files:
                found[here.relative_to(self.root).as_posix() if depth else self.root.name] = here / METRICS_FILE
        return found


def parse_records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects with an integer `step` among the lines of `data`, and how many lines were not such.

    A diverged run logs `NaN` (Python's json writes it); JSON has no such number, so it comes back as null."""
    records, skipped = [], 0
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append({key: _finite(value) for key, value in record.items()})
        else:
            skipped += 1
    return records, skipped


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value
