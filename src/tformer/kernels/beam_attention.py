"""Attention of one query per beam over keys the beams share through a table, without copying any (beam search).

A beam search step keeps K hypotheses per sentence; a new hypothesis continues a parent, whose earlier keys and
values are its own. Rather than copying the parent's cache row, `decoding.beam_cache.BeamKVCache` keeps a table:
for each beam and position, the cache row that holds that beam's key. `beam_attention.cpp` reads the keys through the
table: for each beam row and KV head it scores the query heads of that KV head against every key, takes the softmax
and sums the values, in fp32 (float32 or bfloat16 tensors), one task per (row, KV head) on torch's OpenMP threads.
Against torch's path (the keys gathered, then two batched matmuls) it saves the gather and the matmuls' small-matrix
overheads (docs/translation.md measures it).

`beam_attention(q, k, v, table)` returns None where the kernel does not apply (not the CPU, another dtype, no
compiler, TFORMER_BEAM_ATTENTION=0); the caller then gathers the keys and attends in torch (`gathered_attention`).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from tformer.kernels import dispatch, native

UNAVAILABLE = "the beam attention kernel is unavailable: beam search gathers its keys and attends in torch"
SWITCH = "TFORMER_BEAM_ATTENTION"
_FUNCTIONS = {torch.float32: "beam_attention_f32", torch.bfloat16: "beam_attention_bf16"}


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    if os.environ.get(SWITCH, "1") == "0":
        return None
    library = native.load("beam_attention", UNAVAILABLE)
    if library is not None:
        for name in _FUNCTIONS.values():
            getattr(library, name).argtypes = (
                [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
            )
    return library


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel serves tensors of this device and dtype here."""
    return dtype in _FUNCTIONS and dispatch.native(device) and _kernel() is not None


def beam_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """softmax(q K^T / sqrt(D)) V for queries q (R, H, 1, D) over the keys of k, v (rows, Hkv, L, D) that `table`
    (R, T) names: row r's key at position t is k[table[r, t], :, t]. Returns (R, H, 1, D), or None where the kernel
    does not apply."""
    if not applies(q.device, q.dtype) or k.dtype != q.dtype or torch.is_grad_enabled() and q.requires_grad:
        return None
    R, H, _, D = q.shape
    q = q.contiguous()
    table = table.contiguous()
    out = torch.empty_like(q)
    function = getattr(_kernel(), _FUNCTIONS[q.dtype])
    function(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        table.data_ptr(),
        out.data_ptr(),
        R,
        H,
        k.shape[1],
        table.shape[1],
        k.shape[2],
        D,
        D**-0.5,
        torch.get_num_threads(),
    )
    return out


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The kernel's result in torch (any device): the named keys gathered (R, Hkv, T, D), then plain attention."""
    R, T = table.shape
    positions = torch.arange(T, device=table.device)
    keys = k[table, :, positions].transpose(1, 2)  # (R, T, Hkv, D) -> (R, Hkv, T, D)
    values = v[table, :, positions].transpose(1, 2)
    scores = (q @ keys.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return weights @ values.repeat_interleave(q.shape[1] // k.shape[1], 1)
