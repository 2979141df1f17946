"""The paged KV cache's tensors (vLLM's PagedAttention): every layer's keys and values in fixed-size blocks.

- `PagedKVCache` owns the tensors: per layer, keys and values of shape (num_blocks * block_size, Hkv, D) in a
  `LayerTensors`. A sequence's block table (`blocks.BlockAllocator`) maps its position p to slot
  table[p // block_size] * block_size + p % block_size.
- `PagedLayerKV` is what one attention layer sees during one engine step: it writes the new keys and values
  through the slot mapping and reads every sequence's keys back through its block table, or attends in place.

With `kv_cache_dtype="int8"` (llama.cpp's q8_0 cache type, vLLM's `--kv-cache-dtype`) each slot's key and value
of each KV head are stored as head_dim int8 numbers and one float32 scale, their largest magnitude over 127: a
SmolLM2 token's keys and values take 408 bytes a layer instead of 768 in bf16, so the same pool holds 1.88x the
tokens, and a decode step reads about half the bytes. Every attention then sees the rounded keys and values (the
ones just computed too, so that a prompt's tokens attend as they will be read back); see docs/engine.md for the
perplexity this costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tformer.engine.blocks import BlockCopy
from tformer.kernels.kv_int8 import SCALE_BYTES, dequantize_int8, quantize_int8, read_rounded, store_rounded
from tformer.kernels.paged_attention import paged_decode_attention, supports
from tformer.layers.kv_cache import zeroed
from tformer.models import TransformerModel

KV_CACHE_DTYPES = ("auto", "int8")  # "auto": the model's own dtype (its embedding's)


@dataclass
class LayerTensors:
    """One layer's keys and values in the pool, (slots, Hkv, D); in an int8 cache beside them one float32 scale per
    (slot, KV head) each (`k_scale`, `v_scale`). `dtype` is the attention's: what reading the cache gives."""

    k: torch.Tensor
    v: torch.Tensor
    dtype: torch.dtype
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys or values x (..., D) as the pool holds them: in its dtype and no scales, or int8 numbers and scales."""
        return quantize_int8(x) if self.quantized else (x.to(self.dtype), None)

    def decode(self, stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """What `encode` gave, as reading it back gives it: in the attention's dtype."""
        return stored if scale is None else dequantize_int8(stored, scale, self.dtype)

    def store(
        self,
        slots: torch.Tensor,
        k: torch.Tensor,
        k_scale: torch.Tensor | None,
        v: torch.Tensor,
        v_scale: torch.Tensor | None,
    ) -> None:
        """Puts encoded keys and values (N, Hkv, D), and their scales (N, Hkv) in an int8 cache, at `slots` (N,)."""
        for into, rows in ((self.k, k), (self.v, v), (self.k_scale, k_scale), (self.v_scale, v_scale)):
            if into is not None:
                into.index_copy_(0, slots, rows)

    def store_rounded(
        self, token_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An int8 cache's write of k, v (B, Hkv, T, D) at `token_slots` (B * T,; -1: padding) in one kernel pass
        each (`kv_int8.store_rounded`); returns them as stored, (B, Hkv, T, D). None (nothing written) for a cache
        in floating point, other dtypes or where the kernel does not apply."""
        if not self.quantized or k.dtype != self.dtype or v.dtype != self.dtype:
            return None
        keys = store_rounded(k, token_slots, self.k, self.k_scale)
        if keys is None:
            return None
        values = store_rounded(v, token_slots, self.v, self.v_scale)
        assert values is not None, "the kernel served the keys, so it serves the values"
        return keys, values

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values stored at `slots` (any shape): (*slots.shape, Hkv, D) each, in `dtype`."""
        if not self.quantized:
            return self.k[slots], self.v[slots]
        keys = read_rounded(self.k, self.k_scale, slots, self.dtype)
        if keys is not None:
            return keys, read_rounded(self.v, self.v_scale, slots, self.dtype)
        return self.decode(self.k[slots], self.k_scale[slots]), self.decode(self.v[slots], self.v_scale[slots])

    def copy_slots(self, dst: slice, src: slice) -> None:
        for tensor in self.tensors:
            tensor[dst] = tensor[src]


class PagedKVCache:
    """The KV tensors of every layer, in blocks: (num_blocks * block_size, Hkv, D) for keys and for values, in
    `dtype`, or with `kv_cache_dtype="int8"` as int8 numbers and scales that read back as `dtype`."""

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
        kv_cache_dtype: str = "auto",
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.block_size = block_size
        self.window = window  # a sliding window: each row reads only the keys its queries can see
        self.dtype = dtype
        store = torch.int8 if kv_cache_dtype == "int8" else dtype

        def layer() -> LayerTensors:
            keys, values = zeroed(shape, store, device), zeroed(shape, store, device)
            if kv_cache_dtype != "int8":
                return LayerTensors(keys, values, dtype)
            return LayerTensors(
                keys, values, dtype, zeroed(shape[:2], torch.float32, device), zeroed(shape[:2], torch.float32, device)
            )

        self.layers = [layer() for _ in range(n_layers)]

    @property
    def k(self) -> list[torch.Tensor]:
        """Every layer's keys (in an int8 cache, their int8 numbers)."""
        return [layer.k for layer in self.layers]

    @property
    def v(self) -> list[torch.Tensor]:
        return [layer.v for layer in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        bs = self.block_size
        for copy in copies:
            for layer in self.layers:
                layer.copy_slots(slice(copy.dst * bs, (copy.dst + 1) * bs), slice(copy.src * bs, (copy.src + 1) * bs))

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
        token_slots = self.slots(table, positions).reshape(-1)  # -1 for padding
        write_slots, keep = token_slots, None
        decode = positions.shape[1] == 1  # one token a row: no padding to drop
        if not decode:
            keep = write_slots >= 0
            if bool(keep.all()):  # no padding: no row selection in every layer
                keep = None
            else:
                write_slots = write_slots[keep]
        key_lengths = None  # a decode step: each row reads keys 0..position in place (paged_decode_attention)
        if decode and key_starts is None and supports(self.dtype, positions.device):
            key_lengths = positions[:, 0] + 1
        # Whole prompts (every row from position 0, no window): a row's keys are exactly its new tokens'.
        whole_prompts = not decode and key_starts is None and not bool(positions[:, 0].any())
        return [
            PagedLayerKV(layer, write_slots, keep, read_slots, key_starts, key_lengths, whole_prompts, token_slots)
            for layer in self.layers
        ]


class PagedLayerKV:
    """One layer's window on the paged cache during one step (the `update(positions, k, v)` protocol)."""

    def __init__(
        self,
        layer: LayerTensors,
        write_slots: torch.Tensor,
        keep: torch.Tensor | None,
        read_slots: torch.Tensor,
        key_starts: torch.Tensor | None = None,
        key_lengths: torch.Tensor | None = None,
        whole_prompts: bool = False,
        token_slots: torch.Tensor | None = None,
    ) -> None:
        self.layer = layer
        self.write_slots, self.keep, self.read_slots = write_slots, keep, read_slots
        # every token's slot, -1 for padding (write_slots without `keep` applied)
        self.token_slots = write_slots if token_slots is None else token_slots
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

    def write(
        self, k: torch.Tensor, v: torch.Tensor, read_back: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Writes k, v (B, Hkv, T, D) of the real tokens into their slots, each encoded once; with `read_back`,
        returns k and v as the cache holds them, (B, Hkv, T, D) (padding columns alike: they are never read)."""
        stored = self.layer.store_rounded(self.token_slots, k, v)  # an int8 cache's one-pass kernel, where it applies
        if stored is not None:
            return stored if read_back else None
        encoded = [*self.layer.encode(k), *self.layer.encode(v)]  # k, its scales, v, its scales
        rows = [None if t is None else t.transpose(1, 2).flatten(0, 1) for t in encoded]  # (B * T, Hkv, ...)
        if self.keep is not None:  # drop the padding
            rows = [None if t is None else t[self.keep] for t in rows]
        self.layer.store(self.write_slots, *rows)
        return (self.layer.decode(*encoded[:2]), self.layer.decode(*encoded[2:])) if read_back else None

    def attend_in_place(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Writes k, v, then returns causal attention of the single queries q (B, H, 1, D) over each row's keys,
        read where they lie (`paged_decode_attention`): (B, H, 1, D)."""
        assert self.key_lengths is not None, "attend_in_place serves decode steps only (see attends_in_place)"
        self.write(k, v)
        layer = self.layer
        scales = (layer.k_scale, layer.v_scale) if layer.quantized else ()
        return paged_decode_attention(q.to(layer.dtype), layer.k, layer.v, self.read_slots, self.key_lengths, *scales)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, Hkv, T, D) of the real tokens, returns every row's keys and values (B, Hkv, Tk, D)."""
        written = self.write(k, v, read_back=self.whole_prompts)
        if written is not None:  # whole prompts: the keys just written, as the cache holds them
            return written
        keys, values = self.layer.read(self.read_slots)  # (B, Tk, Hkv, D)
        return keys.transpose(1, 2), values.transpose(1, 2)


def kv_bytes_per_token(model: TransformerModel, kv_cache_dtype: str = "auto") -> int:
    """Bytes of keys and values one token takes in the decoder's cache, every layer (with int8, their scales too)."""
    mc = model.config
    element = model.decoder.tokens.weight.element_size()  # the embedding stays in floating point when quantized
    per_head = mc.head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else mc.head_dim * element  # numbers, scale
    return mc.n_kv_heads * per_head * 2 * mc.n_decoder_layers


def paged_cache_for(
    model: TransformerModel, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto"
) -> PagedKVCache:
    """A pool of `num_blocks` blocks shaped for the model's decoder, in its embedding's dtype and device (int8
    numbers that read back in that dtype with `kv_cache_dtype="int8"`)."""
    mc, weight = model.config, model.decoder.tokens.weight
    return PagedKVCache(
        mc.n_decoder_layers,
        num_blocks,
        block_size,
        mc.n_kv_heads,
        mc.head_dim,
        weight.dtype,
        weight.device,
        window=mc.shared_window,  # mixed layers (Gemma) read every key; each layer's mask keeps its window
        kv_cache_dtype=kv_cache_dtype,
    )
