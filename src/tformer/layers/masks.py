"""What each query may attend to, kept as a description until a kernel needs numbers.

An `AttentionMask` names the rules (causal, a sliding window, key padding, a bidirectional prefix, a position bias
such as ALiBi) instead of holding a (B, H, Tq, Tk) tensor. `bias_block` turns the rules into the additive bias of
one block of queries over one range of keys, so that the chunked kernel never builds more than a block.
For short inputs (at most DENSE_BIAS_MAX_ENTRIES query-key pairs) `build_mask` also builds the whole bias once per
forward, which every layer then reuses: the fastest path for training batches and decode steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PositionBias = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]  # (q_pos, k_pos) -> (B|1, H, tq, tk)

# query-key pairs up to which build_mask materializes the whole bias (512 x 512): beyond it, kernels go by blocks
DENSE_BIAS_MAX_ENTRIES = 512 * 512


@dataclass
class AttentionMask:
    """The rules of one attention call; all tensors index keys by slot 0..Tk-1.

    `bias`, when set, is the dense additive bias (B|1, H|1, Tq, Tk): 0 where attention is allowed, the dtype's most
    negative number where it is not, plus any position bias. When it is None, `is_causal` alone and no other rule
    means the fast causal path; with other rules, kernels build the bias by blocks with `bias_block`.
    """

    bias: torch.Tensor | None = None
    is_causal: bool = False
    key_padding: torch.Tensor | None = None  # (B, Tk) bool, True for real keys
    global_tokens: torch.Tensor | None = (
        None  # (B, Tk) bool, Longformer's tokens that attend and are attended everywhere
    )
    window: int | None = None  # causal sliding window: the query at slot i sees slots i - window + 1 .. i
    query_slots: torch.Tensor | None = None  # (B|1, Tq) each query's slot among the keys; None: the last Tq slots
    prefix_lengths: torch.Tensor | None = None  # (B,) a bidirectional prefix (prefix LM) before the causal part
    position_bias: PositionBias | None = None  # an additive per-head bias from positions (ALiBi)
    query_positions: torch.Tensor | None = None  # (B|1, Tq) position ids the position bias reads
    key_positions: torch.Tensor | None = None  # (B|1, Tk)
    heads: slice = field(default_factory=lambda: slice(None))  # the query heads a tensor-parallel shard computes

    def needs_bias(self, n_queries: int, n_keys: int) -> bool:
        """Whether attention needs a bias: anything beyond full attention, or causal attention over as many keys."""
        rules = (self.key_padding, self.window, self.query_slots, self.prefix_lengths, self.position_bias)
        return any(rule is not None for rule in rules) or (self.is_causal and n_queries != n_keys)

    def causal_only(self) -> bool:
        """Whether causality is the only rule (each query sees the keys up to its own slot): no padding, window,
        prefix, global tokens or position bias."""
        rules = (self.key_padding, self.global_tokens, self.window, self.prefix_lengths, self.position_bias)
        return self.is_causal and all(rule is None for rule in rules)

    def causal_suffix(self) -> bool:
        """Whether causality is the only rule and the queries are the last Tq slots: each query sees every earlier
        key and itself, which kernels do without a bias (see `causal_suffix_attention`)."""
        return self.causal_only() and self.query_slots is None

    def fast_causal(self) -> bool:
        """Whether a kernel's own causal flag applies: causal, with no bias built and no other rule."""
        return self.is_causal and self.bias is None

    def key_range(self, q_start: int, q_end: int, n_queries: int, n_keys: int) -> tuple[int, int]:
        """The keys that queries q_start..q_end-1 can see at all: fewer under a causal rule or a window.

        Known only when queries are the last Tq slots; with explicit `query_slots` or a prefix, all keys.
        """
        if self.query_slots is not None or self.prefix_lengths is not None:
            return 0, n_keys
        first_slot = n_keys - n_queries
        end = first_slot + q_end if self.is_causal else n_keys
        start = max(0, first_slot + q_start - self.window + 1) if self.window is not None else 0
        return start, end

    def bias_block(
        self,
        q_start: int,
        q_end: int,
        k_start: int,
        k_end: int,
        n_queries: int,
        n_keys: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """The additive bias (B|1, H|1, q_end - q_start, k_end - k_start) of one block of queries over keys.

        A fully masked row gets a uniform bias (all the most negative number), so softmax gives uniform weights,
        not NaN.
        """
        if self.query_slots is None:
            q_idx = torch.arange(n_keys - n_queries + q_start, n_keys - n_queries + q_end, device=device)[None]
        else:
            q_idx = self.query_slots[:, q_start:q_end]
        q_idx = q_idx[:, None, :, None]  # (B|1, 1, tq, 1)
        k_idx = torch.arange(k_start, k_end, device=device)  # (tk,)
        allowed = torch.ones(1, 1, q_end - q_start, k_end - k_start, dtype=torch.bool, device=device)
        if self.is_causal:
            allowed = allowed & (k_idx <= q_idx)
        if self.prefix_lengths is not None:
            prefix = self.prefix_lengths[:, None, None, None]  # (B, 1, 1, 1)
            allowed = allowed | ((q_idx < prefix) & (k_idx < prefix))
        if self.window is not None:
            allowed = allowed & (q_idx - k_idx < self.window)
        if self.key_padding is not None:
            allowed = allowed & self.key_padding[:, None, None, k_start:k_end]  # (B, 1, tq, tk)
        bias = torch.zeros((), dtype=dtype, device=device)
        if self.position_bias is not None:
            q_pos = self.query_positions[:, q_start:q_end]
            position_bias = self.position_bias(q_pos, self.key_positions[:, k_start:k_end])
            if position_bias is not None:
                bias = position_bias[:, self.heads].to(dtype)
        return torch.where(allowed, bias, torch.finfo(dtype).min)  # one pass, where masked_fill copies first


def build_mask(
    *,
    n_queries: int,
    n_keys: int,
    causal: bool,
    dtype: torch.dtype,
    device: torch.device,
    key_padding: torch.Tensor | None = None,
    window: int | None = None,
    position_bias: PositionBias | None = None,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    query_slots: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
    global_tokens: torch.Tensor | None = None,
) -> AttentionMask:
    """The mask of one forward: queries are the last `n_queries` of `n_keys` slots, or sit at `query_slots`.

    `key_padding` (B, Tk) is True for real tokens. `position_bias(query_positions, key_positions)` adds a per-head
    bias (ALiBi). A window at least as long as the keys is no rule at all. The dense bias is built here, once,
    only when it is small (DENSE_BIAS_MAX_ENTRIES); otherwise kernels build it by blocks.
    """
    if window is not None and window >= n_keys:
        window = None
    mask = AttentionMask(
        is_causal=causal,
        key_padding=None if key_padding is None else key_padding.bool(),
        global_tokens=None if global_tokens is None else global_tokens.bool(),
        window=window,
        query_slots=query_slots,
        prefix_lengths=prefix_lengths,
        position_bias=position_bias,
        query_positions=query_positions,
        key_positions=key_positions,
    )
    if mask.needs_bias(n_queries, n_keys) and n_queries * n_keys <= DENSE_BIAS_MAX_ENTRIES:
        mask.bias = mask.bias_block(0, n_queries, 0, n_keys, n_queries, n_keys, dtype, device)
    return mask
