"""Position-wise feed-forward networks: the paper's two-layer MLP (ReLU, GELU, SiLU) and the gated (GLU) variants."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tformer.config import ModelConfig

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,  # a plain (not gated) Swish MLP, as in Marian
    "swiglu": nn.SiLU,  # Swish with beta = 1
    "geglu": nn.GELU,
    "geglu-tanh": lambda: nn.GELU(approximate="tanh"),  # T5 v1.1's gated-gelu (gelu_new)
}


class MLP(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2; with ReLU this is the paper's max(0, x W1 + b1) W2 + b2."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.ffn_bias)
        self.act = ACTIVATIONS[config.ffn]()
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.ffn_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GatedMLP(nn.Module):
    """GLU family (Shazeer, 2020): (act(x W + b) * (x V + c)) W2; SwiGLU with SiLU, GeGLU with GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.ffn_bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.ffn_bias)
        self.act = ACTIVATIONS[config.ffn]()
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.ffn_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


FFNS: dict[str, type[nn.Module]] = {
    "relu": MLP,
    "gelu": MLP,
    "gelu-tanh": MLP,
    "silu": MLP,
    "swiglu": GatedMLP,
    "geglu": GatedMLP,
    "geglu-tanh": GatedMLP,
}


def make_ffn(config: ModelConfig) -> nn.Module:
    """The feed-forward sublayer the config names."""
    return FFNS[config.ffn](config)
