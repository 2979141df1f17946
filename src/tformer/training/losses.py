"""Training losses: label-smoothed cross-entropy as in the 2017 paper (seed 000, 'Label Smoothing'), and the
load-balancing loss of a mixture of experts.

Two implementations of one formula: `label_smoothed_cross_entropy` writes it with torch ops (the reference), and
`fused_label_smoothed_cross_entropy` computes the loss and its gradient in one pass over row blocks of the logits,
for training: it never holds fp32 log-probabilities over the whole vocabulary, and its backward is one multiply.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tformer.layers.ffn import MixtureOfExperts

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


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], top_k: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss, as Mixtral trains with it: n_experts * sum_i f_i * P_i, where f_i
    is the number of top-k choices of expert i per token and P_i the mean router probability of expert i, both
    pooled over the tokens of every layer in `router_logits` (each (N, n_experts)). It is k when the load is
    even and grows as the router favours some experts. `attention_mask` (B, T), with B * T = N, leaves padding
    out."""
    logits = torch.cat(list(router_logits)).float()  # (L * N, E)
    n_experts = logits.shape[-1]
    probs = F.softmax(logits, dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices  # (L * N, k)
    if attention_mask is None:
        keep = torch.ones(logits.shape[0], device=logits.device)
    else:
        keep = attention_mask.reshape(-1).float().repeat(len(router_logits))  # (L * N,)
    n_real = keep.sum()
    choices = torch.zeros(n_experts, device=logits.device).scatter_add_(
        0, chosen.flatten(), keep.repeat_interleave(top_k)
    )
    mean_probs = (probs * keep[:, None]).sum(0) / n_real  # P_i
    return n_experts * (choices / n_real * mean_probs).sum()


def moe_aux_loss(model: nn.Module, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The load-balancing loss over the router logits that `model`'s mixtures of experts kept from their last
    forward in training mode; None for a model without experts. The mask applies only when every layer routed
    its B * T tokens (a decoder-only batch), else every token counts."""
    routers = [m for m in model.modules() if isinstance(m, MixtureOfExperts) and m.router_logits is not None]
    if not routers:
        return None
    logits = [m.router_logits for m in routers]
    if attention_mask is not None and any(x.shape[0] != attention_mask.numel() for x in logits):
        attention_mask = None
    return load_balancing_loss(logits, routers[0].top_k, attention_mask)
