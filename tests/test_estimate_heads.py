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
