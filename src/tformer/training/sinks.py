"""Where the training loop's metrics go (`train.log_to`): `metrics.jsonl` in the run directory, and TensorBoard event
files in its `tensorboard/` folder.

The trainer hands every record (`{"step": 40, "loss": 3.2, "lr": 1e-3, ...}` every `log_every` steps, the dev scores
after each evaluation) to `MetricsSinks.write`, on the rank that logs. TensorBoard gets each number of a record as a
scalar at the record's step: `train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`, ..., and the dev
scores as `dev/bleu`, `dev/ppl`, ... With `train.histogram_every: N` it also gets, every N steps, a histogram of each
parameter and of its gradient from the step just taken, where they are whole on this rank (one process, DDP):
FSDP and tensor-parallel shards would first have to be gathered, which is not cheap, so they are left out.

A resumed run logs again the steps after its checkpoint. As `drop_records_after` cuts them from `metrics.jsonl`, the
TensorBoard writer starts with a purge step, which makes TensorBoard hide the earlier events of those steps.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tformer.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # inside the run directory: `tensorboard --logdir RUN/tensorboard` (or runs/)
TENSORBOARD_VERSION = "2.21.0"  # the version pyproject.toml's tensorboard extra pins
FLUSH_SECONDS = 10  # how stale a live TensorBoard may be; a flush every 10 s costs nothing next to a step
# buckets per histogram: TensorBoard redraws them in 30 anyway, and its writer checksums each event in pure Python, so
# torch's default ~1,500 exponential buckets ("tensorflow") would cost milliseconds per parameter
HISTOGRAM_BINS = 64


class Sink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON record per line in `path` (metrics.jsonl), appended as it comes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars (and histograms every `histogram_every` steps) in TensorBoard event files under `log_dir`."""

    def __init__(self, log_dir: Path, model: nn.Module, histogram_every: int, resumed_step: int) -> None:
        writer_class = summary_writer_class()
        # events at or after purge_step, left by the run before it was resumed, are hidden by TensorBoard
        purge_step = resumed_step + 1 if resumed_step > 0 else None
        self.writer = writer_class(log_dir=str(log_dir), purge_step=purge_step, flush_secs=FLUSH_SECONDS)
        self.model, self.histogram_every = model, histogram_every
        self.skipped_sharded = False

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(scalar_tag(key), value, step)
        if self.histogram_every and "loss" in record and step % self.histogram_every == 0:
            self._histograms(step)

    def _histograms(self, step: int) -> None:
        for name, parameter in self.model.named_parameters():
            if isinstance(parameter, DTensor):  # a shard: its histogram would need every rank's part
                self._warn_sharded()
                continue
            self._histogram(f"weights/{name}", parameter, step)
            if parameter.grad is not None and not isinstance(parameter.grad, DTensor):
                self._histogram(f"gradients/{name}", parameter.grad, step)

    def _histogram(self, tag: str, tensor: torch.Tensor, step: int) -> None:
        """The histogram of `tensor` in HISTOGRAM_BINS equal buckets from its minimum to its maximum, counted by torch
        (SummaryWriter.add_histogram counts with numpy on one thread, several times slower on large weights)."""
        values = tensor.detach().float().flatten()
        low, high = (bound.item() for bound in torch.aminmax(values))  # one pass; a NaN or inf shows in them
        if not (math.isfinite(low) and math.isfinite(high)):  # an fp16 overflow's gradients: count the finite ones
            values = values[values.isfinite()]
            if values.numel() == 0:
                return
            low, high = (bound.item() for bound in torch.aminmax(values))
        if low == high:  # a constant (a fresh norm's weights): one bucket
            limits, counts = [high], [values.numel()]
        else:
            limits = torch.linspace(low, high, HISTOGRAM_BINS + 1, dtype=torch.float64)[1:].tolist()
            counts = torch.histc(values, bins=HISTOGRAM_BINS, min=low, max=high).tolist()
        self.writer.add_histogram_raw(
            tag,
            min=low,
            max=high,
            num=values.numel(),
            sum=values.sum().item(),
            sum_squares=values.dot(values).item(),
            bucket_limits=limits,
            bucket_counts=counts,
            global_step=step,
        )

    def _warn_sharded(self) -> None:
        if not self.skipped_sharded:
            self.skipped_sharded = True
            print(
                "warning: train.histogram_every: FSDP / tensor-parallel parameters are sharded over the ranks, so "
                "their histograms are not written (only whole parameters are)",
                file=sys.stderr,
            )

    def close(self) -> None:
        self.writer.close()


def scalar_tag(key: str) -> str:
    """A record's key as a TensorBoard tag: dev scores under dev/ (dev_bleu -> dev/bleu), the rest under train/."""
    return f"dev/{key.removeprefix('dev_')}" if key.startswith("dev_") else f"train/{key}"


def summary_writer_class() -> type:
    """torch's SummaryWriter, or a ConfigError saying how to install the tensorboard package it writes with."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "train.log_to includes 'tensorboard', but the tensorboard package is not installed; install it with "
            f"`pip install 'tformer[tensorboard]'` (or `pip install tensorboard=={TENSORBOARD_VERSION}`), or remove "
            "tensorboard from train.log_to"
        )
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


class MetricsSinks:
    """The sinks `log_to` names, opened for a run directory; the trainer's one place to send a record."""

    def __init__(
        self, log_to: list[str], run_dir: Path, model: nn.Module, histogram_every: int = 0, resumed_step: int = 0
    ) -> None:
        self.sinks: list[Sink] = []
        if "jsonl" in log_to:
            self.sinks.append(JsonlSink(run_dir / METRICS_FILE))
        if "tensorboard" in log_to:
            self.sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR, model, histogram_every, resumed_step))

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
