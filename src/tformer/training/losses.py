"""Training losses: label-smoothed cross-entropy as in the 2017 paper (seed 000, 'Label Smoothing')."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def label_smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float = 0.1, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over real tokens of -sum_i q_i log p_i, and the number of real tokens.

    The smoothed target puts 1 - epsilon on the true class and epsilon / (n - 1) on each of the other n - 1
    classes (the seed's definition; some libraries spread epsilon over all n classes instead). Positions whose
    target equals `ignore_index` (padding) contribute nothing. Returns (loss_sum, n_tokens) so that
    gradient accumulation can normalise by the tokens of the whole step.
    """
    logits = logits.reshape(-1, logits.shape[-1]).float()  # (N, V)
    target = target.reshape(-1)
    keep = target != ignore_index
    log_probs = F.log_softmax(logits, dim=-1)  # no boolean row indexing: it would copy the (N, V) logits
    nll = -log_probs.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1)  # -log p_true
    if epsilon == 0.0:
        loss = nll
    else:
        others = -log_probs.sum(-1) - nll  # sum of -log p over the n - 1 other classes
        loss = (1.0 - epsilon) * nll + epsilon / (logits.shape[-1] - 1) * others
    return torch.where(keep, loss, 0.0).sum(), keep.sum()
