"""Multi-head attention (MHA / GQA / MQA; self or cross) with swappable backends.

Backends live in ATTENTION_BACKENDS: "sdpa" calls torch's fused scaled_dot_product_attention,
"math" writes softmax(QK^T / sqrt(d_k) + bias) V out by hand and also returns the weights for plots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tformer.config import ModelConfig
from tformer.layers.dropout import dropout
from tformer.layers.kv_cache import CrossKV, SelfAttentionCache
from tformer.layers.masks import AttentionMask
from tformer.layers.norms import make_norm
from tformer.layers.positions import Rotary, apply_rotary


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D): each KV head serves n_rep consecutive query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


Backend = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
CPU_TRAINING_MATH_MAX_KEYS = 256  # longest key length at which CPU bf16 training takes the math path (see sdpa)
SHARED_KEYS_MAX_QUERIES = 16  # most queries per row that take the matmul path when each sees every key (see sdpa)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
) -> tuple[torch.Tensor, None]:
    """torch's fused kernel (flash / memory-efficient / math, chosen by torch); GQA without copying K and V.

    One exception: a batch of single queries on the CPU (a batched decode step), or of a few queries that see every
    key (the beams of a sentence over its cross-attention keys), goes to `single_query_attention`, because torch's
    CPU kernel is slow there, many times two grouped matmuls' time, in fp32 as in bf16. For one row the kernel is as
    fast, and SmolLM2 decoded faster with it (docs/design-notes.md, "layers/attention.py"; docs/translation.md).

    A second exception: bf16/fp16 training on the CPU over at most CPU_TRAINING_MATH_MAX_KEYS keys goes to the
    math path, since torch's CPU flash backward is slow for short sequences; past that the kernel wins. In fp32
    the kernel is as fast or faster at every length, so fp32 keeps it (docs/design-notes.md, "layers/attention.py").
    """
    if mask.bias is None and mask.needs_bias(q.shape[2], k.shape[2]):
        return long_attention(q, k, v, mask, dropout_p), None
    low_precision = q.dtype in (torch.bfloat16, torch.float16)
    on_cpu = q.device.type == "cpu"
    # a few queries under one bias row, which only the beams of a sentence over its memory have (an encoder's bias
    # has a row per query, and there the fused kernel is faster)
    shared_row = mask.bias is not None and mask.bias.shape[2] == 1 and not mask.is_causal
    few_queries = q.shape[2] == 1 or (shared_row and q.shape[2] <= SHARED_KEYS_MAX_QUERIES)
    if few_queries and q.shape[0] > 1 and on_cpu and not dropout_p and not _needs_grad(q, k, v):
        return single_query_attention(q, k, v, mask), None
    if on_cpu and low_precision and q.requires_grad and k.shape[2] <= CPU_TRAINING_MATH_MAX_KEYS:
        return math_attention(q, k, v, mask, dropout_p)[0], None
    bias = None if mask.bias is None else mask.bias.to(q.dtype)
    grouped = True if k.shape[1] != q.shape[1] else False  # noqa: SIM210 - a plain bool under torch.compile too,
    # where an input's head count may be symbolic and the comparison a SymBool, which the kernel refuses
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=mask.fast_causal(), enable_gqa=grouped
    )
    return out, None


QUERY_BLOCK = 512  # queries per block of chunked_attention


def long_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
) -> torch.Tensor:
    """Attention over too many query-key pairs for a dense bias, in memory linear in the length.

    Queries at the last slots under causality alone (a prompt's later chunk) take `causal_suffix_attention` on
    the CPU. Padding alone needs no blocks: a bidirectional layer passes SDPA a (B, 1, 1, Tk) bias, and a causal
    one over right-padded rows needs no padding rule at all (a real token's earlier keys are all real; the padding
    queries' outputs are never read), so SDPA's causal kernel runs. Anything else goes through chunked_attention.
    """
    n_queries, n_keys = q.shape[2], k.shape[2]
    suffix = mask.causal_suffix() and n_queries < n_keys and q.device.type == "cpu"
    if suffix and not dropout_p and not _needs_grad(q, k, v):
        return causal_suffix_attention(q, k, v)
    padding = mask.key_padding
    other_rules = (mask.window, mask.query_slots, mask.prefix_lengths, mask.position_bias)
    if padding is not None and all(rule is None for rule in other_rules):
        gqa = k.shape[1] != q.shape[1]
        if not mask.is_causal:
            bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~padding, torch.finfo(q.dtype).min)
            bias = bias[:, None, None, :]  # (B, 1, 1, Tk): a fully padded row gets uniform weights, not NaN
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, enable_gqa=gqa)
        if n_queries == n_keys and bool((padding[:, 1:] <= padding[:, :-1]).all()):  # right padding only
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    return chunked_attention(q, k, v, mask, dropout_p)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def causal_suffix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries (B, H, Tq, D) at the last Tq of Tk key slots, with no bias: a prompt's later
    chunk over the cache. Every query sees all Tk - Tq earlier keys, in one unmasked call of torch's CPU flash
    kernel with the query heads that share a KV head stacked as rows (their keys read once); the last Tq keys form
    a square, where the kernel's causal flag skips the masked blocks. The two parts merge by the log-sum-exps the
    kernel returns, as flash attention merges its blocks.

    A long chunk over many keys runs faster this way than with a bias block and one call, and the stacked prefix faster
    than through SDPA's GQA. Short inputs keep the dense bias `build_mask` makes once a forward: the kernel's causal
    flag is slow on small squares, where one masked call is faster (docs/design-notes.md, "layers/attention.py").
    """
    B, H, T, D = q.shape
    n_kv, n_earlier = k.shape[1], k.shape[2] - T
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    stacked = q.reshape(B, n_kv, H // n_kv * T, D)  # query heads h * n_rep .. read KV head h, as in repeat_kv
    earlier, earlier_lse = flash(stacked, k[:, :, :n_earlier], v[:, :, :n_earlier], 0.0, False)
    own, own_lse = flash(q, k[:, :, n_earlier:], v[:, :, n_earlier:], 0.0, True)
    earlier, earlier_lse = earlier.reshape(B, H, T, D), earlier_lse.reshape(B, H, T)
    lse = torch.logaddexp(earlier_lse, own_lse)
    out = earlier.float() * (earlier_lse - lse).exp()[..., None] + own.float() * (own_lse - lse).exp()[..., None]
    return out.to(q.dtype)


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
) -> torch.Tensor:
    """Attention by blocks of QUERY_BLOCK queries, in memory linear in the length (Rabe & Staats, 2021).

    Each block builds only its own bias (block x keys it can see) and calls torch's fused kernel, which keeps
    no score matrix; in training each block is checkpointed, so backward rebuilds its bias instead of keeping it.
    Under a causal rule a block reads keys up to its last query only, under a window of W only its last W + block
    keys: attention then costs O(T * W), not O(T^2).
    """
    return by_query_blocks(_attention_block, q, k, v, mask, dropout_p)


def by_query_blocks(
    attend_block: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    *args: Any,
) -> torch.Tensor:
    """`attend_block(mask, span, *args, q_block, k_block, v_block)` over blocks of QUERY_BLOCK queries, each over
    the keys it can see (`mask.key_range`), concatenated; a block that needs gradients is checkpointed, so that
    backward rebuilds its bias instead of keeping it."""
    n_queries, n_keys = q.shape[2], k.shape[2]
    outputs = []
    for q_start in range(0, n_queries, QUERY_BLOCK):
        q_end = min(q_start + QUERY_BLOCK, n_queries)
        k_start, k_end = mask.key_range(q_start, q_end, n_queries, n_keys)
        span = (q_start, q_end, k_start, k_end, n_queries, n_keys)
        block = (q[:, :, q_start:q_end], k[:, :, k_start:k_end], v[:, :, k_start:k_end])
        if _needs_grad(*block):
            outputs.append(checkpoint(attend_block, mask, span, *args, *block, use_reentrant=False))
        else:
            outputs.append(attend_block(mask, span, *args, *block))
    return torch.cat(outputs, dim=2)


def _attention_block(
    mask: AttentionMask,
    span: tuple[int, int, int, int, int, int],
    dropout_p: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    bias = mask.bias_block(*span, q.dtype, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1]
    )


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """softmax(q K^T / sqrt(d_k) + bias) V for one query per row (B, H, 1, D), or a few (B, H, Tq, D) that each see
    every key of their row but for the bias (no causal rule), the softmax in fp32.

    The query heads that share a KV head are stacked, with their queries, as rows of one matmul against that head's
    keys, so K and V are read once and never repeated. A single query sees every key under `is_causal` (Tq = Tk = 1).
    """
    B, H, n_queries, D = q.shape
    n_kv, n_keys = k.shape[1], k.shape[2]
    grouped = q.reshape(B, n_kv, H // n_kv * n_queries, D)  # query heads h*n_rep .. (h+1)*n_rep-1 read KV head h
    scores = (grouped @ k.transpose(-2, -1)).float() * (D**-0.5)  # (B, Hkv, n_rep * Tq, Tk)
    if mask.bias is not None:
        bias = mask.bias.float()  # (B|1, H|1, Tq|1, Tk)
        if bias.shape[1] > 1 or bias.shape[2] > 1:  # per head (ALiBi) or per query: grouped as the queries are
            bias = bias.expand(-1, H, n_queries, -1).reshape(bias.shape[0], n_kv, -1, n_keys)
        scores = scores + bias
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return (weights @ v).reshape(B, H, n_queries, D)


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout_p: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: softmax(Q K^T / sqrt(d_k) + bias) V, returning the attention weights too.

    With `softcap` (Gemma 2) the scores become softcap * tanh(scores / softcap) before the mask, which no fused
    kernel does.
    """
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    n_queries, n_keys = scores.shape[-2:]
    if mask.bias is None and mask.needs_bias(n_queries, n_keys):  # the reference builds the whole bias
        full = (0, n_queries, 0, n_keys, n_queries, n_keys)
        mask = dataclasses.replace(mask, bias=mask.bias_block(*full, scores.dtype, q.device))
    if mask.fast_causal():
        n_q, n_k = scores.shape[-2:]
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(n_k - n_q + 1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    if mask.bias is not None:
        scores = scores + mask.bias.to(scores.dtype)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = dropout(weights, dropout_p) @ v  # (B, H, Tq, D)
    return out, weights


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float, softcap: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(softcap * tanh(Q K^T / (sqrt(d_k) * softcap)) + bias) V (Gemma 2), which no fused kernel computes.

    Short inputs go through `math_attention` whole (with their weights); past the dense bias's size, by blocks of
    QUERY_BLOCK queries over the keys each can see, so memory stays linear in the length (as `chunked_attention`),
    each block checkpointed in training.
    """
    if mask.bias is not None or q.shape[2] * k.shape[2] <= QUERY_BLOCK * QUERY_BLOCK:
        return math_attention(q, k, v, mask, dropout_p, softcap)
    return by_query_blocks(_capped_block, q, k, v, mask, dropout_p, softcap), None


def _capped_block(
    mask: AttentionMask,
    span: tuple[int, int, int, int, int, int],
    dropout_p: float,
    softcap: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    bias = mask.bias_block(*span, q.dtype, q.device)
    return math_attention(q, k, v, AttentionMask(bias=bias), dropout_p, softcap)[0]


ATTENTION_BACKENDS: dict[str, Backend] = {"sdpa": sdpa_attention, "math": math_attention}


class Attention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Keys and values have n_kv_heads heads (GQA; MQA when 1). A `cross` layer attends to `context` (or its cache).
    Set `keep_weights` to store the last attention weights (math backend) in `last_weights`.
    Under tensor parallelism the projections hold a slice of the heads; `heads` then names which ones, so that a
    per-head bias (ALiBi) is sliced to match.
    Without `scale_attention` (T5) the scores are plain q.k: every kernel divides by sqrt(head_dim), so the
    queries are multiplied by it first.
    """

    def __init__(self, config: ModelConfig, cross: bool = False) -> None:
        super().__init__()
        self.cross = cross
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, q_dim, bias=config.attn_bias)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        out_bias = config.attn_bias if config.attn_out_bias is None else config.attn_out_bias
        self.out_proj = nn.Linear(q_dim, config.d_model, bias=out_bias)
        # Qwen3 and Gemma 3 normalize each head's queries and keys (over head_dim) before RoPE
        with_norms = config.qk_norm and not cross
        self.q_norm = make_norm(config, self.head_dim) if with_norms else None
        self.k_norm = make_norm(config, self.head_dim) if with_norms else None
        self.qkv_proj: nn.Module | None = None  # q, k and v in one layer, for serving: `fuse_projections`
        self.qkv_sizes: list[int] = []  # the widths of q, k and v in qkv_proj's output, set with it
        self.backend = ATTENTION_BACKENDS[config.attention_backend]
        self.softcap = config.attn_logit_softcap  # Gemma 2's cap on the scores: `attend` takes the math path
        self.attn_dropout = config.attn_dropout
        self.keep_weights = False
        self.last_weights: torch.Tensor | None = None
        self.heads = slice(None)  # the query heads this module computes: all of them unless sharded
        self.query_scale = 1.0 if config.scale_attention else math.sqrt(self.head_dim)
        if config.attention_scale_dim is not None:  # scores over sqrt(attention_scale_dim), not sqrt(head_dim)
            self.query_scale *= math.sqrt(self.head_dim / config.attention_scale_dim)
        # For serving: the rotary embedding in one fused kernel, which gives None where it does not apply
        # (`tformer.kernels.elementwise`)
        self.fused_rotary: Callable[[torch.Tensor, Rotary], torch.Tensor | None] | None = None

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rotary: Rotary | None = None,
        context: torch.Tensor | None = None,
        cache: SelfAttentionCache | CrossKV | None = None,
        cache_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). With a self-attention `cache`, x holds the tokens at `cache_positions`."""
        B, T, _ = x.shape
        if self.cross:
            q = self.to_heads(self.q_proj(x))  # (B, H, T, D)
        else:
            q, k, v = self.project_qkv(x)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if self.cross and getattr(cache, "attends_in_place", False):  # a beam search's memory, which the search
            out = cache.attend(q)  # type: ignore[union-attr]  # gives plain layers only (decoding/beam_cache.py)
            return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))
        if not self.cross:
            if rotary is not None:
                q, k = self.rotate(q, rotary), self.rotate(k, rotary)
            if cache is not None and self.attends_in_cache(cache, mask):
                out = cache.attend_in_place(cache_positions, q, k, v)  # type: ignore[union-attr]  # (B, H, T, D)
                return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))
            if cache is not None:
                k, v = cache.update(cache_positions, k, v)  # (B, Hkv, Tk, D)
        elif cache is not None and cache.k is not None:
            k, v = cache.k, cache.v
            mask = mask if cache.mask is None else cache.mask  # built once per batch (beam search)
        else:
            k, v = self.project_kv(context)
            if cache is not None:
                cache.k, cache.v = k, v
        dropout_p = self.attn_dropout if self.training else 0.0
        if self.heads != slice(None):  # a tensor-parallel shard: a per-head bias keeps this shard's heads
            bias = mask.bias if mask.bias is None or mask.bias.shape[1] == 1 else mask.bias[:, self.heads]
            mask = dataclasses.replace(mask, bias=bias, heads=self.heads)
        beams = q.shape[0] // k.shape[0] if self.cross else 1  # > 1: keys held once per source (CrossKV.beams)
        if beams > 1:  # the beams of a source are its queries: (B*K, H, T, D) -> (B, H, K*T, D)
            q = q.unflatten(0, (-1, beams)).transpose(1, 2).flatten(2, 3)
        out, weights = self.attend(q, k, v, mask, dropout_p)  # (B, H, T, D)
        if beams > 1:
            out = out.unflatten(2, (beams, T)).transpose(1, 2).flatten(0, 1)  # (B*K, H, T, D)
        if self.keep_weights:
            self.last_weights = None if weights is None else weights.detach()
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*D)
        return self.out_proj(out)

    def rotate(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """x (B, heads, T, D) rotated by the rotary embedding's angles, in the fused kernel where it applies."""
        if self.fused_rotary is not None and (out := self.fused_rotary(x, rotary)) is not None:
            return out
        return apply_rotary(x, rotary)

    def attends_in_cache(self, cache: SelfAttentionCache, mask: AttentionMask) -> bool:
        """Whether this step's queries may attend inside `cache` (see `SelfAttentionCache`): the cache offers it
        (the engine's decode steps and packed prompt steps), causality is the mask's only rule, and this layer
        attends plainly."""
        return getattr(cache, "attends_in_place", False) and mask.causal_only() and self.attends_plainly()

    def attends_plainly(self) -> bool:
        """Whether this layer computes plain softmax attention over all its heads, as a cache that attends by itself
        does: no kept weights, soft cap, dropout, tensor-parallel shard, other backend or replaced `attend`."""
        return (
            self.backend is sdpa_attention
            and type(self).attend is Attention.attend
            and not self.keep_weights
            and self.softcap is None
            and not (self.training and self.attn_dropout)
            and self.heads == slice(None)
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention kernel: (B, H, Tq, D) queries over (B, Hkv, Tk, D) keys and values -> output, weights.

        Subclasses (linear attention) and context parallelism (ring attention) replace this step only. Capped
        scores (`softcap`) take the math path whatever the backend: no fused kernel caps them.
        """
        if self.softcap is not None:
            return softcapped_attention(q, k, v, mask, dropout_p, self.softcap)
        return self.backend(q, k, v, mask, dropout_p)

    def to_heads(self, projected: torch.Tensor) -> torch.Tensor:
        """(B, T, heads * D) -> (B, heads, T, D)."""
        B, T, _ = projected.shape
        return projected.view(B, T, -1, self.head_dim).transpose(1, 2)

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `source` (B, S, d): (B, Hkv, S, D) each, before any rotary embedding."""
        return self.to_heads(self.k_proj(source)), self.to_heads(self.v_proj(source))

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of x, before any rotary embedding."""
        if self.qkv_proj is None:
            return self.to_heads(self.q_proj(x)), *self.project_kv(x)
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return self.to_heads(q), self.to_heads(k), self.to_heads(v)

    def fuse_projections(self, concat: Callable[[list[nn.Module]], nn.Module | None]) -> None:
        """For serving: queries, keys and values of self-attention come from one layer, one matmul instead of
        three on the same input; `concat` joins layers by their output rows (`tformer.kernels.fusion`), or
        gives None for layers it cannot join, which leaves this module as it is. Otherwise the
        three layers are dropped, so this module no longer trains, loads or saves q_proj / k_proj / v_proj.
        Cross-attention keeps them: its queries and its keys and values read different inputs."""
        if self.cross or self.qkv_proj is not None:
            return
        parts = [self.q_proj, self.k_proj, self.v_proj]
        fused = concat(parts)
        if fused is not None:
            self.qkv_sizes = [part.out_features for part in parts]
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj
