"""Decode attention that reads each row's keys and values where they lie in the paged cache.

The paged cache otherwise gathers every row's keys and values into a dense (B, Hkv, Tk, D) copy per layer per step,
padded to the batch's longest row, and the attention matmuls read that copy again. Under load this traffic was most
of a decode step (docs/design-notes.md, "kernels/paged_attention.py").

`paged_decode_attention` computes softmax(q K^T / sqrt(D)) V for one query per row: each task walks one row's keys
through its slot table, 32 at a time, converting them to fp32 once into a tile that stays in the L1 cache; every query
head sharing the KV head (GQA) scores four keys at a time against it, the softmax is taken in fp32, and the values are
summed the same way, with no padding and no copy of the cache, 16 floats at a time on AVX-512 and 8 on AVX2 (a portable
loop elsewhere, or where the head size is not a multiple of that). With at least 4 rows a thread a task takes all of a
row's KV heads, which lie side by side in the cache; with fewer, one (row, KV head), so that a few long rows still keep
every thread busy. Converting a row's keys once for all the query heads that share them is much faster than once per
query head. It is a small C++ kernel, compiled with the machine's C++ compiler on first use (a few seconds;
`native.load`), parallel over rows and KV heads with torch's own OpenMP runtime. It registers a torch op through torch's
stable C ABI, so a compiled decode step calls it like any kernel, for less a call than the Python implementation over
ctypes it had before (docs/design-notes.md, "kernels/paged_attention.py"). Without a working compiler `kernel()` is None
and the engine keeps the gather path; off an x86 CPU, or with TFORMER_PORTABLE_KERNELS=1 (`dispatch.py`),
`paged_decode_attention` itself runs `gathered_decode_attention`, the same attention in torch's ops.

`paged_decode_attention_int8` is the same kernel for a cache of int8 keys and values with one float32 scale per
(slot, KV head), the value being the integer times its scale (like llama.cpp's q8_0 cache type): half the bytes of a
bf16 cache to read. The scales multiply the integers where the tile converts them to fp32 (the portable loop: the
key's score and the value's weight), so everything after is the same code; `paged_decode_attention` calls it when
given the scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tformer.kernels import dispatch, native

KERNEL_DTYPES = (torch.bfloat16, torch.float32)


# The compiled kernel library (`native.load`), which implements `tformer::paged_decode_attention` on the CPU once
# loaded; `kernel()` is None (logged once) when this machine cannot build or load it, or when
# TFORMER_PAGED_ATTENTION=0: callers then keep their gather path. `available()`: whether it loaded.
kernel, available, _ = native.op_library(
    "paged_attention", "paged decode attention unavailable, attention gathers keys instead", "TFORMER_PAGED_ATTENTION"
)


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `paged_decode_attention` runs for caches of this dtype on this device."""
    return dispatch.native(device) and dtype in KERNEL_DTYPES and available()


_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths) -> Tensor")
_LIBRARY.define(
    "paged_decode_attention_int8(Tensor q, Tensor k, Tensor v, Tensor k_scale, Tensor v_scale, Tensor slots, "
    "Tensor lengths) -> Tensor"
)


@torch.library.register_fake("tformer::paged_decode_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("tformer::paged_decode_attention_int8")
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V for one query per row, reading keys and values in place.

    q (B, H, 1, D); k and v the cache's (slots, Hkv, D) tensors, of q's dtype (bfloat16 or float32), or int8 with
    `k_scale` and `v_scale` given, float32 (slots, Hkv), a key's value being k[slot, head] * k_scale[slot, head];
    `slots` (B, max_keys) int64, row b's keys at slots[b, :lengths[b]] in position order; `lengths` (B,) int64, at
    least 1. Returns (B, H, 1, D) of q's dtype. Query heads h * H/Hkv .. (h + 1) * H/Hkv - 1 read KV head h. Raises
    ValueError for shapes or dtypes the kernel cannot take, and IndexError for a slot outside the cache, before
    reading anything.
    """
    names, args = ["q", "k", "v", "slots", "lengths"], [q, k, v, slots, lengths]
    if k_scale is not None or v_scale is not None:
        names[3:3], args[3:3] = ["k_scale", "v_scale"], [k_scale, v_scale]
    if not (dispatch.native(q.device) and available()):  # the kernel checks dtypes and shapes itself
        return gathered_decode_attention(q, k, v, slots, lengths, k_scale, v_scale)
    try:
        if k_scale is None and v_scale is None:
            return torch.ops.tformer.paged_decode_attention(*args)
        if k_scale is None or v_scale is None:
            raise ValueError("paged_decode_attention: an int8 cache takes both k_scale and v_scale")
        return torch.ops.tformer.paged_decode_attention_int8(*args)
    except ValueError as err:
        given = ", ".join(
            f"{n} {tuple(t.shape)} {t.dtype}" if t is not None else f"{n} None"
            for n, t in zip(names, args, strict=True)
        )
        raise ValueError(f"{err}; got {given}") from None


def gathered_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` in torch, for any device (`dispatch`'s portable path): each row's keys and values
    gathered from its slots into a padded (B, Hkv, max_keys, D) copy, the keys past a row's length masked, then SDPA
    with the query heads of a KV head reading it (GQA). The same arguments and result."""
    H = q.shape[1]
    visible = torch.arange(slots.shape[1], device=q.device)[None, :] < lengths[:, None]  # (B, max_keys)
    slots = slots.masked_fill(~visible, 0)  # what lies past a row's length is never read: any slot will do
    keys, values = k[slots], v[slots]  # (B, max_keys, Hkv, D)
    if k_scale is not None and v_scale is not None:
        keys = keys.float() * k_scale[slots][..., None]
        values = values.float() * v_scale[slots][..., None]
    keys, values = keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2)  # (B, Hkv, max_keys, D)
    groups = H // keys.shape[1]
    if groups > 1:  # each KV head serves `groups` query heads side by side
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :])
