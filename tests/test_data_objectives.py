"""tformer.data's training objectives: causal, masked (BERT's 80/10/10), span corruption (T5), denoising (BART) and
prefix LM, checked against what each paper defines: the labels rebuild the original, the rates match, seeds reproduce.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tformer.data import (
    IGNORE_INDEX,
    OBJECTIVES,
    DataError,
    Vocab,
    causal_lm,
    denoising,
    masked_lm,
    prefix_lm,
    span_corruption,
)

# ---- objectives ----------------------------------------------------------------------------------------------

VOCAB = Vocab(1000, sentinel_ids=tuple(range(999, 979, -1)), special_ids=frozenset(range(5)) | set(range(980, 1000)))


def seqs(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(5, 980, (int(torch.randint(2, length + 1, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_causal_lm_predicts_the_next_token() -> None:
    data = [[10, 11, 12], [20]]
    batch = causal_lm(data, VOCAB)
    assert batch.input_ids.tolist() == [[1, 10, 11, 12], [1, 20, 0, 0]]
    assert batch.labels.tolist() == [[10, 11, 12, 2], [20, 2, -100, -100]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_masked_lm_follows_bert_80_10_10() -> None:
    data = [[5 + (i * 7 + j) % 900 for j in range(100)] + [2, 999, 3] for i in range(200)]  # specials inside
    batch = masked_lm(data, VOCAB, gen(), mask_prob=0.15)
    original = torch.tensor([[1, *s, 2] for s in data])
    selected = batch.labels != IGNORE_INDEX
    assert torch.equal(batch.labels[selected], original[selected])  # labels: the original, where selected
    assert torch.equal(batch.input_ids[~selected], original[~selected])  # unselected tokens never change
    special = torch.isin(original, torch.tensor(sorted(VOCAB.special_ids)))
    assert not (selected & special).any()
    assert abs(selected.sum().item() / (~special).sum().item() - 0.15) < 0.01
    out = batch.input_ids[selected]
    masked = (out == VOCAB.mask_id).float().mean().item()
    kept = (out == original[selected]).float().mean().item()
    replaced = ((out != VOCAB.mask_id) & (out != original[selected])).float().mean().item()
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1) < 0.02 and abs(replaced - 0.1) < 0.02
    assert not torch.isin(out[out != VOCAB.mask_id], torch.tensor(sorted(VOCAB.special_ids))).any()


def reconstruct_spans(inputs: list[int], targets: list[int], sentinels: tuple[int, ...]) -> list[int]:
    """Undo span corruption: replace sentinel i in the inputs by what follows it in the targets."""
    spans: dict[int, list[int]] = {}
    current = None
    for token in targets:
        if token in sentinels:
            current = spans.setdefault(token, [])
        else:
            current.append(token)
    return [token for t in inputs for token in (spans[t] if t in sentinels else [t])]


def test_span_corruption_inputs_and_targets_rebuild_the_original() -> None:
    data = seqs(100, 60) + [[7], []]
    batch = span_corruption(data, VOCAB, gen(), noise_density=0.15, mean_span_length=3.0)
    noise, spans = 0, 0
    for row, seq in enumerate(data):
        inputs = batch.src[row][batch.src_mask[row].bool()].tolist()
        targets = batch.tgt_out[row][batch.tgt_mask[row].bool()].tolist()
        assert inputs[-1] == VOCAB.eos_id and targets[-1] == VOCAB.eos_id
        assert reconstruct_spans(inputs[:-1], targets[:-1], VOCAB.sentinel_ids) == seq
        used = [t for t in targets[:-1] if t in VOCAB.sentinel_ids]
        assert used == list(VOCAB.sentinel_ids[: len(used)])  # <extra_id_0>, <extra_id_1>, ... in order
        noise, spans = noise + len(targets) - 1 - len(used), spans + len(used) - 1
    total = sum(len(s) for s in data)
    assert abs(noise / total - 0.15) < 0.02 and 2.0 < noise / spans < 3.5


def every_gap_is_masked(seq: list[int], src: list[int]) -> bool:
    """Whether `src` is `seq` in order with each run of removed tokens marked by at least one <mask>."""
    pos, masks = 0, 0
    for token in [*src, None]:
        if token == VOCAB.mask_id:
            masks += 1
            continue
        end = len(seq) if token is None else seq.index(token)
        if end < pos or (end > pos and masks == 0):
            return False
        pos, masks = end + 1, 0
    return True


def split_sentences(seq: list[int], end: int) -> Counter:
    sentences, current = [], []
    for token in seq:
        current.append(token)
        if token == end:
            sentences, current = [*sentences, tuple(current)], []
    return Counter([*sentences, tuple(current)])


def test_denoising_labels_are_the_original() -> None:
    data = [list(range(10, 10 + n)) for n in (1, 5, 20, 40)] * 5  # distinct tokens: spans are recoverable
    batch = denoising(data, VOCAB, gen(), mask_ratio=0.3, poisson_lambda=3.0)
    for row, seq in enumerate(data):
        assert batch.labels[row][batch.tgt_mask[row].bool()].tolist() == [*seq, VOCAB.eos_id]
        src = batch.src[row][batch.src_mask[row].bool()].tolist()[:-1]
        assert len(seq) - sum(t != VOCAB.mask_id for t in src) == round(len(seq) * 0.3)
        assert every_gap_is_masked(seq, src)


def test_denoising_sentence_permutation_keeps_the_sentences() -> None:
    seq = [10, 11, 50, 12, 50, 13, 14, 15, 50, 16, 17, 50]  # 50 ends a sentence
    sources = {
        tuple(denoising([seq], VOCAB, gen(s), mask_ratio=0.0, sentence_end_ids={50}).src[0, :-1].tolist())
        for s in range(20)
    }
    assert len(sources) > 1
    for src in sources:
        assert split_sentences(list(src), 50) == split_sentences(seq, 50)


def test_prefix_lm_takes_no_loss_on_the_prefix() -> None:
    data = seqs(50, 30)
    batch = prefix_lm(data, VOCAB, gen())
    full = causal_lm(data, VOCAB)
    assert torch.equal(batch.input_ids, full.input_ids)
    for row, seq in enumerate(data):
        p = int(batch.prefix_len[row])
        assert 2 <= p <= len(seq)  # <s> plus 1 .. n-1 tokens: neither part is empty
        assert (batch.labels[row, : p - 1] == IGNORE_INDEX).all()
        assert batch.labels[row, p - 1 : len(seq) + 1].tolist() == [*seq[p - 1 :], VOCAB.eos_id]
    assert len(set(batch.prefix_len.tolist())) > 5


@pytest.mark.parametrize("name", ["mlm", "span_corruption", "denoising", "prefix_lm"])
def test_random_objectives_are_reproducible(name: str) -> None:
    data = seqs(20, 30)
    a, b, c = ([t for t in vars(OBJECTIVES[name](data, VOCAB, gen(s))).values() if t is not None] for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_objective_errors_are_clear() -> None:
    with pytest.raises(DataError, match="num_sentinels"):
        span_corruption([[5, 6, 7]], Vocab(100), gen())
    with pytest.raises(DataError, match="num_sentinels"):
        span_corruption([list(range(5, 95))], Vocab(100, sentinel_ids=(99, 98)), gen())
