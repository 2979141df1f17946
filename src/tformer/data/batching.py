"""Token-budget batches grouped by length (fairseq's --max-tokens), and collation into padded tensors.

The 2017 recipe (seed 000, "Training Setup"): group sentences by approximate length so that little compute
goes to padding, and still shuffle so that consecutive batches are not homogeneous. Each epoch:

1. permute the examples with a generator seeded by (seed, epoch), then stable-sort them by length, so
   examples of equal length come in a new random order each epoch (fairseq does the same);
2. cut the sorted list greedily into batches whose padded size, ``n_sentences * max_length``, stays within
   `max_tokens` (for translation the length of an example is ``max(len(src), len(tgt)) + 1``, the longer of
   the encoder input x + </s> and the decoder input <s> + y, as fairseq takes the max over both sides);
3. shuffle the order of the batches with the same generator;
4. deal the batches round-robin to the ranks: rank r gets batches r, r + world_size, ...

Everything is a function of (seed, epoch), so a `Cursor` (epoch, batches already consumed) saved in a
checkpoint resumes the exact same stream.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import torch

from tformer.data.readers import DataError

IGNORE_INDEX = -100  # label value that cross-entropy skips (torch's default ignore_index)
TokenIds = Sequence[int]


@dataclass(frozen=True)
class Cursor:
    """A position in the batch stream: `index` batches of `epoch` have been consumed on this rank."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        """A JSON-ready form for checkpoints."""
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, int]) -> Cursor:
        """The inverse of `to_dict`."""
        return cls(int(state["epoch"]), int(state["index"]))


class TokenBatchSampler:
    """Batches of example indices, grouped by length under a token budget, reshuffled every epoch.

    `lengths[i]` is the padded length example i occupies. `max_sentences` optionally caps the batch size.
    With ``shuffle=False`` (evaluation) batches come in length order and every epoch is the same.
    ``drop_last=True`` drops the last ``n_batches % world_size`` batches so every rank has the same number,
    which DistributedDataParallel needs; with the default the shards differ by at most one batch.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        max_sentences: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside 0..{world_size - 1}; pass 0 <= rank < world_size")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise DataError("no examples to batch; check that the corpus was read and encoded")
        too_long = np.flatnonzero(self.lengths > max_tokens)
        if too_long.size:
            i = int(too_long[0])
            raise DataError(
                f"{too_long.size} examples are longer than max_tokens={max_tokens} (e.g. example {i} has "
                f"{self.lengths[i]} tokens); raise max_tokens or drop long examples before batching"
            )
        self.max_tokens, self.max_sentences = max_tokens, max_sentences
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last

    def _generator(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch])

    def _cut(self, order: np.ndarray) -> np.ndarray:
        """Greedy cut of `order` (sorted by length) into batches whose padded size fits the budget: the bounds
        (batch b is ``order[bounds[b]:bounds[b + 1]]``).

        Sorted by length, a batch's longest example is its last, so a batch from s may end at e when
        ``(e - s) * lengths[e - 1]`` fits; that grows with e, so the end is a bisection (one step where the
        lengths are equal). A loop over batches rather than examples: a corpus of millions of examples is cut in
        a fraction of a second, and its batches are never lists of Python ints all at once.
        """
        lengths = self.lengths[order]
        n, cap = len(lengths), self.max_sentences or len(lengths)
        bounds, start = [0], 0
        while start < n:
            first = int(lengths[start])
            end = min(n, start + min(cap, max(self.max_tokens // first, 1)))
            if int(lengths[end - 1]) != first:  # longer examples inside: the last end that still fits

                def padded(e: int, start: int = start) -> int:
                    return (e - start) * int(lengths[e - 1])

                end = start + bisect.bisect_right(range(start + 1, end + 1), self.max_tokens, key=padded)
            bounds.append(end)
            start = end
        return np.asarray(bounds, dtype=np.int64)

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order of the examples, batch bounds in it, order of the batches) of `epoch`, for all ranks."""
        if not self.shuffle:
            order = np.argsort(self.lengths, kind="stable")
            bounds = self._cut(order)
            return order, bounds, np.arange(len(bounds) - 1)
        rng = self._generator(epoch)
        permuted = rng.permutation(len(self.lengths))
        order = permuted[np.argsort(self.lengths[permuted], kind="stable")]  # ties in random order
        bounds = self._cut(order)
        return order, bounds, rng.permutation(len(bounds) - 1)

    def _mine(self, n_batches: int) -> range:
        """Positions in the dealt-out batch order that this rank takes."""
        if self.drop_last:
            n_batches -= n_batches % self.world_size
        return range(self.rank, n_batches, self.world_size)

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of `epoch`, in the order they are dealt out."""
        order, bounds, batch_order = self._plan(epoch)
        return [order[bounds[b] : bounds[b + 1]].tolist() for b in batch_order.tolist()]

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of `epoch`."""
        order, bounds, batch_order = self._plan(epoch)
        mine = batch_order[self._mine(len(batch_order))]
        return [order[bounds[b] : bounds[b + 1]].tolist() for b in mine.tolist()]

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same every epoch: the sorted lengths, and so the cuts, are)."""
        return len(self._mine(len(self._cut(np.argsort(self.lengths, kind="stable"))) - 1))

    def iterate(self, cursor: Cursor = Cursor()) -> Iterator[tuple[list[int], Cursor]]:
        """Endless stream of (batch, cursor after it) from `cursor` on, epoch after epoch.

        Save the cursor that came with the last batch trained on; `iterate(saved)` continues with the next one.
        """
        epoch, index = cursor.epoch, cursor.index
        while True:
            order, bounds, batch_order = self._plan(epoch)
            mine = batch_order[self._mine(len(batch_order))]
            for j in range(index, len(mine)):
                b = int(mine[j])
                yield order[bounds[b] : bounds[b + 1]].tolist(), Cursor(epoch, j + 1)
            epoch, index = epoch + 1, 0


# ---- lengths and encoding ------------------------------------------------------------------------------------


class _Encoder(Protocol):
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


def encode_pairs(tokenizer: _Encoder, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """Token ids of (source, target) text pairs, e.g. ``encode_pairs(tokenizer, bible_pairs("en-de"))``."""
    src = tokenizer.encode_batch([s for s, _ in pairs])
    tgt = tokenizer.encode_batch([t for _, t in pairs])
    return list(zip(src, tgt, strict=True))


def seq2seq_lengths(pairs: Sequence[tuple[TokenIds, TokenIds]]) -> list[int]:
    """Padded length of each translation example: max(source, target) + 1 for the added </s> (or <s>)."""
    return [max(len(src), len(tgt)) + 1 for src, tgt in pairs]


def lm_lengths(seqs: Sequence[TokenIds]) -> list[int]:
    """Padded length of each language-model example with <s> and </s> (a bound for every LM objective)."""
    return [len(seq) + 2 for seq in seqs]


# ---- collation -----------------------------------------------------------------------------------------------


def pad_sequences(seqs: Sequence[TokenIds], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists to (B, T_max); returns (ids, mask) with mask 1 on real tokens."""
    longest = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


@dataclass
class Seq2SeqBatch:
    """A padded encoder-decoder batch for teacher forcing; masks are 1 on real tokens, 0 on padding."""

    src: torch.Tensor  # (B, S) source ids x_1 ... x_m </s>
    src_mask: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T) <s> y_1 ... y_n: the decoder input, the target shifted right
    tgt_out: torch.Tensor  # (B, T) y_1 ... y_n </s>: what each decoder position predicts; pad id on padding
    tgt_mask: torch.Tensor  # (B, T)

    @property
    def labels(self) -> torch.Tensor:
        """`tgt_out` with padding set to -100, the value the loss ignores."""
        return self.tgt_out.masked_fill(self.tgt_mask == 0, IGNORE_INDEX)

    @property
    def num_tokens(self) -> int:
        """Number of target tokens that take a loss (for normalising by tokens, as the 2017 recipe does)."""
        return int(self.tgt_mask.sum())

    def to(self, device: torch.device | str) -> Seq2SeqBatch:
        """The same batch on `device`."""
        return Seq2SeqBatch(*(t.to(device, non_blocking=True) for t in vars(self).values()))


def collate_seq2seq(
    pairs: Sequence[tuple[TokenIds, TokenIds]], pad_id: int = 0, bos_id: int = 1, eos_id: int = 2
) -> Seq2SeqBatch:
    """Pad (source ids, target ids) pairs into a `Seq2SeqBatch` for teacher forcing.

    src = x + </s> (as fairseq, Marian and T5 do, so the encoder sees where the sentence ends; inference must
    encode the source the same way), tgt_in = <s> + y (the target shifted right), tgt_out = y + </s>.
    """
    src, src_mask = pad_sequences([[*s, eos_id] for s, _ in pairs], pad_id)
    tgt_in, tgt_mask = pad_sequences([[bos_id, *t] for _, t in pairs], pad_id)
    tgt_out, _ = pad_sequences([[*t, eos_id] for _, t in pairs], pad_id)
    return Seq2SeqBatch(src, src_mask, tgt_in, tgt_out, tgt_mask)
