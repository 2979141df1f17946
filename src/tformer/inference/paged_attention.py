"""Decode attention that reads each row's keys and values where they lie in the paged cache.

The paged cache otherwise gathers every row's keys and values into a dense (B, Hkv, Tk, D) copy per layer per step,
padded to the batch's longest row, and the attention matmuls read that copy again. Under load this traffic was most
of a decode step: for 32 rows of SmolLM2-135M (W8A8 + compile, 2026-12-02) the fused gather-and-copy kernel took
430 us a layer and the attention's `bmm`s and softmax another 225 us, about 20 of a 31 ms step.

`paged_decode_attention` computes softmax(q K^T / sqrt(D)) V for one query per row: each (row, KV head) pair walks
the row's own keys through its slot table once, scores the query heads that share the KV head (GQA) against each key,
takes the softmax in fp32 and sums the values, with no padding and no copy. It is a small C++ kernel, compiled with
the machine's C++ compiler on first use (0.7 s here; `native.load`), parallel over rows and KV heads with torch's own
OpenMP runtime. It is registered as a torch op, so a compiled decode step calls it like any kernel. Without a working
compiler `kernel()` is None and the engine keeps the gather path.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from tformer.inference import native

KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel library (`native.load`); None (logged once) when this machine cannot build or load it,
    or when TFORMER_PAGED_ATTENTION=0: callers then keep their gather path."""
    if os.environ.get("TFORMER_PAGED_ATTENTION", "1") == "0":
        return None
    loaded = native.load("paged_attention", "paged decode attention unavailable, attention gathers keys instead")
    if loaded is not None:
        for dtype_name in KERNEL_DTYPES.values():
            getattr(loaded, f"paged_decode_attention_{dtype_name}").restype = ctypes.c_int  # 0, or -1: a bad slot
    return loaded


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `paged_decode_attention` runs for caches of this dtype on this device."""
    return device.type == "cpu" and dtype in KERNEL_DTYPES and kernel() is not None


_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths) -> Tensor")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> None:
    """Shapes and dtypes the kernel relies on (metadata only: no tensor is read)."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"paged_decode_attention takes one query per row, q (B, H, 1, D); got {tuple(q.shape)}")
    B, H, _, D = q.shape
    if k.shape != v.shape or k.dim() != 3 or k.shape[2] != D or H % k.shape[1]:
        raise ValueError(
            f"k and v must be the cache's (slots, Hkv, {D}) tensors with H = {H} a multiple of Hkv; "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k and v must be contiguous (the paged cache's own tensors)")
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k and v must share one dtype of {list(KERNEL_DTYPES)}; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if slots.dtype != torch.int64 or lengths.dtype != torch.int64 or slots.shape[0] != B or lengths.shape != (B,):
        raise ValueError(f"slots must be int64 (B, max_keys) and lengths int64 (B,) with B = {B}")


def _paged_decode_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    _check(q, k, v, slots, lengths)
    B, H, _, D = q.shape
    q = q.contiguous()
    slots, lengths = slots.contiguous(), lengths.contiguous()
    out = torch.empty_like(q)
    function = getattr(kernel(), f"paged_decode_attention_{KERNEL_DTYPES[q.dtype]}")
    status = function(
        ctypes.c_void_p(q.data_ptr()),
        ctypes.c_void_p(k.data_ptr()),
        ctypes.c_void_p(v.data_ptr()),
        ctypes.c_void_p(slots.data_ptr()),
        ctypes.c_void_p(lengths.data_ptr()),
        ctypes.c_int64(B),
        ctypes.c_int64(H),
        ctypes.c_int64(k.shape[1]),
        ctypes.c_int64(D),
        ctypes.c_int64(slots.shape[1]),
        ctypes.c_int64(k.shape[0]),
        ctypes.c_float(D**-0.5),
        ctypes.c_int(torch.get_num_threads()),
        ctypes.c_void_p(out.data_ptr()),
    )
    if status:
        raise IndexError(f"paged_decode_attention: a slot to read lies outside the cache's {k.shape[0]} slots")
    return out


_LIBRARY.impl("paged_decode_attention", _paged_decode_attention_cpu, "CPU")


@torch.library.register_fake("tformer::paged_decode_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V for one query per row, reading keys and values in place.

    q (B, H, 1, D); k and v the cache's (slots, Hkv, D) tensors, of q's dtype (bfloat16 or float32); `slots`
    (B, max_keys) int64, row b's keys at slots[b, :lengths[b]] in position order; `lengths` (B,) int64, at least 1.
    Returns (B, H, 1, D). Query heads h * H/Hkv .. (h + 1) * H/Hkv - 1 read KV head h.
    """
    return torch.ops.tformer.paged_decode_attention(q, k, v, slots, lengths)
