"""`BeamKVCache`: a beam search's self-attention keys and values, shared by beams through a table, never copied.

A beam search step gives each beam row a parent; the plain `KVCache` then copies the parent's keys into the row
(`KVCache.reorder`), every layer, every step. Here each row writes only the keys of its own new tokens, into its own
cache row, and a table says, for each beam row and position, which cache row holds that beam's key: a reorder takes
the parents' table rows (a few integers per beam), and the attention reads the keys through the table
(`kernels.beam_attention`), as a paged cache reads blocks through a block table. All rows of a batch are at the same
position in a search step, so the slot a row writes was never written for any live beam's earlier positions: no
beam's keys are overwritten. Rows that leave the batch (finished sentences) leave the table; the cache keeps its rows.
"""

from __future__ import annotations

import torch

from tformer.kernels.beam_attention import applies, beam_attention, gathered_attention
from tformer.layers.kv_cache import zeroed


class BeamKVCache:
    """Keys and values (B, Hkv, max_len, D) written row by row, read through `table` (B, length): see the module."""

    def __init__(
        self, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)
        self.table = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (rows in the batch, length)
        self.attends_in_place = applies(self.k.device, dtype)  # else the layer asks `update` for gathered keys

    @classmethod
    def replacing(cls, cache: object) -> BeamKVCache:
        """An empty beam cache of another (empty) `KVCache`'s shape, dtype and device."""
        batch, heads, max_len, head_dim = cache.k.shape
        return cls(batch, heads, head_dim, max_len, cache.k.dtype, cache.k.device)

    def first_visible(self, start: int) -> int:
        return 0

    def _write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Row r's new keys (one run of positions shared by every row) into cache row r, and the table's columns."""
        start, n_new = int(positions[0, 0]), k.shape[2]
        if positions.shape[0] != 1 or start != self.table.shape[1] or start + n_new > self.k.shape[2]:
            raise ValueError(
                f"a beam cache takes every row's next {n_new} positions from {self.table.shape[1]}, within "
                f"{self.k.shape[2]}; got positions {positions.tolist()}"
            )
        rows = k.shape[0]
        self.k[:rows, :, start : start + n_new] = k
        self.v[:rows, :, start : start + n_new] = v
        own = torch.arange(rows, device=k.device)[:, None].expand(rows, n_new)
        self.table = torch.cat([self.table, own], dim=1)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new keys and returns every row's keys and values (B, Hkv, T, D), gathered through the table."""
        self._write(positions, k, v)
        T = self.table.shape[1]
        at = torch.arange(T, device=k.device)
        return self.k[self.table, :, at].transpose(1, 2), self.v[self.table, :, at].transpose(1, 2)

    def attend_in_place(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Writes the new keys and returns each row's attention over its beam's keys (B, H, 1, D): one query a row,
        which sees all its keys (causality holds: the table ends at the query's own position)."""
        if q.shape[2] != 1:
            raise ValueError(f"a beam cache attends one query per row, got {q.shape[2]}")
        self._write(positions, k, v)
        out = beam_attention(q, self.k, self.v, self.table)
        return out if out is not None else gathered_attention(q, self.k, self.v, self.table)

    def reorder(self, index: torch.Tensor, length: int | None = None) -> None:
        """Row i continues the beam of row `index[i]`: it takes that row's table (its keys stay where they are)."""
        self.table = self.table[index]
