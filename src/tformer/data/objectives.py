"""Training objectives: turn token id sequences into model inputs and labels.

Labels line up with the logits: the logits at position t are scored against ``labels[:, t]``, and -100 marks
positions that take no loss (`IGNORE_INDEX`, cross-entropy's default). Language-model objectives return an
`LMBatch`; objectives for encoder-decoders return a `Seq2SeqBatch` (see `collate_seq2seq`: the encoder gets
x + </s>, the decoder <s> + y and predicts y + </s>). Sequences come without <s> and </s>; the objectives add
them. Every random choice is drawn from the `torch.Generator` passed in, so a seeded generator reproduces a
batch exactly.

    teacher_forcing   seq2seq translation: (source, target) pairs                          the 2017 paper
    causal_lm         next-token prediction on <s> x </s>                                  GPT
    masked_lm         15% of tokens selected, of those 80% <mask>, 10% random, 10% kept   BERT
    span_corruption   spans (density 0.15, mean length 3) replaced by sentinels           T5
    denoising         text infilling, Poisson(3) spans -> one <mask> each; optional
                      sentence permutation                                               BART
    prefix_lm         random split; bidirectional prefix, loss on the suffix only         UniLM / T5 prefix LM
    classification    one class per sequence <s> x </s> ([CLS] x [SEP]), labels (B,)     BERT fine-tuning
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from tformer.data.batching import IGNORE_INDEX, Seq2SeqBatch, TokenIds, collate_seq2seq, pad_sequences
from tformer.data.readers import DataError
from tformer.data.tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, SPECIAL_TOKENS, Tokenizer


@dataclass(frozen=True)
class Vocab:
    """The ids the objectives need: vocabulary size, the special tokens, and T5's sentinels (highest first)."""

    size: int
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    mask_id: int = MASK_ID
    sentinel_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] = field(default_factory=lambda: frozenset(range(len(SPECIAL_TOKENS))))

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Vocab:
        """The ids of a trained `Tokenizer`."""
        sentinels = tuple(tokenizer.sentinel_ids)
        return cls(tokenizer.vocab_size, sentinel_ids=sentinels, special_ids=frozenset(tokenizer.special_ids))

    def text_ids(self) -> torch.Tensor:
        """All ids that stand for text, i.e. candidates for MLM's random replacement."""
        excluded = self.special_ids | set(self.sentinel_ids)
        return torch.tensor([i for i in range(self.size) if i not in excluded], dtype=torch.long)


@dataclass
class LMBatch:
    """A padded batch for a decoder-only or encoder-only model; masks are 1 on real tokens."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), IGNORE_INDEX where no loss is taken; (B,) class ids for classification
    prefix_len: torch.Tensor | None = None  # (B,) prefix LM: positions < prefix_len see each other both ways

    def to(self, device: torch.device | str) -> LMBatch:
        """The same batch on `device`."""
        return LMBatch(*(None if t is None else t.to(device, non_blocking=True) for t in vars(self).values()))


def _labels(seqs: Sequence[TokenIds], pad_width: int) -> torch.Tensor:
    labels = torch.full((len(seqs), pad_width), IGNORE_INDEX, dtype=torch.long)
    for row, seq in enumerate(seqs):
        labels[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    return labels


def teacher_forcing(
    pairs: Sequence[tuple[TokenIds, TokenIds]], vocab: Vocab, generator: torch.Generator | None = None
) -> Seq2SeqBatch:
    """Translation with teacher forcing: the decoder reads the true target shifted right (no randomness)."""
    return collate_seq2seq(pairs, vocab.pad_id, vocab.bos_id, vocab.eos_id)


def causal_lm(seqs: Sequence[TokenIds], vocab: Vocab, generator: torch.Generator | None = None) -> LMBatch:
    """Next-token prediction: input <s> x_1 ... x_n, labels x_1 ... x_n </s> (no randomness)."""
    inputs = [[vocab.bos_id, *s] for s in seqs]
    input_ids, mask = pad_sequences(inputs, vocab.pad_id)
    return LMBatch(input_ids, mask, _labels([[*s, vocab.eos_id] for s in seqs], input_ids.shape[1]))


def masked_lm(seqs: Sequence[TokenIds], vocab: Vocab, generator: torch.Generator, mask_prob: float = 0.15) -> LMBatch:
    """BERT's masked LM on <s> x </s>: each text token is selected with probability `mask_prob`; a selected
    token becomes <mask> with probability 0.8, a random text token with 0.1, and stays with 0.1. Labels hold
    the original token at selected positions only. Special tokens and sentinels are never selected."""
    input_ids, mask = pad_sequences([[vocab.bos_id, *s, vocab.eos_id] for s in seqs], vocab.pad_id)
    special = torch.tensor(sorted(vocab.special_ids | set(vocab.sentinel_ids)), dtype=torch.long)
    eligible = mask.bool() & ~torch.isin(input_ids, special)
    selected = eligible & (torch.rand(input_ids.shape, generator=generator) < mask_prob)
    labels = torch.where(selected, input_ids, IGNORE_INDEX)
    action = torch.rand(input_ids.shape, generator=generator)
    text_ids = vocab.text_ids()
    random_tokens = text_ids[torch.randint(len(text_ids), input_ids.shape, generator=generator)]
    corrupted = torch.where(selected & (action < 0.8), vocab.mask_id, input_ids)
    corrupted = torch.where(selected & (action >= 0.8) & (action < 0.9), random_tokens, corrupted)
    return LMBatch(corrupted, mask, labels)


def _segment(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """A uniformly random split of `total` items into `parts` segments of length >= 1 (T5's segmentation)."""
    cuts = torch.randperm(total - 1, generator=generator)[: parts - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _noise_mask(n: int, density: float, mean_span: float, generator: torch.Generator) -> list[bool]:
    """T5's random_spans_noise_mask, rolled by a random offset (as seqio's random_roll) so that the noise
    does not always end the sequence: round(n * density) noise tokens in about that / mean_span spans."""
    if n < 2:
        return [False] * n
    num_noise = min(max(round(n * density), 1), n - 1)
    num_spans = min(max(round(num_noise / mean_span), 1), num_noise, n - num_noise)
    noise, keep = _segment(num_noise, num_spans, generator), _segment(n - num_noise, num_spans, generator)
    mask = [flag for kept, noised in zip(keep, noise, strict=True) for flag in [False] * kept + [True] * noised]
    offset = int(torch.randint(n, (1,), generator=generator))
    return mask[offset:] + mask[:offset]


def _corrupt_spans(seq: TokenIds, noise: list[bool], sentinels: Sequence[int]) -> tuple[list[int], list[int]]:
    """(inputs with one sentinel per noise span, targets: each sentinel and the span it hides, then one more)."""
    num_spans = sum(1 for i, flag in enumerate(noise) if flag and (i == 0 or not noise[i - 1]))
    if num_spans + 1 > len(sentinels):
        raise DataError(
            f"span corruption needs {num_spans + 1} sentinels for a sequence of {len(seq)} tokens but has "
            f"{len(sentinels)}; train the tokenizer with a larger num_sentinels or pass shorter sequences"
        )
    inputs, targets, span = [], [], 0
    for i, (token, is_noise) in enumerate(zip(seq, noise, strict=True)):
        if is_noise and (i == 0 or not noise[i - 1]):  # a span starts: one sentinel on both sides
            inputs.append(sentinels[span])
            targets.append(sentinels[span])
            span += 1
        (targets if is_noise else inputs).append(token)
    return inputs, [*targets, sentinels[span]]


def span_corruption(
    seqs: Sequence[TokenIds],
    vocab: Vocab,
    generator: torch.Generator,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
) -> Seq2SeqBatch:
    """T5's objective: about `noise_density` of the tokens, in spans of mean length `mean_span_length`, are
    replaced by one sentinel each (<extra_id_0> for the first span, ...); the decoder predicts each sentinel
    followed by the tokens it hides, then a final sentinel. The noise mask is T5's, rotated by a random
    offset (seqio's random_roll) so short sequences are not always corrupted at the end. Sentinels are
    `vocab.sentinel_ids`: the top ids of the vocabulary, reserved by ``Tokenizer.train(..., num_sentinels=n)``."""
    if not vocab.sentinel_ids:
        raise DataError("span corruption needs sentinel tokens; train the tokenizer with num_sentinels=100")
    pairs = []
    for seq in seqs:
        noise = _noise_mask(len(seq), noise_density, mean_span_length, generator)
        pairs.append(_corrupt_spans(seq, noise, vocab.sentinel_ids))
    return collate_seq2seq(pairs, vocab.pad_id, vocab.bos_id, vocab.eos_id)


def _poisson_spans(num_mask: int, lam: float, generator: torch.Generator) -> list[int]:
    """Span lengths drawn from Poisson(lam) until they cover `num_mask` tokens; the last one is cut to fit."""
    lengths: list[int] = []
    while sum(lengths) < num_mask:
        lengths.append(int(torch.poisson(torch.tensor([lam]), generator=generator).item()))
    if lengths:
        lengths[-1] -= sum(lengths) - num_mask
    return lengths


def _infill(seq: list[int], vocab: Vocab, ratio: float, lam: float, generator: torch.Generator) -> list[int]:
    """BART text infilling of one sequence: each span (possibly empty) becomes a single <mask>."""
    num_mask = round(len(seq) * ratio)
    spans = _poisson_spans(num_mask, lam, generator)
    unmasked = len(seq) - num_mask
    cuts = torch.randint(unmasked + 1, (len(spans),), generator=generator).sort().values.tolist()
    out, pos, previous_cut = [], 0, 0
    for cut, length in zip(cuts, spans, strict=True):  # `cut` unmasked tokens precede this span
        out += [*seq[pos : pos + cut - previous_cut], vocab.mask_id]
        pos += cut - previous_cut + length
        previous_cut = cut
    return out + seq[pos:]


def _permute_sentences(seq: TokenIds, ends: Collection[int], generator: torch.Generator) -> list[int]:
    sentences, current = [], []
    for token in seq:
        current.append(token)
        if token in ends:
            sentences.append(current)
            current = []
    if current:
        sentences.append(current)
    order = torch.randperm(len(sentences), generator=generator).tolist()
    return [token for i in order for token in sentences[i]]


def denoising(
    seqs: Sequence[TokenIds],
    vocab: Vocab,
    generator: torch.Generator,
    mask_ratio: float = 0.3,
    poisson_lambda: float = 3.0,
    sentence_end_ids: Collection[int] | None = None,
) -> Seq2SeqBatch:
    """BART's denoising: `mask_ratio` of the tokens, in spans with Poisson(`poisson_lambda`) lengths, are each
    replaced by one <mask> (a 0-length span inserts a <mask>). With `sentence_end_ids` (e.g. the ids of ".",
    "!" and "?") the sentences are first shuffled. The decoder reconstructs the original sequence."""
    if poisson_lambda <= 0:
        raise DataError(f"poisson_lambda must be positive, got {poisson_lambda}; BART uses 3")
    pairs = []
    for seq in seqs:
        noisy = _permute_sentences(seq, sentence_end_ids, generator) if sentence_end_ids else list(seq)
        pairs.append((_infill(noisy, vocab, mask_ratio, poisson_lambda, generator), seq))
    return collate_seq2seq(pairs, vocab.pad_id, vocab.bos_id, vocab.eos_id)


def prefix_lm(seqs: Sequence[TokenIds], vocab: Vocab, generator: torch.Generator) -> LMBatch:
    """Prefix LM on <s> x </s>: split at a random point; the prefix (<s> x_1 ... x_k, k uniform in
    1..n-1) takes no loss and may be attended bidirectionally, the suffix is predicted token by token.
    `prefix_len` counts the input positions in the prefix, <s> included."""
    batch = causal_lm(seqs, vocab)
    prefix_len = torch.zeros(len(seqs), dtype=torch.long)
    for row, seq in enumerate(seqs):
        k = int(torch.randint(1, len(seq), (1,), generator=generator)) if len(seq) >= 2 else len(seq)
        prefix_len[row] = 1 + k
        batch.labels[row, :k] = IGNORE_INDEX  # labels[t] is input t + 1: positions 0..k-1 predict the prefix
    batch.prefix_len = prefix_len
    return batch


def sequence_classification(
    examples: Sequence[tuple[TokenIds, int]], vocab: Vocab, generator: torch.Generator | None = None
) -> LMBatch:
    """One class per sequence: input <s> x </s> (for BERT's tokenizers [CLS] x [SEP], see `vocab_of`), labels the
    class ids (B,), scored against the sequence-classification head's logits (B, num_labels). No randomness."""
    input_ids, mask = pad_sequences([[vocab.bos_id, *ids, vocab.eos_id] for ids, _ in examples], vocab.pad_id)
    return LMBatch(input_ids, mask, torch.tensor([label for _, label in examples], dtype=torch.long))


Objective = Callable[..., LMBatch | Seq2SeqBatch]
OBJECTIVES: dict[str, Objective] = {
    "seq2seq": teacher_forcing,
    "clm": causal_lm,
    "mlm": masked_lm,
    "span_corruption": span_corruption,
    "denoising": denoising,
    "prefix_lm": prefix_lm,
    "classification": sequence_classification,
}
