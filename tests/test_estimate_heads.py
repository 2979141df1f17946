"""`tformer estimate` for an encoder with a classification head, against a measured training step: the head's
logits have num_labels classes (per sequence or per token), not the vocabulary's (which over-counted 3.4x here)."""

from __future__ import annotations

import pytest
import torch

from tformer import ModelConfig
from tformer.data import LMBatch
from tformer.training import memory
from tformer.training.estimate import estimate_memory


def classification_batch(config: ModelConfig, batch_size: int, seq_len: int, seed: int = 0) -> LMBatch:
    """The synthetic batch with the labels a classifier trains on: a class per sequence (B,) or per token (B, T)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, config.vocab_size, (batch_size, seq_len), generator=generator)
    shape = (batch_size,) if config.encoder_head == "sequence-classification" else (batch_size, seq_len)
    labels = torch.randint(0, config.num_labels, shape, generator=generator)
    return LMBatch(ids, torch.ones_like(ids), labels)


@pytest.mark.parametrize(
    ("head", "dtype", "dropout"),
    [
        ("sequence-classification", "fp32", 0.1),
        ("sequence-classification", "bf16-autocast", 0.0),
        ("token-classification", "fp32", 0.0),
        ("token-classification", "bf16-autocast", 0.1),
    ],
)
def test_classifier_estimate_matches_the_measured_peak(monkeypatch, head: str, dtype: str, dropout: float) -> None:
    # a vocabulary large beside the model, so that counting vocabulary-sized logits would show
    config = ModelConfig.from_preset(
        "tiny-bert", d_model=64, d_ff=128, vocab_size=4000, encoder_head=head, num_labels=5, dropout=dropout
    )
    monkeypatch.setattr(memory, "synthetic_batch", classification_batch)
    batch, seq_len = 8, 32
    measured = memory.measure_training_step(config, batch, seq_len, dtype)  # the reference: a real step's tensors
    estimate = estimate_memory(config, batch * seq_len, seq_len, dtype, device="cpu")
    assert estimate.total == pytest.approx(measured.peak_bytes, rel=0.05)
    activations = measured.peak_bytes - measured.start_bytes
    assert estimate.total - estimate.weights - estimate.optimizer_state == pytest.approx(activations, rel=0.1)


def qa_batch(config: ModelConfig, batch_size: int, seq_len: int, seed: int = 0) -> LMBatch:
    """Two logits per token to train: labels in {0, 1} at every token (the span loss holds as many logits)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, config.vocab_size, (batch_size, seq_len), generator=generator)
    return LMBatch(ids, torch.ones_like(ids), torch.randint(0, 2, (batch_size, seq_len), generator=generator))


@pytest.mark.parametrize("dtype", ["fp32", "bf16-autocast"])
def test_question_answering_head_counts_two_logits_per_token(monkeypatch, dtype: str) -> None:
    """The QA head is a Linear(d_model, 2) without dropout: its terms are the formula's (its input, then 2 logits
    and 2 fp32 log-probabilities per token), not an MLM head's vocabulary-wide ones; the estimate meets a step."""
    config = ModelConfig.from_preset(
        "tiny-bert", d_model=64, d_ff=128, vocab_size=4000, encoder_head="question-answering", dropout=0.1
    )
    p = memory.PRECISIONS[dtype]
    saved_input = memory._linear_inputs(config, p, 1, p.residual)
    expected = memory.HeadTerms(saved_input + 2 * (p.compute + 4), 2 * p.compute, 2 * 4, 2 * 4 * 2)
    assert memory.head_terms(config, p) == expected
    monkeypatch.setattr(memory, "synthetic_batch", qa_batch)
    batch, seq_len = 8, 32
    measured = memory.measure_training_step(config, batch, seq_len, dtype)
    estimate = estimate_memory(config, batch * seq_len, seq_len, dtype, device="cpu")
    assert estimate.total == pytest.approx(measured.peak_bytes, rel=0.05)
    activations = measured.peak_bytes - measured.start_bytes
    assert estimate.total - estimate.weights - estimate.optimizer_state == pytest.approx(activations, rel=0.1)
