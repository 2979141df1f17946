"""Contiguous KV caches for incremental decoding (gpt-fast style): one object per attention layer.

Every self-attention cache follows one protocol, `update(positions, k, v) -> (keys, values)`: it stores the
new keys and values (B, Hkv, T, D) of tokens at `positions` (B|1, T) and returns all keys and values each row
may attend to, indexed by position. The paged cache of the inference engine follows it too.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tformer.layers.masks import AttentionMask

# Below this size a cache's zeros come from torch's allocator: a mapping of its own would be a page at least.
ZERO_PAGES_MIN_BYTES = 1 << 20


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor for a cache. On the CPU a large one is fresh anonymous memory, which the OS maps as zeros and
    backs only when first written: an engine's KV pool (1 GiB by default) costs no time to build and no memory
    until its blocks are used, where `torch.zeros` wrote every byte (docs/design-notes.md, "layers/kv_cache.py")."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count * dtype.itemsize < ZERO_PAGES_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, count * dtype.itemsize)  # the tensor keeps the mapping alive; it is unmapped with it
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


class KVCache:
    """Self-attention keys and values preallocated to `max_len`: (B, Hkv, max_len, D) each.

    Position p of row b lives in slot p; a position of -1 marks a padding query whose entry is dropped.
    With a sliding `window` shorter than max_len the cache is a rolling buffer of `window` slots: position p lives
    in slot p % window, and `update` returns only the keys the new tokens can see (see `first_visible`).
    """

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        window: int | None = None,
    ) -> None:
        self.window = window if window is not None and window < max_len else None
        shape = (batch_size, n_kv_heads, max_len if self.window is None else self.window, head_dim)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)

    def first_visible(self, start: int) -> int:
        """The first position `update` returns for new tokens from `start` on: 0, or the window's first key."""
        return 0 if self.window is None else max(0, start - self.window + 1)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, Hkv, T, D) at `positions` (B|1, T); returns the entries up to the largest position
        (from `first_visible` on, for a rolling buffer)."""
        if self.window is not None:
            return self._roll(positions, k, v)
        end = int(positions.max()) + 1
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; cannot write position {end - 1}")
        T = k.shape[2]
        start = int(positions[0, 0])
        if positions.shape[0] == 1 and torch.equal(positions[0], torch.arange(start, start + T, device=k.device)):
            self.k[:, :, start : start + T] = k
            self.v[:, :, start : start + T] = v
        else:
            positions = positions.expand(k.shape[0], T)
            keep = positions >= 0  # (B, T)
            rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(positions)
            self.k[rows[keep], :, positions[keep]] = k.transpose(1, 2)[keep]  # (N, Hkv, D)
            self.v[rows[keep], :, positions[keep]] = v.transpose(1, 2)[keep]
        return self.k[:, :, :end], self.v[:, :, :end]

    def _roll(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rolling buffer: the window's earlier keys then the new ones, and the newest `window` kept."""
        if positions.shape[0] != 1 or int(positions.min()) < 0:
            raise ValueError(
                "a rolling KV cache takes one run of positions shared by every row (batched decoding from one "
                "start); build the cache with rolling=False for rows at different positions"
            )
        start, n_new, window = int(positions[0, 0]), k.shape[2], self.window
        earlier = torch.arange(self.first_visible(start), start, device=k.device) % window
        keys = torch.cat([self.k[:, :, earlier], k], dim=2)
        values = torch.cat([self.v[:, :, earlier], v], dim=2)
        kept = min(n_new, window)
        slots = torch.arange(start + n_new - kept, start + n_new, device=k.device) % window
        self.k[:, :, slots] = k[:, :, n_new - kept :]
        self.v[:, :, slots] = v[:, :, n_new - kept :]
        return keys, values

    def reorder(self, index: torch.Tensor, length: int | None = None) -> None:
        """Row i takes the cache of row `index[i]` (beam search: each surviving hypothesis its parent's); rows past
        len(index) leave the batch.

        Only rows whose source differs are copied, in place: a beam that continues its own row copies nothing, and
        a batch that drops rows keeps the first len(index) rows of the same tensors. With `length`, only the first
        `length` positions are copied (the rest is not written yet).
        """
        if len(index) > self.k.shape[0]:  # a growing batch (a prompt's cache copied to its beams) needs new tensors
            self.k, self.v = self.k[index], self.v[index]
            return
        length = self.k.shape[2] if length is None else min(length, self.k.shape[2])  # a rolling buffer: its window
        moved = (index != torch.arange(len(index), device=index.device)).nonzero()[:, 0]
        if len(moved):
            source = index[moved]
            for cache in (self.k, self.v):  # gathered before the write, so a row may be read and overwritten at once
                written = cache[:, :, :length]  # index_select / index_copy_ copy whole rows, faster than indexing
                written.index_copy_(0, moved, written.index_select(0, source))
        self.k, self.v = self.k[: len(index)], self.v[: len(index)]


@dataclass
class CrossKV:
    """Cross-attention keys and values of the encoder memory, projected once per request.

    With `beams` > 1 (beam search) the keys and values are held once per source (B, Hkv, S, D) while the decoder's
    batch holds B * beams rows, b * beams + k for beam k of source b: a source's beams attend as that many queries
    over its keys, which are never repeated or reordered. `mask` is then the memory's padding rule (B, S), built once
    per batch, which replaces the one the decoder builds each step.
    """

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    beams: int = 1
    mask: AttentionMask | None = None

    def reorder(self, index: torch.Tensor) -> None:
        """Keeps the rows of the decoder's batch that `index` names (beam rows, as KVCache.reorder): the keys of
        their sources. Beams only ever continue beams of their own source, so with `beams` > 1 the index selects
        whole sources, each the source of its first beam."""
        if self.k is None:
            return
        if self.beams > 1:
            index = index[:: self.beams] // self.beams
        if self.mask is not None:
            bias, padding = self.mask.bias, self.mask.key_padding
            self.mask = dataclasses.replace(
                self.mask,
                bias=None if bias is None or bias.shape[0] == 1 else bias[index],
                key_padding=None if padding is None else padding[index],
            )
        self.k, self.v = self.k[index], self.v[index]


class SelfAttentionCache(Protocol):
    """Anything a self-attention layer can read and write its keys and values through.

    A cache may also attend by itself: when its `attends_in_place` is true (the engine's paged cache in a decode
    step, or in a packed step whose one row holds several sequences' tokens), `attend_in_place(positions, q, k, v)`
    writes k and v and returns causal attention of the queries q (B, H, T, D), each over its own sequence's keys up
    to its position, without copying the keys out. Only plain softmax attention may take it
    (`Attention.attends_in_cache`).
    """

    def update(
        self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class LayerCache:
    """What one decoder block keeps between decoding steps."""

    self_attn: SelfAttentionCache
    cross_attn: CrossKV = field(default_factory=CrossKV)

    def reorder(self, index: torch.Tensor) -> None:
        self.self_attn.reorder(index)  # type: ignore[attr-defined]  # only the contiguous cache reorders
        self.cross_attn.reorder(index)
