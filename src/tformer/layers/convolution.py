"""The convolutional sequence-to-sequence layers (ConvS2S, Gehring et al., 2017): gated convolutions and the
decoder's per-layer attention.

- `glu`: the gated linear unit, GLU([A; B]) = A * sigmoid(B) (Dauphin et al., 2017), halving the channels.
- `GLUConv`: a 1-D convolution over time from C to 2C channels, then a GLU back to C:
  y_t = GLU(b + sum_{i=0}^{k-1} W_i x_{t - left + i}), with left = (k - 1) / 2 in the encoder (centred, k odd) and
  left = k - 1 in the decoder (causal: position t reads x_{t-k+1} .. x_t, never a later one). Positions outside the
  sequence read zeros.
- `ConvAttention`: the decoder's attention in every layer ("multi-step attention"): with h_i the layer's conv
  output and g_i the target embedding, d_i = (W_d h_i + b_d + g_i) * sqrt(0.5), a_ij = softmax_j(d_i . z_j) over the
  encoder outputs z_j, c_i = sqrt(m) * sum_j a_ij (z_j + e_j) (m real source tokens: the paper's m * sqrt(1/m)), and
  the layer goes on with (W_o c_i + b_o + h_i) * sqrt(0.5).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SQRT_HALF = math.sqrt(0.5)  # keeps the variance of a sum of two unit-variance terms at 1


def glu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """GLU([A; B]) = A * sigmoid(B), A and B the two halves of x along `dim`."""
    a, b = x.chunk(2, dim)
    return a * torch.sigmoid(b)


class GLUConv(nn.Module):
    """A gated convolution over time, (B, T, C) -> (B, T, C): a 1-D convolution to 2C channels, then a GLU.

    The weight is (2C, C, k) and initialized as the paper does for a layer followed by a GLU,
    N(0, 4 (1 - dropout) / (k C)); `init_weights` leaves it alone (it only resets linear and embedding layers).
    """

    def __init__(self, channels: int, kernel: int, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.kernel, self.causal = kernel, causal
        self.left = kernel - 1 if causal else (kernel - 1) // 2
        self.right = kernel - 1 - self.left
        std = math.sqrt(4 * (1 - dropout) / (kernel * channels))
        self.weight = nn.Parameter(torch.randn(2 * channels, channels, kernel) * std)
        self.bias = nn.Parameter(torch.zeros(2 * channels))

    def forward(self, x: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). A causal layer may be given `history` (B, k - 1, C), the inputs just before x
        (a decoding step's earlier positions); without it those positions read zeros."""
        if history is not None:
            if not self.causal:
                raise ValueError("only a causal GLUConv reads a history of earlier inputs")
            x = torch.cat([history, x], 1)  # (B, k - 1 + T, C)
            padded = x.transpose(1, 2)
        else:
            padded = F.pad(x.transpose(1, 2), (self.left, self.right))  # (B, C, left + T + right)
        return glu(F.conv1d(padded, self.weight, self.bias), dim=1).transpose(1, 2)  # (B, T, C)


class GradScale(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward (fairseq's GradMultiply)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class ConvAttention(nn.Module):
    """One decoder layer's attention over the encoder: conv output h (B, T, C) -> (B, T, C) (formula above)."""

    def __init__(self, channels: int, embed_dim: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(channels, embed_dim)  # W_d: to the embedding width, where z lives
        self.out_proj = nn.Linear(embed_dim, channels)  # W_o: back to the conv channels

    def forward(
        self,
        h: torch.Tensor,
        target_embedding: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        src_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """h (B, T, C), target_embedding (B, T, E), keys z and values z + e (B, S, E), src_mask (B, S) 1 on real
        source tokens -> (B, T, C)."""
        query = (self.in_proj(h) + target_embedding) * SQRT_HALF  # d_i
        scores = query @ keys.transpose(1, 2)  # (B, T, S)
        if src_mask is not None:
            scores = scores.masked_fill(src_mask[:, None, :] == 0, float("-inf"))
        weights = torch.softmax(scores.float(), -1).to(values.dtype)
        n_source = keys.new_full((keys.shape[0],), keys.shape[1]) if src_mask is None else src_mask.sum(1)
        context = (weights @ values) * n_source.to(values.dtype).sqrt()[:, None, None]  # (B, T, E)
        return (self.out_proj(context) + h) * SQRT_HALF
