"""Longformer's sparse self-attention (Beltagy et al., 2020): a sliding local window plus global tokens.

With w = attention_window // 2, an ordinary token attends to the real tokens at most w positions away and to
every global token. A global token attends to every real token, and with its own query, key and value
projections (q_global_proj, k_global_proj, v_global_proj), as in the paper and Hugging Face's
LongformerSelfAttention. Both kinds of row share out_proj.

Cost, for T tokens, H heads of width D, a one-sided window w and G global tokens: the local scores are computed
block by block, each block of b = min(w, T) queries against the (2r + 1) * b keys around it (r = ceil(w / b),
at most the number of other blocks), so time is O(H * T * (3w + G) * D) and memory O(H * T * (3w + G)): about
3w scores per query where 2w + 1 are used, and never a T x T matrix. The global rows add O(H * G * T).

The Sparse Transformer's two causal patterns (Child et al., 2019) follow: `strided` and `fixed`, each query
gathering its pattern's keys and taking one softmax over them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tformer.config import ModelConfig
from tformer.errors import ConfigError
from tformer.layers.attention import Attention, repeat_kv
from tformer.layers.dropout import dropout
from tformer.layers.masks import AttentionMask
from tformer.layers.positions import Rotary, apply_rotary


def band_windows(x: torch.Tensor, block: int, reach: int, fill: float | bool = 0) -> torch.Tensor:
    """The keys around each block of queries: x (..., T, *) -> (..., n_blocks, (2 * reach + 1) * block, *).

    Block c holds positions [c * block, (c + 1) * block); its window starts `reach` blocks earlier. Positions
    outside 0..T-1 hold `fill`. x's sequence dimension is its third for (B, H, T, D), its second for (B, T).
    """
    seq_dim = 2 if x.dim() == 4 else 1
    n_blocks = math.ceil(x.shape[seq_dim] / block)
    left, right = reach * block, n_blocks * block - x.shape[seq_dim] + reach * block
    pad = (left, right) if seq_dim == x.dim() - 1 else (0, 0, left, right)
    windows = F.pad(x, pad, value=fill).unfold(seq_dim, (2 * reach + 1) * block, block)
    return windows if seq_dim == x.dim() - 1 else windows.transpose(-1, -2)  # (B, H, n, span, D)


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_ok: torch.Tensor,
    window: int,
    global_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V over keys j with |i - j| <= window and key_ok[j], plus keys every query sees.

    q, k, v are (B, H, T, D); key_ok (B, T) bool. `global_kv` = (keys (B, H, G, D), values, ok (B, G)) are
    extra keys in every query's softmax (Longformer's global tokens); they must not also pass key_ok.
    Returns (B, H, T, D). A query with no allowed key gets finite (uniform) weights, not NaN.
    """
    B, H, T, D = q.shape
    block = min(window, T)
    n_blocks = math.ceil(T / block)
    reach = min(math.ceil(window / block), n_blocks - 1)
    span = (2 * reach + 1) * block
    queries = F.pad(q, (0, 0, 0, n_blocks * block - T)).view(B, H, n_blocks, block, D)
    keys, values = band_windows(k, block, reach), band_windows(v, block, reach)  # (B, H, n, span, D)
    offset = torch.arange(span, device=q.device) - reach * block - torch.arange(block, device=q.device)[:, None]
    allowed = (offset.abs() <= window) & band_windows(key_ok, block, reach, fill=False)[:, :, None]  # (B, n, b, span)
    scores = _scores(queries, keys)  # (B, H, n, b, span)
    lowest = torch.finfo(scores.dtype).min
    scores = scores.masked_fill(~allowed[:, None], lowest)
    n_global = 0
    if global_kv is not None:
        global_k, global_v, global_ok = global_kv
        n_global = global_k.shape[2]
        global_scores = _scores(queries, global_k[:, :, None])  # (B, H, n, b, G)
        global_scores = global_scores.masked_fill(~global_ok[:, None, None, None], lowest)
        scores = torch.cat([global_scores, scores], dim=-1)
    weights = dropout(torch.softmax(scores, dim=-1).to(v.dtype), dropout_p)
    out = weights[..., n_global:] @ values  # (B, H, n, b, D)
    if global_kv is not None:
        out = out + weights[..., :n_global] @ global_v[:, :, None]
    return out.view(B, H, n_blocks * block, D)[:, :, :T]


def global_slots(is_global: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of each row's global tokens, in order: (B, G) indices and (B, G) validity, G the largest count.

    Rows with fewer global tokens are filled with other positions, marked invalid.
    """
    counts = is_global.sum(dim=1)
    n_global = int(counts.max())
    order = torch.sort(is_global.logical_not().int(), dim=1, stable=True).indices[:, :n_global]  # globals first
    return order, torch.arange(n_global, device=is_global.device) < counts[:, None]


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T / sqrt(D) in at least fp32, where the softmax runs (as in Hugging Face's Longformer)."""
    scores = q @ k.transpose(-1, -2)
    return scores.to(torch.promote_types(scores.dtype, torch.float32)) / math.sqrt(q.shape[-1])


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B|1, T, d) at positions index (B, G) -> (B, G, d)."""
    x = x.expand(index.shape[0], -1, -1)
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


class LongformerAttention(nn.Module):
    """Longformer self-attention for encoders: local window of `attention_window // 2` each side, global tokens.

    The tokens in `mask.global_tokens` (B, T) are global; `mask.key_padding` (B, T) marks real tokens. Nothing
    else in `mask` is read. Encoder self-attention only: no cache and no cross-attention. Keys and values may
    have fewer heads than queries (GQA), and RoPE rotates local and global queries and keys alike.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.window = config.attention_window // 2
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, q_dim, bias=config.attn_bias)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.out_proj = nn.Linear(q_dim, config.d_model, bias=config.attn_bias)
        self.q_global_proj = nn.Linear(config.d_model, q_dim, bias=config.attn_bias)
        self.k_global_proj = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.v_global_proj = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.attn_dropout = config.attn_dropout

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rotary: Rotary | None = None,
        context: torch.Tensor | None = None,
        cache: object | None = None,
        cache_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d)."""
        if context is not None or cache is not None:
            raise ValueError("LongformerAttention is encoder self-attention: it takes no context and no cache")
        B, T, _ = x.shape
        real = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask.key_padding is None else mask.key_padding
        is_global = None if mask.global_tokens is None else mask.global_tokens & real
        if is_global is not None and not bool(is_global.any()):
            is_global = None
        dropout_p = self.attn_dropout if self.training else 0.0
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, T, D)
        if is_global is None:
            out = banded_attention(q, k, v, real, self.window, dropout_p=dropout_p)
        else:
            slots, ok = global_slots(is_global)
            index = slots[:, None, :, None].expand(-1, self.n_heads, -1, self.head_dim)  # (B, H, G, D)
            global_kv = (k.gather(2, index), v.gather(2, index), ok)
            out = banded_attention(q, k, v, real & ~is_global, self.window, global_kv, dropout_p)
            out = self._global_rows(x, out, slots, ok, real, rotary, dropout_p)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, H*D) -> (B, T, d)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, heads * D) -> (B, heads, T, D)."""
        return x.view(x.shape[0], x.shape[1], -1, self.head_dim).transpose(1, 2)

    def _global_rows(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        slots: torch.Tensor,
        ok: torch.Tensor,
        real: torch.Tensor,
        rotary: Rotary | None,
        dropout_p: float,
    ) -> torch.Tensor:
        """Replaces the rows of `out` (B, H, T, D) at global `slots` by their attention over every real token."""
        B, H, T, D = out.shape
        q = self._heads(self.q_global_proj(_gather_rows(x, slots)))  # (B, H, G, D)
        k, v = self._heads(self.k_global_proj(x)), self._heads(self.v_global_proj(x))  # (B, Hkv, T, D)
        if rotary is not None:
            q = apply_rotary(q, (_gather_rows(rotary[0], slots), _gather_rows(rotary[1], slots)))
            k = apply_rotary(k, rotary)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scores = _scores(q, k)  # (B, H, G, T)
        scores = scores.masked_fill(~real[:, None, None], torch.finfo(scores.dtype).min)
        rows = dropout(torch.softmax(scores, dim=-1).to(v.dtype), dropout_p) @ v  # (B, H, G, D)
        target = torch.where(ok, slots, T)  # unused slots write to a scratch row T, dropped below
        out = F.pad(out, (0, 0, 0, 1)).scatter(2, target[:, None, :, None].expand(B, H, -1, D), rows)
        return out[:, :, :T]


# ---- the Sparse Transformer's strided and fixed patterns (Child et al., 2019) --------------------------------------


def strided_key_slots(query_slots: torch.Tensor, stride: int, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a causal query at slot i sees under the strided pattern, as (..., Tq, stride + M) slots and validity.

    The pattern is the union of the paper's two heads: A1, the last `stride` slots (i - stride < j <= i), and A2,
    every slot j <= i with (i - j) mod stride == 0. A2's slots at distance 0 lie in A1 as well, so A2 contributes
    i - stride, i - 2 * stride, ...: M = ceil(n_keys / stride) of them at most, and the two lists never overlap.
    Slots before 0 are marked invalid (index 0 stands in for them).
    """
    local = torch.arange(stride, device=query_slots.device)  # distances 0 .. stride - 1
    strided = torch.arange(1, math.ceil(n_keys / stride) + 1, device=query_slots.device) * stride
    slots = query_slots[..., None] - torch.cat([local, strided])  # (..., Tq, stride + M)
    return slots.clamp_min(0), slots >= 0


def fixed_key_slots(
    query_slots: torch.Tensor, block: int, summary: int, n_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a causal query at slot i sees under the fixed pattern, as (..., Tq, block + c * n_blocks) slots and
    validity (c = `summary`, n_blocks = ceil(n_keys / block)).

    The pattern is the union of the paper's two heads: A1, the slots of i's own block of `block` slots up to i
    (floor(j / block) == floor(i / block), j <= i), and A2, the last c slots of every block (j mod block >= block - c).
    A2's slots in i's own block lie in A1 as well, so A2 contributes those of the earlier blocks only, and the two
    lists never overlap. Invalid slots are marked (index 0 stands in for them).
    """
    device = query_slots.device
    own_block = query_slots // block  # (..., Tq)
    local = (own_block * block)[..., None] + torch.arange(block, device=device)  # (..., Tq, block)
    local_ok = local <= query_slots[..., None]
    n_blocks = math.ceil(n_keys / block)
    firsts = torch.arange(n_blocks, device=device) * block + block - summary
    summaries = (firsts[:, None] + torch.arange(summary, device=device)).flatten()  # (n_blocks * c,)
    summary_ok = summaries // block < own_block[..., None]  # (..., Tq, n_blocks * c): earlier blocks only
    slots = torch.cat([local, summaries.expand(*local.shape[:-1], -1)], -1)
    ok = torch.cat([local_ok, summary_ok], -1)
    return torch.where(ok, slots, 0), ok


def strided_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stride: int,
    query_slots: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal softmax attention under the strided pattern: q (B, H, Tq, D) over k, v (B, Hkv, Tk, D) -> (B, H, Tq, D).

    Each query gathers its stride + ceil(Tk / stride) keys and takes one softmax over them, so scores cost
    O(Tq * (stride + Tk / stride)) instead of O(Tq * Tk): O(T * sqrt(T)) with stride ~ sqrt(T), the paper's point.
    The queries sit at `query_slots` (B|1, Tq), or else are the last Tq of the Tk slots (a cached decoding step).
    `key_padding` (B, Tk) is True for real keys. A query with no allowed key gets finite weights, not NaN.
    """
    query_slots = _query_slots(q, k, query_slots)
    slots, ok = strided_key_slots(query_slots, stride, k.shape[2])
    return gathered_attention(q, k, v, slots, ok, key_padding, dropout_p)


def fixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: int,
    summary: int,
    query_slots: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal softmax attention under the fixed pattern (blocks of `block` keys, the last `summary` of each seen by
    every later block): as `strided_attention`, with block + summary * ceil(Tk / block) keys gathered per query,
    O(T * sqrt(T)) scores with block ~ sqrt(T)."""
    query_slots = _query_slots(q, k, query_slots)
    slots, ok = fixed_key_slots(query_slots, block, summary, k.shape[2])
    return gathered_attention(q, k, v, slots, ok, key_padding, dropout_p)


def _query_slots(q: torch.Tensor, k: torch.Tensor, query_slots: torch.Tensor | None) -> torch.Tensor:
    """The queries' slots: as given (B|1, Tq), or else the last Tq of the Tk key slots."""
    if query_slots is not None:
        return query_slots
    n_queries, n_keys = q.shape[2], k.shape[2]
    return torch.arange(n_keys - n_queries, n_keys, device=q.device)[None]


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    ok: torch.Tensor,
    key_padding: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Softmax attention of each query over its own keys: q (B, H, Tq, D), k and v (B, Hkv, Tk, D), the key slots of
    each query (B|1, Tq, S) and whether each is allowed -> (B, H, Tq, D)."""
    B, H, Tq, D = q.shape
    slots, ok = slots.expand(B, -1, -1), ok.expand(B, -1, -1)
    if key_padding is not None:
        ok = ok & key_padding.gather(1, slots.flatten(1)).view_as(slots)
    n_rep = H // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    index = slots.flatten(1)[:, None, :, None].expand(-1, H, -1, D)  # (B, H, Tq * S, D)
    keys = k.gather(2, index).view(B, H, Tq, -1, D)  # (B, H, Tq, S, D)
    values = v.gather(2, index).view(B, H, Tq, -1, D)
    scores = _scores(q[..., None, :], keys).squeeze(-2)  # (B, H, Tq, S)
    scores = scores.masked_fill(~ok[:, None], torch.finfo(scores.dtype).min)
    weights = dropout(torch.softmax(scores, dim=-1).to(v.dtype), dropout_p)
    return (weights[..., None, :] @ values).squeeze(-2)


class StridedAttention(Attention):
    """Causal self-attention under the Sparse Transformer's strided pattern, with Attention's projections.

    Every head attends to the union of the pattern's two parts (the paper's "merged" heads), so a checkpoint is
    the softmax model's tensors. From the mask it reads `key_padding` and `query_slots`; a KV cache works as for
    softmax attention (each step gathers its pattern's keys from the cached slots).
    """

    def __init__(self, config: ModelConfig, cross: bool = False) -> None:
        super().__init__(config, cross)
        self.stride = config.sparse_stride
        self.config_name = config.attention

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
    ) -> tuple[torch.Tensor, None]:
        """The strided pattern over q (B, H, Tq, D) and k, v (B, Hkv, Tk, D); the mask must be causal."""
        self._check_causal(mask)
        return strided_attention(q, k, v, self.stride, mask.query_slots, mask.key_padding, dropout_p), None

    def _check_causal(self, mask: AttentionMask) -> None:
        if not mask.is_causal or mask.prefix_lengths is not None:
            raise ConfigError(
                f"attention '{self.config_name}' is the Sparse Transformer's causal pattern, so it cannot attend "
                "both ways (an encoder or a prefix LM); use it in a decoder trained with the plain causal objective"
            )


class FixedAttention(StridedAttention):
    """Causal self-attention under the Sparse Transformer's fixed pattern (blocks of `sparse_stride` keys, the
    last `sparse_summary` of each block seen by every later one), every head the union of both parts; otherwise
    as StridedAttention (the softmax model's tensors, the same KV cache)."""

    def __init__(self, config: ModelConfig, cross: bool = False) -> None:
        super().__init__(config, cross)
        self.summary = config.sparse_summary

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
    ) -> tuple[torch.Tensor, None]:
        """The fixed pattern over q (B, H, Tq, D) and k, v (B, Hkv, Tk, D); the mask must be causal."""
        self._check_causal(mask)
        out = fixed_attention(q, k, v, self.stride, self.summary, mask.query_slots, mask.key_padding, dropout_p)
        return out, None
