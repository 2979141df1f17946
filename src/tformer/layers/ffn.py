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
        self.gate_up_proj: nn.Module | None = None  # gate and up in one layer, for serving: `fuse_projections`
        # For serving: act(gate) * up in one fused kernel, which gives None where it does not apply
        # (`tformer.kernels.elementwise`)
        self.fused_gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.fused_gate is not None and (hidden := self.fused_gate(gate, up)) is not None:
            return self.down_proj(hidden)
        return self.down_proj(self.act(gate) * up)

    def fuse_projections(self, concat: Callable[[list[nn.Module]], nn.Module | None]) -> None:
        """For serving: the gate and up projections become one layer, one matmul on the input instead of two;
        `concat` joins layers by their output rows, or gives None for layers it cannot join (nothing changes).
        gate_proj and up_proj are dropped (no more training, loading or saving them)."""
        fused = None if self.gate_up_proj is not None else concat([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj


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
