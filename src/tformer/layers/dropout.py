"""Dropout with cheap masks on the CPU.

torch's CPU dropout draws its mask with `bernoulli_`, one generator call per element, a large share of the main recipe's
bf16 training step (docs/design-notes.md, "layers/dropout.py"). Here one call of the same global generator fills 64
random bits, cut into four 16-bit draws, and an element is dropped when its draw falls below round(p * 2^16), several
times faster. The drop probability is thus p rounded to a multiple of 2^-16 (0.1 becomes 0.100006), and the kept values
are scaled by the exact inverse of the keep probability, so the expectation is unchanged. Off the CPU, torch's fused
dropout is already cheap and used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 16  # values of one 16-bit draw


def dropout_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[torch.Tensor, float]:
    """A boolean keep-mask of `shape` (each element kept with probability 1 - p, p rounded to 2^-16) and the
    scale 1 / P(keep) for the kept values. Draws from torch's global generator, so `torch.manual_seed` fixes it."""
    n = shape.numel()
    bits = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=device)
    draws = bits.view(torch.int16)[:n].view(shape)  # uniform on -2^15 .. 2^15 - 1
    dropped = round(p * _LEVELS)
    return draws >= dropped - _LEVELS // 2, _LEVELS / (_LEVELS - dropped)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout: zeroes each element with probability p and scales the rest by 1 / (1 - p)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or round(p * _LEVELS) >= _LEVELS:  # p within 2^-17 of 1: drop everything
        return F.dropout(x, p, training=True)
    keep, scale = dropout_mask(x.shape, p, x.device)
    return torch.where(keep, x, 0.0) * scale


class Dropout(nn.Module):
    """`nn.Dropout` with the cheap CPU mask of `dropout`; the same `p` attribute and train/eval behaviour."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
