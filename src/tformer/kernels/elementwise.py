"""Fused elementwise kernels for serving: RMSNorm, the rotary embedding and SwiGLU's SiLU-gated product.

An eager prompt chunk runs each of these as a row of small torch ops: RMSNorm as 7 (a cast, a square, a sum, a
division, a root, two products), rotary as 6 per tensor, SiLU and its product as 2, each a pass over memory. A
prefill forward of SmolLM2-135M (3 prompts of 128 tokens, W8A8, bf16, 2 cores) spent about a quarter of its time in
them. `elementwise.cpp` does each in one pass with the same roundings: rotary gives exactly torch's numbers, RMSNorm
sums its squares in another order, and SiLU's exponential is a polynomial within 2 ulp of the exact value
(`tests/test_elementwise.py` states the margins).

`use_fused_elementwise(model)` hands the kernels to the model's layers, which call them in place of their
formula where they apply: bfloat16 activations on the CPU, no gradient, and not inside torch.compile (a compiled
decode step fuses these ops itself). Anywhere else, where the kernels could not be built, or with
TFORMER_FUSED_ELEMENTWISE=0 in the environment, the layers keep their formula.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tformer.kernels import dispatch, native
from tformer.layers.attention import Attention
from tformer.layers.ffn import GatedMLP
from tformer.layers.norms import RMSNorm
from tformer.layers.positions import Rotary

UNAVAILABLE = "the fused elementwise kernels are unavailable: RMSNorm, rotary and SwiGLU run torch's ops"
kernel, available, instructions = native.op_library("elementwise", UNAVAILABLE, switch="TFORMER_FUSED_ELEMENTWISE")

_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIBRARY.define("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor")
_LIBRARY.define("silu_mul(Tensor gate, Tensor up) -> Tensor")


def _applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: bfloat16 on the CPU, no gradient, not traced, the kernel built."""
    if torch.compiler.is_compiling():
        return False
    if not dispatch.native(tensors[0].device):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype != torch.bfloat16 or (grad and t.requires_grad):
            return False
    return available()


@functools.cache
def _silu_vectorized() -> bool:
    """Whether SiLU runs on vector lanes in this build; its scalar loop alone is slower than torch's ops."""
    return instructions() not in (None, "portable")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * bf16(x / sqrt(mean(x^2) + eps)) over x's last dimension, or None where the kernel does not apply."""
    if not _applies(x, weight) or x.stride(-1) != 1:
        return None
    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.tformer.rms_norm(flat, weight, eps).view(x.shape)


def rotary(x: torch.Tensor, angles: Rotary) -> torch.Tensor | None:
    """x (B, H, T, D) rotated by (cos, sin) (B, T, D), as `positions.apply_rotary` does; None where the kernel does
    not apply. The result keeps x's layout (tokens outermost after the batch), as torch's ops would."""
    cos, sin = angles
    B, _, T, D = x.shape
    if not _applies(x) or x.stride(-1) != 1 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return None
    if cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1:] != (T, D) or sin.shape != cos.shape:
        return None
    return torch.ops.tformer.rotary(x.transpose(1, 2), cos.contiguous(), sin.contiguous()).transpose(1, 2)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """bf16(silu(gate)) * up, or None where the kernel does not apply."""
    if not _applies(gate, up) or not _silu_vectorized() or gate.shape != up.shape:
        return None
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        return None
    width = gate.shape[-1]
    return torch.ops.tformer.silu_mul(gate.reshape(-1, width), up.reshape(-1, width)).view(gate.shape)


def use_fused_elementwise(model: nn.Module) -> nn.Module:
    """Gives every RMSNorm, rotary self-attention and SwiGLU MLP of `model` its fused kernel (see the module's
    docstring for where they apply); returns the model."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = rms_norm
        elif isinstance(module, Attention):
            module.fused_rotary = rotary
        elif isinstance(module, GatedMLP) and isinstance(module.act, nn.SiLU):
            module.fused_gate = silu_mul
    return model
