"""Attention of one query per beam over keys read in place through a slot table (beam search's caches).

A beam search keeps K hypotheses per sentence; a new hypothesis continues a parent, whose earlier keys are its own,
and every beam of a sentence reads the same encoder keys. `decoding.beam_cache` keeps both kinds of keys once, laid
out as slots (slots, Hkv, D), with a table per beam row naming the slots it reads. `beam_attention.cpp` attends
through the table: one task per (sentence, KV head) walks the sentence's beams one after another, so the keys they
share are read from memory once and from the L1 cache after; each query's scores, softmax (a vectorized e^x) and sum
of values are in fp32 registers, 16 floats at a time on AVX-512 (8 on AVX2), with no copy of the keys. The engine's
paged kernel (`paged_attention`) reads the same layout row by row and converts each row's keys into a tile first,
which for fp32 beams cost about as much again (docs/translation.md measures both).

`beam_attention(q, k, v, slots, lengths, beams)` returns None where the kernel does not apply (not the CPU, another
dtype, no compiler, TFORMER_BEAM_ATTENTION=0); callers then use `paged_attention.paged_decode_attention`, which has
a torch path for every device.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from tformer.kernels import dispatch, native

UNAVAILABLE = "the beam attention kernel is unavailable: beam search attends with the paged kernel"
SWITCH = "TFORMER_BEAM_ATTENTION"
_FUNCTIONS = {torch.float32: "beam_attention_f32", torch.bfloat16: "beam_attention_bf16"}


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    if os.environ.get(SWITCH, "1") == "0":
        return None
    library = native.load("beam_attention", UNAVAILABLE)
    if library is not None:
        for name in _FUNCTIONS.values():
            function = getattr(library, name)
            function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
            function.restype = ctypes.c_int
    return library


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel serves tensors of this device and dtype here."""
    return dtype in _FUNCTIONS and dispatch.native(device) and _kernel() is not None


def beam_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, beams: int
) -> torch.Tensor | None:
    """softmax(q K^T / sqrt(D)) V for queries q (R, H, 1, D), row r over the keys of k, v (slots, Hkv, D) at
    slots[r, :lengths[r]] (slots (R, n), lengths (R,), int64); rows b * beams .. b * beams + beams - 1 are one
    sentence's beams, whose shared keys are read once. Returns (R, H, 1, D), or None where the kernel does not apply.
    Raises IndexError for a slot outside the cache or a length outside 1 .. n, before reading any key."""
    if not applies(q.device, q.dtype) or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    if torch.is_grad_enabled() and q.requires_grad:
        return None
    R, H, _, D = q.shape
    q, slots, lengths = q.contiguous(), slots.contiguous(), lengths.contiguous()
    if not (k.is_contiguous() and v.is_contiguous() and k.shape == v.shape and k.shape[2] == D):
        raise ValueError(f"beam_attention: k and v must be contiguous (slots, Hkv, {D}); got {tuple(k.shape)}")
    out = torch.empty_like(q)
    function = getattr(_kernel(), _FUNCTIONS[q.dtype])
    status = function(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        slots.data_ptr(),
        lengths.data_ptr(),
        out.data_ptr(),
        R,
        H,
        k.shape[1],
        D,
        slots.shape[1],
        beams,
        k.shape[0],
        D**-0.5,
        torch.get_num_threads(),
    )
    if status == -1:
        raise IndexError(
            f"beam_attention: a slot outside the cache's {k.shape[0]} or a length outside 1..{slots.shape[1]}"
        )
    if status:
        raise MemoryError("beam_attention: no memory for its scratch buffer")
    return out
