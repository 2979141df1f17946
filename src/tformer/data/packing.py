"""Packing: a causal LM trained on fixed-length blocks of the concatenated corpus (nanoGPT's token stream, Hugging
Face's `group_texts`), instead of one sequence per example.

One verse per example gives the model at most a verse of context and many short rows. Packing writes every
sequence as ``<s> x </s>`` into one stream and cuts it into blocks of ``block_size + 1`` tokens that overlap by one
token: a block's inputs are ``block[:-1]`` and its labels ``block[1:]``, so the inputs of consecutive blocks tile
the stream exactly once, in order, and every label is the token that follows its input. Labels that are ``<s>``
(the start of the next sequence, which always follows ``</s>``) take no loss, so a packed run is scored on the same
targets as `causal_lm` is: each x and its ``</s>``. As in nanoGPT and `group_texts`, attention is not cut at
sequence boundaries: a verse sees the verses before it in its block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tformer.data.batching import IGNORE_INDEX, TokenIds, pad_sequences
from tformer.data.objectives import LMBatch, Vocab
from tformer.data.readers import DataError


def token_stream(seqs: Sequence[TokenIds], bos_id: int, eos_id: int) -> list[int]:
    """The sequences as one stream, each written ``<s> x </s>``."""
    stream: list[int] = []
    for seq in seqs:
        stream += [bos_id, *seq, eos_id]
    return stream


def pack_sequences(seqs: Sequence[TokenIds], block_size: int, bos_id: int, eos_id: int) -> list[list[int]]:
    """Blocks of ``block_size + 1`` tokens of `token_stream`, each starting on the last token of the one before
    (the last block may be shorter); `packed_causal_lm` turns a list of them into a batch."""
    if block_size < 1:
        raise DataError(f"block_size must be at least 1, got {block_size}")
    stream = token_stream(seqs, bos_id, eos_id)
    if len(stream) < 2:
        raise DataError("nothing to pack: the sequences hold no tokens")
    return [stream[start : start + block_size + 1] for start in range(0, len(stream) - 1, block_size)]


def packed_causal_lm(blocks: Sequence[TokenIds], vocab: Vocab, generator: torch.Generator | None = None) -> LMBatch:
    """Next-token prediction on packed blocks: inputs ``block[:-1]``, labels ``block[1:]`` with <s> ignored
    (no randomness; `generator` is taken so that the trainer calls every objective the same way)."""
    input_ids, mask = pad_sequences([block[:-1] for block in blocks], vocab.pad_id)
    labels = torch.full(input_ids.shape, IGNORE_INDEX, dtype=torch.long)
    for row, block in enumerate(blocks):
        targets = torch.as_tensor(list(block[1:]), dtype=torch.long)
        labels[row, : len(targets)] = targets.masked_fill(targets == vocab.bos_id, IGNORE_INDEX)
    return LMBatch(input_ids, mask, labels)
