"""A beam search's caches, read in place through slot tables: nothing copied, nothing reordered.

`BeamKVCache` holds the self-attention keys. A beam search step gives each beam row a parent; the plain `KVCache`
then copies the parent's keys into the row (`KVCache.reorder`), every layer, every step. Here each row writes only
the keys of its own new tokens, into its own cache row, and a slot table says, for each beam row and position, where
that beam's key lies: a reorder takes the parents' table rows (a few integers per beam), and the attention reads the
keys through the table with `kernels.beam_attention` (the engine's `kernels.paged_attention` where it is not built;
the cache is laid out as slots, (rows * max_len, Hkv, D), so row r's key at position t is slot r * max_len + t).
All rows of a batch are at the same position in a search step, so the slot a row writes was never written for any
live beam's earlier positions: no beam's keys are overwritten. Rows that leave the batch (finished sentences) leave
the table; the cache keeps its rows.

`BeamMemory` holds the cross-attention keys and values, projected once per source (B, S, Hkv, D) and never repeated
per beam: beam row r reads its source's real (unpadded) keys through a slot table of its own, with the same kernel.
The memory's padding is the table's length, so no mask is built or added at any step.
"""

from __future__ import annotations

import torch

from tformer.kernels.beam_attention import beam_attention
from tformer.kernels.paged_attention import paged_decode_attention, supports


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the beam caches attend in place here: the paged kernel serves this device and dtype."""
    return supports(dtype, device)


class BeamKVCache:
    """Self-attention keys and values (rows * max_len, Hkv, D) written row by row, read through `slots` (B, length):
    see the module."""

    def __init__(
        self, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (batch_size * max_len, n_kv_heads, head_dim)
        self.max_len = max_len
        self.k = torch.empty(shape, dtype=dtype, device=device)  # a slot is read only once written
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.slots = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (rows in the batch, length)
        self.attends_in_place = applies(self.k.device, dtype)  # else the layer asks `update` for gathered keys
        self.beams = 1  # rows per sentence, which the search sets: the kernel reads a sentence's shared keys once

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
        if positions.shape[0] != 1 or start != self.slots.shape[1] or start + n_new > self.max_len:
            raise ValueError(
                f"a beam cache takes every row's next {n_new} positions from {self.slots.shape[1]}, within "
                f"{self.max_len}; got positions {positions.tolist()}"
            )
        rows = k.shape[0]
        by_row = (-1, self.max_len, *self.k.shape[1:])  # (rows, max_len, Hkv, D)
        self.k.view(by_row)[:rows, start : start + n_new] = k.transpose(1, 2)
        self.v.view(by_row)[:rows, start : start + n_new] = v.transpose(1, 2)
        own = (
            torch.arange(start, start + n_new, device=k.device)
            + self.max_len * torch.arange(rows, device=k.device)[:, None]
        )
        self.slots = torch.cat([self.slots, own], dim=1)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new keys and returns every row's keys and values (B, Hkv, T, D), gathered through the table."""
        self._write(positions, k, v)
        return self.k[self.slots].transpose(1, 2), self.v[self.slots].transpose(1, 2)

    def attend_in_place(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Writes the new keys and returns each row's attention over its beam's keys (B, H, 1, D): one query a row,
        which sees all its keys (causality holds: the table ends at the query's own position)."""
        if q.shape[2] != 1:
            raise ValueError(f"a beam cache attends one query per row, got {q.shape[2]}")
        self._write(positions, k, v)
        rows, length = self.slots.shape
        lengths = torch.full((rows,), length, dtype=torch.long, device=q.device)
        return _attend(q, self.k, self.v, self.slots, lengths, self.beams)

    def reorder(self, index: torch.Tensor, length: int | None = None) -> None:
        """Row i continues the beam of row `index[i]`: it takes that row's table (its keys stay where they are)."""
        self.slots = self.slots[index]


class BeamMemory:
    """The encoder memory's keys and values for a beam search's cross-attention, once per source, each beam row
    reading its source's real keys through `slots` (rows, S) and `lengths` (rows,): see the module.

    It stands in for `CrossKV` in a layer's cache; `Attention` asks `attends_in_place` and calls `attend`.
    """

    attends_in_place = True

    def __init__(self, k: torch.Tensor, v: torch.Tensor, src_mask: torch.Tensor, beams: int) -> None:
        B, n_kv, S, D = k.shape
        # (B, Hkv, S, D) views of the projection's (B, S, Hkv * D) output: as slots, no copy
        self.k = k.transpose(1, 2).reshape(B * S, n_kv, D)
        self.v = v.transpose(1, 2).reshape(B * S, n_kv, D)
        real = src_mask.bool()
        order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices  # real keys first, in position order
        slots = torch.arange(B, device=k.device)[:, None] * S + order
        self.slots = slots.repeat_interleave(beams, 0)  # (B * beams, S)
        self.lengths = real.sum(1).repeat_interleave(beams, 0)  # (B * beams,)
        self.beams = beams

    @staticmethod
    def serves(cross: object, src_mask: torch.Tensor | None) -> bool:
        """Whether a `CrossKV` of projected keys may become a BeamMemory: the kernel serves them, the memory's
        only rule is its padding (a mask given), and every source has a real token."""
        k = getattr(cross, "k", None)
        return (
            k is not None and src_mask is not None and applies(k.device, k.dtype) and bool(src_mask.bool().any(1).all())
        )

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """softmax(q K^T / sqrt(D)) V of one query per beam row (rows, H, 1, D) over its source's real keys."""
        return _attend(q, self.k, self.v, self.slots, self.lengths, self.beams)

    def reorder(self, index: torch.Tensor) -> None:
        """Keeps the beam rows `index` names (sources leaving the batch): their tables; the keys stay."""
        self.slots, self.lengths = self.slots[index], self.lengths[index]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, beams: int
) -> torch.Tensor:
    """The beam kernel, else the paged kernel (or its torch path): the same attention over the same slots."""
    out = beam_attention(q, k, v, slots, lengths, beams)
    return out if out is not None else paged_decode_attention(q, k, v, slots, lengths)
