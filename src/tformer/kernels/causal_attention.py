"""Causal attention of prompt chunks on the CPU, in fp32 over bfloat16 tensors: flash attention's online softmax.

torch's CPU flash kernel runs bf16 attention slowly on a CPU without AVX512-BF16, a large share of a packed
prefill forward for SmolLM2-135M, 9 query heads on 3 KV heads of 64 (docs/design-notes.md,
"kernels/causal_attention.py"). `causal_attention.cpp` computes the same, causal attention of T queries at the last T
of Tk key slots (a whole prompt: T = Tk; a chunk after cached tokens: T < Tk), on vector lanes: each KV head's keys
and values are converted to fp32 once, the keys transposed so that a register holds one dimension of 16 keys (8 on
AVX2); a task takes 16 queries of every query head sharing that KV head and scores eight query rows (four on AVX2)
against 32 keys at a time; the softmax runs online (flash attention's running maximum and sum), the sums in fp32,
and a block of queries reads only the keys it can see. Numbers: docs/engine.md.

`causal_attention(q, k, v)` returns None where the kernel does not apply (not the CPU, not bfloat16, a head size
that is not a multiple of the vector width, more than MAX_KEYS keys, gradients, a torch.compile trace, or a machine
without the kernel or with TFORMER_CAUSAL_ATTENTION=0): the caller then keeps torch's SDPA. float32 keeps SDPA
always, so that fp32 paths give the uncached forward's exact numbers.
"""

from __future__ import annotations

import functools

import torch

from tformer.kernels import dispatch, native

UNAVAILABLE = "the causal attention kernel is unavailable: prompt chunks attend through torch's SDPA"
kernel, available, _ = native.op_library("causal_attention", UNAVAILABLE, switch="TFORMER_CAUSAL_ATTENTION")

_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("causal_attention(Tensor q, Tensor k, Tensor v) -> Tensor")


@torch.library.register_fake("tformer::causal_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# Past this many keys torch's flash kernel is faster: its unmasked part (a chunk's queries over the keys cached before
# it) runs the query heads of a KV head as one matrix (`causal_suffix_attention`); a short prompt is faster here
# (docs/design-notes.md, "kernels/causal_attention.py").
MAX_KEYS = 1024


@functools.cache
def lane_width() -> int:
    """Head sizes the kernel takes are multiples of this (16 on AVX-512, 8 on AVX2); 0 where it has no lanes."""
    if not available():
        return 0
    width = kernel().causal_attention_width
    return int(width())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """softmax(q K^T / sqrt(D), causal) V for queries q (B, H, T, D) at the last T of the Tk slots of k, v
    (B, Hkv, Tk, D), query heads h * H/Hkv .. read KV head h; (B, H, T, D), or None where the kernel does not apply."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return None
    if not dispatch.native(q.device) or any(t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in (q, k, v)):
        return None
    width = lane_width()
    if not width or q.shape[-1] % width or not q.shape[2] <= k.shape[2] <= MAX_KEYS:
        return None
    return torch.ops.tformer.causal_attention(q, k, v)
