"""Optimizers and learning-rate schedules: the paper's Adam + inverse-sqrt warmup, and AdamW + warmup-cosine.

Both use torch's fused implementation: on CPU the default per-parameter loop is several times slower a step
(benchmarks/README.md; docs/design-notes.md, "training/optim.py"). Tensor parallelism alone mixes sharded (DTensor) and
plain parameters, which one fused kernel cannot take: it passes fused=False for the per-parameter loop.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def noam_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule: eta = scale * d^-0.5 * min(t^-0.5, t * t0^-1.5), with steps counted from 1."""
    t = max(step, 1)
    return scale * d_model**-0.5 * min(t**-0.5, t * warmup**-1.5)


def warmup_cosine_lr(step: int, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to `min_ratio * peak` at step `total` (and flat after)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases, norm gains, embedding tables and the parameters a module lists in its
    `params_without_weight_decay()` (the SSM's A_log, D, Δ bias and depthwise conv) are not decayed.

    The list is asked of the module, not stored on the parameters: loading weights and deepcopy make new
    parameter objects, which drop any attribute set on the old ones."""
    exempt = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        listed = getattr(module, "params_without_weight_decay", None)
        if listed is not None:
            exempt.update(id(param) for param in listed())
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.ndim >= 2 and id(param) not in exempt else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def paper_adam(model: nn.Module, d_model: int, warmup: int = 4000, scale: float = 1.0, fused: bool = True) -> tuple:
    """Adam(beta1=0.9, beta2=0.98, eps=1e-9) with the inverse-square-root warmup schedule, over the parameters
    that train (all of them, or only LoRA's adapters)."""
    optimizer = torch.optim.Adam(
        [p for p in model.parameters() if p.requires_grad],
        lr=1.0,
        betas=(0.9, 0.98),
        eps=1e-9,
        fused=fused,
        foreach=False if not fused else None,
    )
    scheduler = LambdaLR(optimizer, lambda step: noam_lr(step + 1, d_model, warmup, scale))
    return optimizer, scheduler


def adamw_cosine(
    model: nn.Module,
    peak_lr: float,
    warmup: int,
    total: int,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    min_ratio: float = 0.1,
    fused: bool = True,
) -> tuple:
    """AdamW with decoupled weight decay, linear warmup and cosine decay: the modern LLM recipe."""
    optimizer = torch.optim.AdamW(
        _decay_groups(model, weight_decay),
        lr=1.0,
        betas=betas,
        eps=1e-8,
        fused=fused,
        foreach=False if not fused else None,
    )
    scheduler = LambdaLR(optimizer, lambda step: warmup_cosine_lr(step, peak_lr, warmup, total, min_ratio))
    return optimizer, scheduler
