"""Training losses: label-smoothed cross-entropy as in the 2017 paper (seed 000, 'Label Smoothing').

Two implementations of one formula: `label_smoothed_cross_entropy` writes it with torch ops (the reference), and
`fused_label_smoothed_cross_entropy` computes the loss and its gradient in one pass over row blocks of the logits,
for training: it never holds fp32 log-probabilities over the whole vocabulary, and its backward is one multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
ROWS_PER_BLOCK = 256  # rows of fp32 logits per block of the fused loss: 4 MB at a 4,000-token vocabulary


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


class _FusedSmoothedCrossEntropy(torch.autograd.Function):
    """Forward computes the loss sum and, when logits need a gradient, d(loss sum)/d(logits) = keep * (p - q),
    block by block in one reused fp32 buffer (one exp per logit), stored in the logits' dtype; backward scales
    it by the incoming gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int) -> torch.Tensor:
        n_rows, n_classes = logits.shape
        off = epsilon / (n_classes - 1)  # q_i off the true class
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        buffer = torch.empty((min(ROWS_PER_BLOCK, n_rows), n_classes), dtype=torch.float32, device=logits.device)
        for start in range(0, n_rows, ROWS_PER_BLOCK):
            x = buffer[: min(ROWS_PER_BLOCK, n_rows - start)].copy_(logits[start : start + ROWS_PER_BLOCK])  # (n, V)
            t = target[start : start + ROWS_PER_BLOCK]
            keep = (t != ignore_index).float()
            index = t.clamp(min=0)[:, None]
            x_true, row_sum = x.gather(-1, index).squeeze(-1), x.sum(-1)
            row_max = x.amax(-1, keepdim=True)
            exp = x.sub_(row_max).exp_()  # exp(x - max), in the buffer
            exp_sum = exp.sum(-1)
            lse = row_max.squeeze(-1) + exp_sum.log()
            # -sum_i q_i (x_i - lse) = lse - (1 - eps) x_true - eps / (V - 1) (sum_i x_i - x_true)
            total += ((lse - (1.0 - epsilon) * x_true - off * (row_sum - x_true)) * keep).sum()
            if grad is not None:  # keep * (p_i - q_i), with p_i = exp_i / exp_sum
                p_minus_q = exp.mul_((keep / exp_sum)[:, None]).sub_((off * keep)[:, None])
                p_minus_q.scatter_add_(-1, index, ((off - (1.0 - epsilon)) * keep)[:, None])
                grad[start : start + ROWS_PER_BLOCK] = p_minus_q
        ctx.save_for_backward(grad)
        ctx.backward_done = False
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if ctx.backward_done:
            raise RuntimeError("the fused loss scales its stored gradient in place: it supports one backward pass")
        ctx.backward_done = True
        (grad,) = ctx.saved_tensors
        # in place: a new (N, V) tensor would cost fresh pages, several times the multiply (docs/design-notes.md,
        # "training/losses.py")
        return grad.mul_(grad_total.to(grad.dtype)), None, None, None


def fused_label_smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float = 0.1, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """`label_smoothed_cross_entropy`'s (loss_sum, n_tokens), with the gradient computed in the forward pass.

    The gradient is kept in the logits' dtype (bf16 logits: a bf16 gradient, which is what the lm_head's bf16
    matmul receives under either implementation). Supports one backward pass (no retain_graph reuse, no double
    backward).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_target = target.reshape(-1)
    loss_sum = _FusedSmoothedCrossEntropy.apply(flat_logits, flat_target, float(epsilon), ignore_index)
    return loss_sum, (flat_target != ignore_index).sum()
