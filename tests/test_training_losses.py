"""Label smoothing against the seed's formula, and the schedules against theirs."""

import math

import pytest
import torch

from tformer.training.losses import label_smoothed_cross_entropy
from tformer.training.optim import noam_lr, paper_adam, warmup_cosine_lr


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_label_smoothing_matches_the_seed_target_distribution(epsilon):
    torch.manual_seed(0)
    n = 11
    logits = torch.randn(3, 5, n)
    target = torch.randint(0, n, (3, 5))
    target[0, 3:] = -100  # padding
    loss, count = label_smoothed_cross_entropy(logits, target, epsilon)
    expected = 0.0
    for b in range(3):
        for t in range(5):
            if target[b, t] == -100:
                continue
            q = torch.full((n,), epsilon / (n - 1))  # y_i = eps / (n - 1) off the true class
            q[target[b, t]] = 1 - epsilon  # and 1 - eps on it
            expected += -(q * torch.log_softmax(logits[b, t], -1)).sum()
    assert count == 13
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_no_smoothing_is_plain_cross_entropy():
    logits, target = torch.randn(4, 7), torch.tensor([1, 2, -100, 6])
    loss, count = label_smoothed_cross_entropy(logits, target, 0.0)
    reference = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss, reference)
    assert count == 3


def test_noam_schedule_matches_the_seed_formula_and_peaks_at_warmup():
    d, t0 = 512, 4000
    for t in (1, 100, 3999, 4000, 4001, 100_000):
        assert noam_lr(t, d, t0) == pytest.approx(1 / math.sqrt(d) * min(1 / math.sqrt(t), t / math.sqrt(t0**3)))
    rates = [noam_lr(t, d, t0) for t in range(1, 10_000)]
    assert max(range(len(rates)), key=rates.__getitem__) + 1 == t0


def test_paper_adam_hyperparameters_and_schedule():
    model = torch.nn.Linear(4, 4)
    optimizer, scheduler = paper_adam(model, d_model=512, warmup=4000)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    assert group["lr"] == pytest.approx(noam_lr(1, 512, 4000))
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(noam_lr(2, 512, 4000))


def test_warmup_cosine():
    assert warmup_cosine_lr(0, 1.0, 10, 110) == pytest.approx(0.1)
    assert warmup_cosine_lr(9, 1.0, 10, 110) == pytest.approx(1.0)
    assert warmup_cosine_lr(60, 1.0, 10, 110) == pytest.approx(0.1 + 0.9 * 0.5)
    assert warmup_cosine_lr(110, 1.0, 10, 110) == pytest.approx(0.1)
    assert warmup_cosine_lr(500, 1.0, 10, 110) == pytest.approx(0.1)
