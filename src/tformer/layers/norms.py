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


class PlusOneRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + gamma), gamma starting at 0; the product in fp32, then
    rounded once (LLaMA's rounds x first). Not an RMSNorm subclass: RMSNorm's fused kernel multiplies by gamma."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def _layernorm(config: ModelConfig, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.norm_bias)


def _rmsnorm(config: ModelConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=config.norm_eps)


def _plus_one_rmsnorm(config: ModelConfig, dim: int) -> nn.Module:
    return PlusOneRMSNorm(dim, eps=config.norm_eps)


NORMS = {"layernorm": _layernorm, "rmsnorm": _rmsnorm, "rmsnorm-plus-one": _plus_one_rmsnorm}


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """The norm layer the config names, sized `dim` (default d_model; a head's size for query-key norms)."""
    return NORMS[config.norm](config, config.d_model if dim is None else dim)
