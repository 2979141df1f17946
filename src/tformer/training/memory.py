"""Measured training memory: a live-tensor tracker and one measured training step, the estimator's reference.

`LiveTensorTracker` is a TorchDispatchMode that sees every tensor an operator returns (forward, backward and
optimizer alike), counts the bytes of each new storage until the storage is freed, and keeps the peak. Tensors
alive before it starts are counted only when passed to `track` (weights, optimizer state, the batch). Memory a
kernel allocates internally and frees before returning (oneDNN scratch, a flash-attention workspace) is not a
tensor an operator returns, so it is not seen; process RSS (`rss_bytes`, `peak_rss_bytes`) sees it.

`measure_training_step` runs one step of tformer's training loop (zero_grad, autocast forward, the label-smoothed
loss, backward, gradient clipping, a fused Adam step) on a synthetic batch of full-length sequences, after one
untimed step that creates the optimizer state, and reports the live-tensor peak and the RSS growth of that step.
"""

from __future__ import annotations

import gc
import os
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tformer.config import ModelConfig
from tformer.data import LMBatch, Seq2SeqBatch
from tformer.models import build_model
from tformer.training.evaluate import forward_logits
from tformer.training.losses import label_smoothed_cross_entropy
from tformer.training.optim import adamw_cosine, paper_adam


class LiveTensorTracker(TorchDispatchMode):
    """The current and peak bytes of live tensor storages while the mode is active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage id -> bytes
        self.current = 0
        self.peak = 0

    def track(self, tensors: list[torch.Tensor]) -> None:
        """Counts tensors that already exist (weights, optimizer state, inputs) from now until they are freed."""
        for tensor in tensors:
            self._count(tensor)

    def _free(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            weakref.finalize(storage, self._free, key)
            old = 0
        self.sizes[key] = size
        self.current += size - old
        self.peak = max(self.peak, self.current)


def rss_bytes() -> int:
    """This process's resident set size now (/proc/self/statm)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Resets the kernel's high-water mark of this process's RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """The RSS high-water mark (VmHWM) since the process started or `reset_peak_rss` was last called."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@dataclass
class MeasuredStep:
    """What one measured training step held: bytes of live tensors at the start and at the peak, and RSS."""

    start_bytes: int  # weights, optimizer state and the batch, before the step
    peak_bytes: int  # live-tensor peak during the step
    rss_start: int
    rss_peak: int

    @property
    def rss_growth(self) -> int:
        return self.rss_peak - self.rss_start

    @property
    def tensor_growth(self) -> int:
        return self.peak_bytes - self.start_bytes


def synthetic_batch(config: ModelConfig, batch_size: int, seq_len: int, seed: int = 0) -> Seq2SeqBatch | LMBatch:
    """A batch of `batch_size` random sequences of exactly `seq_len` tokens, as the family's objective makes it."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, seq_len)
    ids = torch.randint(4, config.vocab_size, shape, generator=generator)
    ones = torch.ones(shape, dtype=torch.long)
    if config.family == "encoder-decoder":
        target = torch.randint(4, config.tgt_vocab_size, shape, generator=generator)
        return Seq2SeqBatch(ids, ones, target, target.roll(-1, dims=1), ones.clone())
    return LMBatch(ids, ones, ids.roll(-1, dims=1))


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return adamw_cosine(model, 1e-4, 10, 100)[0]
    return paper_adam(model, model.config.d_model)[0]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Seq2SeqBatch | LMBatch, autocast: bool) -> None:
    """One step of Trainer.train_step without accumulation: the same calls in the same order."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16) if autocast else nullcontext():
        logits = forward_logits(model, batch)
    loss_sum, n_tokens = label_smoothed_cross_entropy(logits, batch.labels, 0.1)
    (loss_sum / n_tokens).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], float("inf"))
    optimizer.step()


def measure_training_step(
    config: ModelConfig, batch_size: int, seq_len: int, dtype: str = "fp32", optimizer: str = "adam", seed: int = 0
) -> MeasuredStep:
    """Builds `config` on the CPU and measures one training step (see the module docstring).

    dtype: "fp32", "bf16-autocast" (fp32 weights, bf16 autocast, as `train.bf16`) or "bf16-pure" (the model in
    bf16, Adam state in bf16); optimizer: "adam" (the paper's) or "adamw".
    """
    torch.manual_seed(seed)
    model = build_model(config)
    if dtype == "bf16-pure":
        model = model.to(torch.bfloat16)
    model.train()
    opt = _optimizer(model, optimizer)
    batch = synthetic_batch(config, batch_size, seq_len, seed)
    autocast = dtype == "bf16-autocast"
    _step(model, opt, batch, autocast)  # creates the optimizer state
    opt.zero_grad(set_to_none=True)
    gc.collect()
    existing = [*model.parameters(), *model.buffers(), *vars(batch).values()]
    existing += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    tracker = LiveTensorTracker()
    tracker.track([t for t in existing if isinstance(t, torch.Tensor)])
    start = tracker.current
    rss_start = rss_bytes()
    reset_peak_rss()
    with tracker:
        _step(model, opt, batch, autocast)
    return MeasuredStep(start, tracker.peak, rss_start, peak_rss_bytes())
