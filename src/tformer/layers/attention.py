"""Multi-head attention (MHA / GQA / MQA; self or cross) with swappable backends.

Backends live in ATTENTION_BACKENDS: "sdpa" calls torch's fused scaled_dot_product_attention,
"math" writes softmax(QK^T / sqrt(d_k) + bias) V out by hand and also returns the weights for plots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tformer.config import ModelConfig
from tformer.layers.dropout import dropout
from tformer.layers.kv_cache import CrossKV, SelfAttentionCache
from tformer.layers.positions import Rotary, apply_rotary


@dataclass
class AttentionMask:
    """What a query may attend to: an additive bias (B|1, H|1, Tq, Tk), or just 'causal' or nothing.

    `bias` holds 0 where attention is allowed, the dtype's most negative number where it is not, plus any
    ALiBi term. When it is None and `is_causal` is set, backends use their fast causal path.
    """

    bias: torch.Tensor | None = None
    is_causal: bool = False
    key_padding: torch.Tensor | None = None  # (B, Tk) bool, True for real keys
    global_tokens: torch.Tensor | None = None  # (B, Tk) bool, Longformer's tokens that attend and are attended everywhere


def build_mask(
    n_queries: int,
    key_padding: torch.Tensor | None,
    n_keys: int,
    causal: bool,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None = None,
    position_bias: torch.Tensor | None = None,
    query_slots: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
) -> AttentionMask:
    """Combines causal, sliding-window and padding masks with a position bias, once per forward.

    Queries are the last `n_queries` of the `n_keys` positions (so a cache's new tokens line up at the end),
    or, when given, sit at `query_slots` (B|1, Tq): a batch of sequences at different positions.
    `key_padding` is (B, Tk) with True for real tokens. `prefix_lengths` (B,) makes the first slots of each
    row a bidirectional prefix (prefix LM): they see each other both ways, the rest stays causal.
    A fully masked row gets uniform weights, not NaN.
    """
    if window is not None and window >= n_keys:
        window = None
    simple = key_padding is None and window is None and position_bias is None
    if simple and query_slots is None and prefix_lengths is None:
        if not causal:
            return AttentionMask()
        if n_queries == n_keys:
            return AttentionMask(is_causal=True)
    if query_slots is None:
        query_slots = torch.arange(n_keys - n_queries, n_keys, device=device)[None]
    q_idx = query_slots[:, None, :, None]  # (B|1, 1, Tq, 1)
    k_idx = torch.arange(n_keys, device=device)  # (Tk,)
    allowed = torch.ones(1, 1, n_queries, n_keys, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (k_idx <= q_idx)
    if prefix_lengths is not None:
        prefix = prefix_lengths[:, None, None, None]  # (B, 1, 1, 1)
        allowed = allowed | ((q_idx < prefix) & (k_idx < prefix))
    if window is not None:
        allowed = allowed & (q_idx - k_idx < window)  # (B|1, 1, Tq, Tk)
    if key_padding is not None:
        allowed = allowed & key_padding.bool()[:, None, None, :]  # (B, 1, Tq, Tk)
    bias = torch.zeros((), dtype=dtype, device=device) if position_bias is None else position_bias.to(dtype)
    bias = bias.masked_fill(~allowed, torch.finfo(dtype).min)
    return AttentionMask(bias=bias)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D): each KV head serves n_rep consecutive query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


Backend = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
CPU_TRAINING_MATH_MAX_KEYS = 256  # longest key length at which CPU bf16 training takes the math path (see sdpa)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
) -> tuple[torch.Tensor, None]:
    """torch's fused kernel (flash / memory-efficient / math, chosen by torch); GQA without copying K and V.

    One exception: a batch of single queries in bf16/fp16 on the CPU (a batched decode step) goes to
    `single_query_attention`, because torch's CPU kernel is slow there: for 32 rows of SmolLM2's attention
    (9 query heads on 3 KV heads, 200 keys) it took 3.4 ms in bf16 against 0.29 ms for two grouped matmuls
    (4 rows: 0.40 against 0.11 ms). For one row the kernel is as fast, and SmolLM2 decoded faster with it.

    A second exception: bf16/fp16 training on the CPU over at most CPU_TRAINING_MATH_MAX_KEYS keys goes to the
    math path, since torch's CPU flash backward is slow for short sequences (forward + backward, 4 heads of 64,
    4,096 tokens, a padding mask, 2026-12-01): 29.9 against 4.6 ms at 16 keys, 17.0 / 4.8 at 32, 18.3 / 6.0 at
    64, 22.2 / 14.2 at 128, 22.8 / 21.0 at 256, and 38.7 / 42.0 at 512, where the kernel wins. In fp32 the
    kernel is as fast or faster at every length, so fp32 keeps it.
    """
    low_precision = q.dtype in (torch.bfloat16, torch.float16)
    on_cpu = q.device.type == "cpu"
    if q.shape[2] == 1 and q.shape[0] > 1 and on_cpu and low_precision and not dropout_p:
        return single_query_attention(q, k, v, mask), None
    if on_cpu and low_precision and q.requires_grad and k.shape[2] <= CPU_TRAINING_MATH_MAX_KEYS:
        return math_attention(q, k, v, mask, dropout_p)[0], None
    bias = None if mask.bias is None else mask.bias.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=mask.is_causal, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out, None


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """softmax(q K^T / sqrt(d_k) + bias) V for one query per row (B, H, 1, D), the softmax in fp32.

    The query heads that share a KV head are stacked as rows of one matmul against that head's keys, so K and
    V are read once and never repeated. A single query sees every key under `is_causal` (Tq = Tk = 1).
    """
    B, H, _, D = q.shape
    n_kv, n_keys = k.shape[1], k.shape[2]
    grouped = q.reshape(B, n_kv, H // n_kv, D)  # query heads h*n_rep .. (h+1)*n_rep-1 read KV head h
    scores = (grouped @ k.transpose(-2, -1)).float() * (D**-0.5)  # (B, Hkv, n_rep, Tk)
    if mask.bias is not None:
        bias = mask.bias.float()  # (B|1, H|1, 1, Tk)
        if bias.shape[1] > 1:  # a per-head bias (ALiBi): heads are grouped the same way
            bias = bias.reshape(bias.shape[0], n_kv, -1, n_keys)
        scores = scores + bias
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return (weights @ v).reshape(B, H, 1, D)


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: softmax(Q K^T / sqrt(d_k) + bias) V, returning the attention weights too."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    if mask.is_causal:
        n_q, n_k = scores.shape[-2:]
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(n_k - n_q + 1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    if mask.bias is not None:
        scores = scores + mask.bias.to(scores.dtype)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = dropout(weights, dropout_p) @ v  # (B, H, Tq, D)
    return out, weights


ATTENTION_BACKENDS: dict[str, Backend] = {"sdpa": sdpa_attention, "math": math_attention}


class Attention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Keys and values have n_kv_heads heads (GQA; MQA when 1). A `cross` layer attends to `context` (or its cache).
    Set `keep_weights` to store the last attention weights (math backend) in `last_weights`.
    Under tensor parallelism the projections hold a slice of the heads; `heads` then names which ones, so that a
    per-head bias (ALiBi) is sliced to match.
    """

    def __init__(self, config: ModelConfig, cross: bool = False) -> None:
        super().__init__()
        self.cross = cross
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, q_dim, bias=config.attn_bias)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.out_proj = nn.Linear(q_dim, config.d_model, bias=config.attn_bias)
        self.backend = ATTENTION_BACKENDS[config.attention_backend]
        self.attn_dropout = config.attn_dropout
        self.keep_weights = False
        self.last_weights: torch.Tensor | None = None
        self.heads = slice(None)  # the query heads this module computes: all of them unless sharded

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
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if not self.cross:
            k, v = self.project_kv(x)
            if rotary is not None:
                q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
            if cache is not None:
                k, v = cache.update(cache_positions, k, v)  # (B, Hkv, Tk, D)
        elif cache is not None and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            k, v = self.project_kv(context)
            if cache is not None:
                cache.k, cache.v = k, v
        dropout_p = self.attn_dropout if self.training else 0.0
        if mask.bias is not None and mask.bias.shape[1] > 1 and self.heads != slice(None):
            mask = dataclasses.replace(mask, bias=mask.bias[:, self.heads])
        out, weights = self.attend(q, k, v, mask, dropout_p)  # (B, H, T, D)
        if self.keep_weights:
            self.last_weights = None if weights is None else weights.detach()
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*D)
        return self.out_proj(out)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention kernel: (B, H, Tq, D) queries over (B, Hkv, Tk, D) keys and values -> output, weights.

        Subclasses (linear attention) and context parallelism (ring attention) replace this step only.
        """
        return self.backend(q, k, v, mask, dropout_p)

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `source` (B, S, d): (B, Hkv, S, D) each, before any rotary embedding."""
        B, S, _ = source.shape
        k = self.k_proj(source).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.v_proj(source).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        return k, v
