"""T5's relative position bias (Raffel et al., 2020, sec. 2.1): a learned scalar per head and bucket of distance.

Each query-key pair falls in a bucket of its relative distance k - q: one bucket per distance up to half the
buckets, then buckets of logarithmically growing width up to `max_distance`, beyond which all distances share the
last bucket. An encoder buckets both directions (half the buckets each); a decoder sees only the past, so all its
buckets count past distances. One table serves every layer of a stack, and the bias depends on positions alone,
so it is computed for any block of queries and keys (the chunked attention path) without a whole matrix.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """The bucket of each relative position k - q (any shape, integer), as in Mesh TensorFlow's T5.

    Bidirectional: buckets num_buckets/2 .. num_buckets-1 hold keys after the query. Causal: keys after the query
    fall in bucket 0 with the query itself (the causal mask hides them anyway).
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # log-spaced beyond max_exact: the float division by max_exact happens first, as in the reference
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    if_large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    if_large = if_large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, if_large)


class RelativePositionBias(nn.Module):
    """A learned bias per (bucket, head): `forward(q_pos, k_pos)` gives the additive scores (B|1, H, Tq, Tk)."""

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, bidirectional: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_buckets, n_heads)  # (buckets, H), T5's relative_attention_bias
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos (B|1, Tq) and k_pos (B|1, Tk) position ids -> bias (B|1, H, Tq, Tk)."""
        relative = k_pos[:, None, :] - q_pos[:, :, None]  # (B|1, Tq, Tk)
        bucket = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.embedding(bucket).permute(0, 3, 1, 2)  # (B|1, Tq, Tk, H) -> (B|1, H, Tq, Tk)
