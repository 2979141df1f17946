"""Residual connections around a sublayer, one class per norm placement, and the Transformer block.

With F the sublayer (attention or FFN) and dropout applied to F's output before the residual add:
- post (the 2017 paper):  LN(x + F(x))
- pre (GPT-2, LLaMA):     x + F(LN(x))
- sandwich:               x + LN(F(LN(x)))
- deepnorm (DeepNet):     LN(alpha * x + F(x)), with F's weights initialised with gain beta
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.layers.attention import Attention
from tformer.layers.dropout import Dropout
from tformer.layers.ffn import make_ffn
from tformer.layers.kv_cache import LayerCache
from tformer.layers.linear_attention import LinearAttention, PerformerAttention
from tformer.layers.masks import AttentionMask
from tformer.layers.norms import make_norm
from tformer.layers.positions import Rotary
from tformer.layers.sparse_attention import FixedAttention, LongformerAttention, StridedAttention

Sublayer = Callable[[torch.Tensor], torch.Tensor]


class PostNorm(nn.Module):
    """LN(alpha * x + Dropout(F(x))); alpha is 1 except under DeepNorm."""

    def __init__(self, config: ModelConfig, alpha: float = 1.0) -> None:
        super().__init__()
        self.norm = make_norm(config)
        self.dropout = Dropout(config.dropout)
        self.alpha = alpha

    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return self.norm(self.alpha * x + self.dropout(sublayer(x)))


class PreNorm(nn.Module):
    """x + Dropout(F(LN(x)))."""

    def __init__(self, config: ModelConfig, alpha: float = 1.0) -> None:
        super().__init__()
        self.norm = make_norm(config)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return x + self.dropout(sublayer(self.norm(x)))


class SandwichNorm(nn.Module):
    """x + Dropout(LN_out(F(LN_in(x))))."""

    def __init__(self, config: ModelConfig, alpha: float = 1.0) -> None:
        super().__init__()
        self.norm_in = make_norm(config)
        self.norm_out = make_norm(config)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return x + self.dropout(self.norm_out(sublayer(self.norm_in(x))))


# config.attention -> the self-attention module; each takes Attention's constructor and forward arguments
SELF_ATTENTIONS: dict[str, type[nn.Module]] = {
    "softmax": Attention,
    "longformer": LongformerAttention,
    "performer": PerformerAttention,
    "strided": StridedAttention,
    "fixed": FixedAttention,
    "linear": LinearAttention,
}

RESIDUALS: dict[str, type[nn.Module]] = {
    "post": PostNorm,
    "pre": PreNorm,
    "sandwich": SandwichNorm,
    "deepnorm": PostNorm,
}


class Block(nn.Module):
    """One layer: self-attention, optional cross-attention over encoder memory, and an FFN.

    `stack` ('encoder' or 'decoder') selects DeepNorm's coefficients, which differ per stack; `layer` (the block's
    index from 0) whether its FFN is a mixture of experts (config.moe_dense_layers).
    """

    def __init__(self, config: ModelConfig, stack: str, cross_attention: bool = False, layer: int = 0) -> None:
        super().__init__()
        alpha = config.deepnorm_coefficients(stack)[0] if config.norm_placement == "deepnorm" else 1.0
        residual = RESIDUALS[config.norm_placement]
        self.self_attn = SELF_ATTENTIONS[config.attention](config)
        self.norm_attn = residual(config, alpha)
        self.cross_attn = Attention(config, cross=True) if cross_attention else None
        self.norm_cross = residual(config, alpha) if cross_attention else None
        self.ffn = make_ffn(config, layer)
        self.norm_ffn = residual(config, alpha)

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rotary: Rotary | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: AttentionMask | None = None,
        cache: LayerCache | None = None,
        cache_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self_cache, cross_cache = (None, None) if cache is None else (cache.self_attn, cache.cross_attn)
        x = self.norm_attn(
            x, lambda h: self.self_attn(h, mask, rotary, cache=self_cache, cache_positions=cache_positions)
        )
        if self.cross_attn is not None:
            x = self.norm_cross(x, lambda h: self.cross_attn(h, memory_mask, context=memory, cache=cross_cache))
        return self.norm_ffn(x, self.ffn)
