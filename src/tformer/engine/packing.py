"""Packed prompt steps: every prompt chunk of an engine step in one row of tokens, each attending to its own keys.

A step otherwise pads its prompt chunks into (B, T) batches, and each batch is one forward with a cost of its own
whatever its width: every layer's weights read once and some 40 eager ops a layer, so a narrow forward costs much of a
wide one, and grouping by width (`group_by_width`) still pads (docs/design-notes.md, "engine/packing.py"). Packing puts
a step's chunks side by side in one (1, N) row with no padding: embeddings, projections, norms and the MLP treat every
token alike, so they run once over N tokens, and only attention must tell the sequences apart. The cache can, since it
knows each sequence's blocks: `PackedLayerKV.attend_in_place` writes the row's keys and values, then runs causal
attention per sequence (a `Segment`), over its own new keys, or over the keys it has cached before them as well.

Packing holds for decoders whose every self-attention layer attends plainly (`Attention.attends_plainly`): no
sliding window, position bias (ALiBi), other attention or state carried along the row (`DecoderRunner.packs`).
In bf16 on the CPU a sequence's attention takes tformer's causal kernel (`causal_attention`), elsewhere torch's
SDPA with the mask `build_mask` makes for its shape; in fp32 each sequence thus attends exactly as the uncached
forward of that sequence alone does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tformer.engine.paged import LayerTensors, PagedKVCache, PagedLayerKV
from tformer.kernels.causal_attention import causal_attention
from tformer.layers.attention import sdpa_attention
from tformer.layers.masks import build_mask


@dataclass
class Segment:
    """One sequence's chunk in a packed row: columns offset .. offset + length - 1, at positions start .. start +
    length - 1. `read_slots` (start + length,): where all its keys lie, when it continues after cached tokens; None
    when it starts at position 0, whose keys are exactly its new tokens'."""

    offset: int
    length: int
    read_slots: torch.Tensor | None = None


class PackedLayerKV(PagedLayerKV):
    """One layer's window on the paged cache during a packed step: the row's sequences attend here, each to its own
    keys (`attend_in_place`); `update`, which would hand one row's keys to a mask that cannot tell the sequences
    apart, refuses."""

    def __init__(self, layer: LayerTensors, write_slots: torch.Tensor, segments: list[Segment]) -> None:
        super().__init__(layer, write_slots, None, write_slots[None])
        self.segments = segments

    @property
    def attends_in_place(self) -> bool:
        return True

    @property
    def key_count(self) -> int:
        """The row's width: the stack builds a causal mask over the row's N columns, which no layer reads."""
        return self.write_slots.shape[0]

    def attend_in_place(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Writes k, v (1, Hkv, N, D), then returns each sequence's causal attention over its keys: (1, H, N, D)."""
        new_keys, new_values = self.write(k, v, read_back=True)  # (1, Hkv, N, D): the row's, as the cache holds them
        dtype = self.layer.dtype
        outputs = []
        for segment in self.segments:
            columns = slice(segment.offset, segment.offset + segment.length)
            if segment.read_slots is None:  # the keys just computed
                keys, values = new_keys[:, :, columns], new_values[:, :, columns]
            else:
                # (1, Hkv, start + length, D) each
                keys, values = (t.transpose(0, 1)[None] for t in self.layer.read(segment.read_slots))
            queries = q[:, :, columns].to(dtype)
            out = causal_attention(queries, keys, values)  # bf16 on the CPU; None elsewhere
            if out is None:
                mask = build_mask(
                    n_queries=segment.length, n_keys=keys.shape[2], causal=True, dtype=dtype, device=q.device
                )
                out = sdpa_attention(queries, keys, values, mask, 0.0)[0]
            outputs.append(out)
        return torch.cat(outputs, dim=2).to(q.dtype)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(
            "a packed engine step holds several sequences in one row, so every self-attention layer must attend in "
            "the cache (Attention.attends_in_cache); this one does not (kept attention weights, another backend, "
            "a position bias?): run the engine with EngineConfig(pack_prompts=False)"
        )


def packed_views(
    kv: PagedKVCache, tables: list[list[int]], starts: list[int], lengths: list[int]
) -> list[PackedLayerKV]:
    """Every layer's view of a packed step: sequence i's `lengths[i]` tokens from position `starts[i]` through its
    block table `tables[i]`, side by side in one row."""
    device = kv.k[0].device
    table = kv.block_table(tables, device)
    segments, write_slots, offset = [], [], 0
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        slots = kv.slots(table[row : row + 1], torch.arange(start + length, device=device)[None])[0]
        write_slots.append(slots[start:])
        segments.append(Segment(offset, length, slots if start else None))
        offset += length
    slots = torch.cat(write_slots)
    return [PackedLayerKV(layer, slots, segments) for layer in kv.layers]
