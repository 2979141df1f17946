"""Contiguous KV caches for incremental decoding (gpt-fast style): one object per attention layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class KVCache:
    """Self-attention keys and values preallocated to `max_len`: (B, Hkv, max_len, D) each.

    `update(start, k, v)` writes the new entries at slots start..start+T and returns every entry so far.
    """

    def __init__(
        self, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; cannot write up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def reorder(self, index: torch.Tensor) -> None:
        """Keeps batch rows `index` (beam search: each surviving hypothesis takes its parent's cache)."""
        self.k, self.v = self.k[index], self.v[index]


@dataclass
class CrossKV:
    """Cross-attention keys and values of the encoder memory, projected once per request."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def reorder(self, index: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k[index], self.v[index]


@dataclass
class LayerCache:
    """What one decoder block keeps between decoding steps."""

    self_attn: KVCache
    cross_attn: CrossKV = field(default_factory=CrossKV)

    def reorder(self, index: torch.Tensor) -> None:
        self.self_attn.reorder(index)
        self.cross_attn.reorder(index)
