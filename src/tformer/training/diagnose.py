"""What went wrong in a training step, and what to change: the first module that produced a NaN or an infinity,
a loss-spike watch, and the remedies for a diverged or out-of-memory run, each with its recipe key.

The remedies follow the usual debugging order (bf16 over fp16, learning rate and warmup, gradient clipping,
scaled initialization; for memory: activation checkpointing, smaller batches with accumulation, an attention that
never builds the score matrix, mixed precision, sharding, shorter sequences).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.training.config import TrainConfig
from tformer.training.estimate import estimate_memory, format_estimate, recipe_inputs


@dataclass(frozen=True)
class NonFinite:
    """Where a non-finite value first appeared: a module's qualified name, and in which pass."""

    module: str
    phase: str  # "forward" (its output) or "backward" (the gradient it passed to its inputs or parameters)

    def __str__(self) -> str:
        what = "output" if self.phase == "forward" else "gradient"
        return f"{self.module or 'the model'} ({self.phase}: its {what} is the first non-finite value)"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors(value) if t.numel())


@contextmanager
def _watch(model: nn.Module, found: list[NonFinite]) -> Iterator[None]:
    """Hooks on every module that record, in execution order, each module whose inputs (forward) or output
    gradients (backward) were finite and whose outputs or input/parameter gradients were not."""

    def forward_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not _finite(output) and _finite(args) and _finite(kwargs):
                found.append(NonFinite(name, "forward"))

        return hook

    def backward_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            own = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
            if _finite(grad_output) and not (_finite(grad_input) and _finite(own)):
                found.append(NonFinite(name, "backward"))

        return hook

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(forward_hook(name), with_kwargs=True))
        handles.append(module.register_full_backward_hook(backward_hook(name)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def locate_non_finite(model: nn.Module, replay: Callable[[], torch.Tensor]) -> NonFinite | None:
    """Replays a step (`replay` runs the forward pass and returns the loss) with hooks on every module, then
    runs its backward pass; returns the first module that produced a non-finite value, forward before backward,
    or NonFinite("the loss", ...) when only the loss itself is not finite. None when the replay stays finite.

    A module counts only when what it received was finite, so the culprit is the module where the problem
    starts, not every module downstream of it.
    """
    found: list[NonFinite] = []
    model.zero_grad(set_to_none=True)
    with _watch(model, found):
        loss = replay()
        forward = [f for f in found if f.phase == "forward"]
        if forward:
            return forward[0]
        if not _finite(loss):
            return NonFinite("the loss", "forward")
        loss.backward()
    model.zero_grad(set_to_none=True)
    return found[0] if found else None


def nan_remedies(train: TrainConfig, model: ModelConfig) -> list[str]:
    """The fixes for a diverged run, most likely first, each with the recipe key and its current value."""
    lr_meaning = "scale of the noam schedule" if train.optimizer == "adam-noam" else "peak"
    return [
        f"train.bf16: {'true' if train.bf16 else 'false'}, already safe - the usual first cause, fp16's overflow, "
        "cannot happen here: tformer trains in fp32 or bf16 autocast, which keeps fp32's range",
        f"train.lr: lower it, e.g. {train.lr / 2:g} (now {train.lr:g}, the {lr_meaning}), or train.warmup: "
        f"raise it, e.g. {train.warmup * 2} (now {train.warmup})",
        f"train.clip_grad: 1.0 (now {train.clip_grad:g}; 0 means no clipping)",
        f"model.init: gpt2 (now {model.init}) - residual projections scaled by 1/sqrt(2 n_layers); for deep "
        "post-norm models model.norm_placement: pre or deepnorm",
    ]


def oom_remedies(train: TrainConfig, model: ModelConfig) -> list[str]:
    """The fixes for a run that ran out of memory, biggest saving first, each with its key and current value."""
    return [
        f"model.activation_checkpointing: true (now {str(model.activation_checkpointing).lower()}) - recomputes "
        "each layer in backward: about half the activation memory for about 20% more time",
        f"train.max_tokens: halve it to {train.max_tokens // 2} and train.grad_accum: double it to "
        f"{train.grad_accum * 2} (now {train.max_tokens} and {train.grad_accum}) - the same batch in two pieces",
        f"model.attention_backend: sdpa (now {model.attention_backend}) - never builds the (T x T) score matrix",
        f"train.bf16: true (now {str(train.bf16).lower()}) - half-size activations",
        f"train.parallel: fsdp with torchrun on several processes (now {train.parallel}) - ZeRO-3: weights, "
        "gradients and optimizer state sharded across ranks",
        f"train.max_len: lower it, e.g. {max(train.max_len // 2, 1)} (now {train.max_len}) - shorter sequences",
    ]


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocation failure: CUDA's OutOfMemoryError, MemoryError, or the CPU allocator's."""
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


class LossSpikes:
    """Warns when a step's loss jumps far above its recent average (an early sign of divergence)."""

    def __init__(self, factor: float = 2.0, warmup_steps: int = 50, decay: float = 0.98) -> None:
        self.factor, self.warmup_steps, self.decay = factor, warmup_steps, decay
        self.average: float | None = None
        self.seen = 0

    def check(self, loss: float) -> float | None:
        """Records `loss`; returns the running average it jumped above, or None."""
        if not math.isfinite(loss):
            return None
        spike = self.average if self.seen >= self.warmup_steps and loss > self.factor * self.average else None
        if spike is None:  # a spike does not drag the average up with it
            self.average = loss if self.average is None else self.decay * self.average + (1 - self.decay) * loss
        self.seen += 1
        return spike


def numbered(lines: list[str]) -> str:
    return "".join(f"\n  {i}. {line}" for i, line in enumerate(lines, 1))


def diverged_message(
    step: int, loss: float, grad_norm: float, culprit: NonFinite | None, train: TrainConfig, model: ModelConfig
) -> str:
    """The error of a step whose loss or gradient is not finite: where it started and what to change."""
    where = "not located (the replay stayed finite)" if culprit is None else str(culprit)
    return (
        f"step {step}: loss {loss} / gradient norm {grad_norm} is not finite; the weights were not updated and "
        f"the last good checkpoint is kept. First non-finite value: {where}. Lower the learning rate, raise warmup, "
        f"or set clip_grad; in order:{numbered(nan_remedies(train, model))}"
    )


def _estimate(train: TrainConfig, model: ModelConfig, world_size: int) -> str | None:
    """`tformer estimate`'s breakdown of the run, or None: its own error must not hide the allocation failure."""
    try:
        config, inputs = recipe_inputs(model, train)
        return format_estimate("this run", config, estimate_memory(config, world_size=world_size, **inputs))
    except Exception:
        return None


def out_of_memory_message(
    step: int, err: BaseException, train: TrainConfig, model: ModelConfig, world_size: int = 1
) -> str:
    """The error of a step that could not allocate memory: the estimate's breakdown and what to change."""
    estimate = _estimate(train, model, world_size)
    breakdown = f"\nestimated peak memory for this config:\n{estimate}" if estimate else ""
    return (
        f"step {step}: out of memory ({type(err).__name__}: {str(err).splitlines()[0][:200]}); the last good "
        f"checkpoint is kept.{breakdown}\nto fit, in order of how much each saves:"
        f"{numbered(oom_remedies(train, model))}"
    )
