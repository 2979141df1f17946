"""The paged KV cache (vLLM's PagedAttention): fixed-size blocks, a pool with reference counts, block tables.

Bookkeeping and storage are separate:
- `BlockPool` owns the free list, the reference counts and the prefix cache (full blocks keyed by a `BlockHash`
  of their tokens and the key of the block before them, each block hashed once), on the CPU, with no tensors.
- `PagedKVCache` owns the tensors: per layer, keys and values of shape (num_blocks * block_size, Hkv, D).
  A sequence's block table maps its position p to slot table[p // block_size] * block_size + p % block_size.
- `PagedLayerKV` is what one attention layer sees during one engine step: it writes the new keys and values
  through the slot mapping and reads every sequence's keys back through its block table.

Blocks are shared by reference count: prefix-cache hits and forked sequences (parallel samples, beams) point
at the same block, and a write into a shared block first copies it (copy-on-write).

Under a sliding window of W tokens, a block whose positions all lie more than W - 1 before the next token is
never read again: `release_before` returns it to the pool and leaves FREED in its table entry, so a sequence
holds about W / block_size blocks however long it grows, and each step reads only its rows' windows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from tformer.inference.paged_attention import paged_decode_attention, supports
from tformer.layers.kv_cache import zeroed
from tformer.models import TransformerModel

FREED = -1  # a block table entry whose block went back to the pool (it fell out of the sliding window)


class BlockHash:
    """The prefix-cache key of one full block: its token ids and the key of the block before it (vLLM's block hash).

    The hash is computed once, from the parent's hash and this block's tokens, so hashing a block costs its
    block_size tokens whatever its depth. Equality still compares the whole chain, so two different prefixes never
    share a key even when their hashes collide; it stops at the first shared parent object, and the pool hands
    out its own key objects (`BlockPool.canonical`), so a lookup usually compares one block of tokens.
    """

    __slots__ = ("parent", "tokens", "value")

    def __init__(self, parent: BlockHash | None, tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.tokens = tokens
        self.value = hash((None if parent is None else parent.value, tokens))

    def __hash__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        a: BlockHash | None = self
        b = other
        while a is not b:  # iterative: a chain may be thousands of blocks deep
            if not isinstance(b, BlockHash) or a is None or a.value != b.value or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True


class NoFreeBlocks(RuntimeError):
    """The pool is exhausted; the scheduler preempts a request and retries."""


class BlockPool:
    """`num_blocks` KV blocks: a free list in least-recently-freed order, reference counts, a prefix cache.

    A block whose count drops to 0 goes to the back of the free list but keeps its prefix-cache key, so a
    later request with the same prefix can take it back until it is reallocated (LRU eviction).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.key_of: dict[int, BlockHash] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        """A fresh block with count 1; evicts the least recently freed cached block if need be."""
        if not self.free:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self.free.popitem(last=False)
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.cached[key]
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more owner of `block` (a fork or a prefix-cache hit); takes it off the free list if it was there."""
        if self.ref_counts[block] == 0:
            self.free.pop(block)
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} released more often than it was allocated")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None

    def lookup(self, key: BlockHash) -> int | None:
        """The cached block holding exactly this prefix, if any (without taking a reference)."""
        return self.cached.get(key)

    def canonical(self, key: BlockHash) -> BlockHash:
        """The pool's own key object equal to `key`, if it caches that prefix, else `key` itself."""
        block = self.cached.get(key)
        return key if block is None else self.key_of[block]

    def register(self, block: int, key: BlockHash) -> BlockHash:
        """Marks a full block as reusable by any sequence that starts with the same tokens; returns the key the
        cache holds for this prefix (an earlier equal key, or this one)."""
        known = self.cached.get(key)
        if known is not None:
            return self.key_of[known]
        if block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = key
        return key


@dataclass
class BlockCopy:
    """Copy-on-write: the engine copies block `src` to `dst` in every layer before the step runs."""

    src: int
    dst: int


class BlockAllocator:
    """Block tables on top of a `BlockPool`: growth, prefix hits, forks and copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    def blocks_needed(self, table: list[int], n_tokens: int) -> int:
        return max(0, -(-n_tokens // self.block_size) - len(table))

    def can_write(self, table: list[int], start: int, end: int) -> bool:
        """Whether the free blocks cover writing positions start..end-1: the blocks the table must grow by, and a
        copy of every shared block (a fork's or a beam's) that the write touches."""
        first, last = start // self.block_size, min(len(table), -(-end // self.block_size))
        shared = sum(table[i] != FREED and self.pool.ref_counts[table[i]] > 1 for i in range(first, last))
        return self.blocks_needed(table, end) + shared <= self.pool.num_free

    def grow(self, table: list[int], n_tokens: int) -> None:
        """Appends blocks so that `table` covers n_tokens positions; raises NoFreeBlocks (changing nothing)."""
        needed = self.blocks_needed(table, n_tokens)
        if needed > self.pool.num_free:
            raise NoFreeBlocks(f"need {needed} more KV blocks, {self.pool.num_free} are free")
        table.extend(self.pool.allocate() for _ in range(needed))

    def free(self, table: list[int]) -> None:
        for block in reversed(table):  # tail blocks first: they are evicted before the likelier-shared prefix
            if block != FREED:
                self.pool.release(block)
        table.clear()

    def release_before(self, table: list[int], position: int) -> None:
        """Returns to the pool every block whose positions all lie before `position` (outside a sliding window)."""
        for index in range(min(len(table), position // self.block_size)):
            if table[index] != FREED:
                self.pool.release(table[index])
                table[index] = FREED

    def fork(self, table: list[int]) -> list[int]:
        """A new table sharing every block of `table` (parallel samples and beams)."""
        return [block if block == FREED else self.pool.share(block) for block in table]

    def copy_on_write(self, table: list[int], start: int, end: int) -> list[BlockCopy]:
        """Before writing positions start..end-1: gives `table` its own copy of every shared block they touch."""
        copies = []
        for index in range(start // self.block_size, -(-end // self.block_size)):
            block = table[index]
            if self.pool.ref_counts[block] > 1:
                new = self.pool.allocate()
                self.pool.release(block)
                table[index] = new
                copies.append(BlockCopy(block, new))
        return copies

    def match_prefix(self, tokens: list[int], max_blocks: int, hashes: list[BlockHash] | None = None) -> list[int]:
        """Takes a reference on the cached blocks that hold the longest prefix of `tokens` (at most max_blocks).

        `hashes`, a sequence's keys of its published blocks (empty: it holds no blocks yet), receives their keys.
        """
        hashes = [] if hashes is None else hashes
        blocks: list[int] = []
        for i in range(max_blocks):
            key = BlockHash(
                hashes[-1] if hashes else None, tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            )
            block = self.pool.lookup(key)
            if block is None:
                break
            hashes.append(self.pool.key_of[block])
            blocks.append(self.pool.share(block))
        return blocks

    def register_prefix(
        self, table: list[int], tokens: list[int], n_computed: int, hashes: list[BlockHash] | None = None
    ) -> None:
        """Publishes the full blocks among the first n_computed positions for later prefix hits.

        `hashes` holds the keys of the sequence's blocks published before: only the blocks after them are hashed,
        each once in the sequence's life. A block the pool already keys (a fork's or a prefix hit's) keeps its key
        unhashed. A FREED entry (out of the sliding window) is hashed, as the next key needs it, but not published.
        """
        hashes = [] if hashes is None else hashes
        size = self.block_size
        for i in range(len(hashes), n_computed // size):
            known = self.pool.key_of.get(table[i])
            if known is not None:
                hashes.append(known)
                continue
            key = BlockHash(hashes[-1] if hashes else None, tuple(tokens[i * size : (i + 1) * size]))
            hashes.append(self.pool.canonical(key) if table[i] == FREED else self.pool.register(table[i], key))


class PagedKVCache:
    """The KV tensors of every layer, in blocks: (num_blocks * block_size, Hkv, D) for keys and for values."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window: int | None = None,
    ) -> None:
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.block_size = block_size
        self.window = window  # a sliding window: each row reads only the keys its queries can see
        self.k = [zeroed(shape, dtype, device) for _ in range(n_layers)]
        self.v = [zeroed(shape, dtype, device) for _ in range(n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        bs = self.block_size
        for copy in copies:
            for layer_k, layer_v in zip(self.k, self.v, strict=True):
                layer_k[copy.dst * bs : (copy.dst + 1) * bs] = layer_k[copy.src * bs : (copy.src + 1) * bs]
                layer_v[copy.dst * bs : (copy.dst + 1) * bs] = layer_v[copy.src * bs : (copy.src + 1) * bs]

    @staticmethod
    def block_table(tables: list[list[int]], device: torch.device) -> torch.Tensor:
        """The rows' block tables as one (B, widest) tensor, padded with block 0; a FREED block reads as block 0 too
        (it is never read unmasked: any block will do)."""
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).clamp(min=0).to(device)

    def slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Physical slots (B, T) of logical positions (B, T) through `block_table`'s rows; -1 stays -1."""
        valid = positions >= 0
        pos = positions.clamp(min=0)
        block_index = (pos // self.block_size).clamp(max=table.shape[1] - 1)
        slots = table.gather(1, block_index) * self.block_size + pos % self.block_size
        return slots.masked_fill(~valid, -1)

    def step_views(self, tables: list[list[int]], positions: torch.Tensor) -> list[PagedLayerKV]:
        """What each layer reads and writes in one step: new tokens at `positions` (B, T), -1 for padding.

        Every row reads n_keys keys, from position 0 (n_keys is the batch's largest position plus one), or under a
        sliding window from its first query's window start (n_keys then spans the widest row's window and new
        tokens). Positions a row has not reached yet are masked by causality, those before its window by the window.
        """
        table, key_starts = self.block_table(tables, positions.device), None
        if self.window is None:  # every row reads positions 0 .. n_keys - 1: its blocks' slots in order
            n_keys = int(positions.max()) + 1
            keys = torch.arange(n_keys, device=positions.device)
            read_slots = table[:, keys // self.block_size] * self.block_size + keys % self.block_size  # (B, n_keys)
        else:
            first = torch.where(positions >= 0, positions, positions.max()).min(dim=1).values  # (B,)
            key_starts = (first - self.window + 1).clamp(min=0)[:, None]  # (B, 1)
            n_keys = int((positions.max(dim=1, keepdim=True).values + 1 - key_starts).max())
            read_slots = self.slots(table, key_starts + torch.arange(n_keys, device=positions.device))  # (B, n_keys)
        write_slots, keep = self.slots(table, positions).reshape(-1), None
        decode = positions.shape[1] == 1  # one token a row: no padding to drop
        if not decode:
            keep = write_slots >= 0
            if bool(keep.all()):  # no padding: no row selection in every layer
                keep = None
            else:
                write_slots = write_slots[keep]
        key_lengths = None  # a decode step: each row reads keys 0..position in place (paged_decode_attention)
        if decode and key_starts is None and supports(self.k[0].dtype, positions.device):
            key_lengths = positions[:, 0] + 1
        # Whole prompts (every row from position 0, no window): a row's keys are exactly its new tokens'.
        whole_prompts = not decode and key_starts is None and not bool(positions[:, 0].any())
        return [
            PagedLayerKV(k, v, write_slots, keep, read_slots, key_starts, key_lengths, whole_prompts)
            for k, v in zip(self.k, self.v, strict=True)
        ]


class PagedLayerKV:
    """One layer's window on the paged cache during one step (the `update(positions, k, v)` protocol)."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        write_slots: torch.Tensor,
        keep: torch.Tensor | None,
        read_slots: torch.Tensor,
        key_starts: torch.Tensor | None = None,
        key_lengths: torch.Tensor | None = None,
        whole_prompts: bool = False,
    ) -> None:
        self.k, self.v = k, v
        self.write_slots, self.keep, self.read_slots = write_slots, keep, read_slots
        self.key_starts = key_starts  # (B, 1) each row's first key position under a sliding window, else None
        self.key_lengths = key_lengths  # (B,) keys each row reads in a decode step, when it attends in place
        self.whole_prompts = whole_prompts  # every row's keys are its new tokens: `update` reads nothing back

    @property
    def attends_in_place(self) -> bool:
        """Whether `attend_in_place` serves this step (single queries, no window, a dtype the kernel takes)."""
        return self.key_lengths is not None

    @property
    def key_count(self) -> int:
        """Keys every row reads this step (the batch's largest position plus one, or its widest window)."""
        return self.read_slots.shape[1]

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes k, v (B, Hkv, T, D) of the real tokens into their slots."""
        B, H, T, D = k.shape
        new_k = k.transpose(1, 2).reshape(B * T, H, D)
        new_v = v.transpose(1, 2).reshape(B * T, H, D)
        if self.keep is not None:  # drop the padding
            new_k, new_v = new_k[self.keep], new_v[self.keep]
        self.k.index_copy_(0, self.write_slots, new_k.to(self.k.dtype))
        self.v.index_copy_(0, self.write_slots, new_v.to(self.v.dtype))

    def attend_in_place(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Writes k, v, then returns causal attention of the single queries q (B, H, 1, D) over each row's keys,
        read where they lie (`paged_decode_attention`): (B, H, 1, D)."""
        assert self.key_lengths is not None, "attend_in_place serves decode steps only (see attends_in_place)"
        self.write(k, v)
        return paged_decode_attention(q.to(self.k.dtype), self.k, self.v, self.read_slots, self.key_lengths)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, Hkv, T, D) of the real tokens, returns every row's keys and values (B, Hkv, Tk, D)."""
        self.write(k, v)
        if self.whole_prompts:  # the keys just written, as the cache holds them (a padding column is never seen)
            return k.to(self.k.dtype), v.to(self.v.dtype)
        keys = self.k[self.read_slots]  # (B, Tk, Hkv, D)
        values = self.v[self.read_slots]
        return keys.transpose(1, 2), values.transpose(1, 2)


def kv_bytes_per_token(model: TransformerModel) -> int:
    """Bytes of keys and values one token takes in the decoder's cache, every layer."""
    mc = model.config
    element = model.decoder.tokens.weight.element_size()  # the embedding stays in floating point when quantized
    return mc.n_kv_heads * mc.head_dim * 2 * mc.n_decoder_layers * element


def paged_cache_for(model: TransformerModel, num_blocks: int, block_size: int) -> PagedKVCache:
    """A pool of `num_blocks` blocks shaped for the model's decoder, in its embedding's dtype and device."""
    mc, weight = model.config, model.decoder.tokens.weight
    return PagedKVCache(
        mc.n_decoder_layers,
        num_blocks,
        block_size,
        mc.n_kv_heads,
        mc.head_dim,
        weight.dtype,
        weight.device,
        window=mc.sliding_window,
    )
