"""Normalization layers: LayerNorm and RMSNorm, picked by name from NORMS."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tformer.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * gamma (Zhang & Sennrich, 2019); statistics in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # For serving: a fused kernel of the same formula, which gives None where it does not apply
        # (`tformer.kernels.elementwise`)
        self.fused: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and (out := self.fused(x, self.weight, self.eps)) is not None:
            return out
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _layernorm(config: ModelConfig) -> nn.Module:
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.norm_bias)


def _rmsnorm(config: ModelConfig) -> nn.Module:
    return RMSNorm(config.d_model, eps=config.norm_eps)


NORMS = {"layernorm": _layernorm, "rmsnorm": _rmsnorm}


def make_norm(config: ModelConfig) -> nn.Module:
    """The norm layer the config names, sized d_model."""
    return NORMS[config.norm](config)
