"""KV block bookkeeping (vLLM's block pool), on the CPU and without tensors: which blocks each sequence holds.

- `BlockPool` owns the free list, the reference counts and the prefix cache (full blocks keyed by a `BlockHash`
  of their tokens and the key of the block before them, each block hashed once).
- `BlockAllocator` keeps block tables on top of it: a sequence's position p lives in block table[p // block_size],
  slot p % block_size of it; growth, prefix hits, forks and copy-on-write.

Blocks are shared by reference count: prefix-cache hits and forked sequences (parallel samples, beams) point
at the same block, and a write into a shared block first copies it (copy-on-write, a `BlockCopy` the engine
applies to the tensors in `paged.PagedKVCache`).

Under a sliding window of W tokens, a block whose positions all lie more than W - 1 before the next token is
never read again: `release_before` returns it to the pool and leaves FREED in its table entry, so a sequence
holds about W / block_size blocks however long it grows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

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
