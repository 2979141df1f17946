"""The int8 KV cache's rounding: each key or value vector as int8 numbers and one float32 scale.

`quantize_int8` and `dequantize_int8` are the formula (llama.cpp's q8_0 with one scale per head_dim values):
scale = max |x| / 127 and numbers = round(x / scale). An eager prompt step would run it as some 15 torch ops a
layer for keys and as many for values (the rounding, the scatter into the pool, the scales' scatter, the read-back
the step attends to), which made a packed prefill step of SmolLM2-135M markedly slower than with a bf16 cache
(docs/design-notes.md, "kernels/kv_int8.py"). `kv_int8.cpp` does each write in one pass (`store_rounded`) and
each gathered read in one (`read_rounded`), with the formula's exact bits. They return None where they do not apply (not
the CPU, a torch.compile trace, which fuses the formula itself, gradients, a dtype other than bfloat16 or float32, a
machine without the kernel, or TFORMER_KV_INT8_KERNEL=0 in the environment): the caller then runs the formula.
"""

from __future__ import annotations

import torch

from tformer.kernels import dispatch, native

INT8_LEVELS = 127  # a key's or value's int8 numbers are round(x / scale), scale = largest |x| / 127
SCALE_BYTES = 4  # each vector's scale is a float32

UNAVAILABLE = "the int8 KV cache's kernel is unavailable: its writes and reads run torch's ops"
kernel, available, _ = native.op_library("kv_int8", UNAVAILABLE, switch="TFORMER_KV_INT8_KERNEL")

_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("kv_store_int8(Tensor x, Tensor slots, Tensor(a!) numbers, Tensor(b!) scales) -> Tensor")
_LIBRARY.define("kv_read_int8(Tensor numbers, Tensor scales, Tensor slots, bool bfloat16) -> Tensor")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) as int8 numbers (..., D) and a float32 scale per vector (...): x ~ numbers * scale[..., None]."""
    x = x.float()
    scale = x.abs().amax(-1) / INT8_LEVELS
    divisor = scale.clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero vector: zeros, not 0 / 0
    numbers = torch.round(x / divisor[..., None]).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return numbers, scale


def dequantize_int8(numbers: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The vectors `quantize_int8` stored, in `dtype`."""
    return (numbers.float() * scale[..., None]).to(dtype)


def _applies(*tensors: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or not dispatch.native(tensors[0].device):
        return False
    if any(t.requires_grad for t in tensors):
        return False
    return available()


def store_rounded(
    x: torch.Tensor, slots: torch.Tensor, numbers: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor | None:
    """Rounds keys or values x (B, Hkv, T, D) into the pool's `numbers` (S, Hkv, D) and `scales` (S, Hkv) at `slots`
    (B * T,), row-major, -1 for padding (not stored); returns x as the cache holds them, (B, Hkv, T, D) in x's dtype.
    None where the kernel does not apply (nothing written)."""
    if x.dtype not in (torch.bfloat16, torch.float32) or x.stride(-1) != 1 or not _applies(x, numbers):
        return None
    return torch.ops.tformer.kv_store_int8(x, slots.contiguous(), numbers, scales)


def read_rounded(
    numbers: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """The keys or values stored at `slots` (any shape), (*slots.shape, Hkv, D) in `dtype`, as `dequantize_int8`
    gives them; None where the kernel does not apply."""
    if dtype not in (torch.bfloat16, torch.float32) or not _applies(numbers):
        return None
    return torch.ops.tformer.kv_read_int8(numbers, scales, slots.contiguous(), dtype == torch.bfloat16)
