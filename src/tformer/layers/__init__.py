"""Building blocks: attention, position schemes, norms, feed-forward networks and the residual block."""

from tformer.layers.attention import ATTENTION_BACKENDS, Attention
from tformer.layers.block import RESIDUALS, Block
from tformer.layers.dropout import Dropout
from tformer.layers.ffn import FFNS, make_ffn
from tformer.layers.masks import AttentionMask, build_mask
from tformer.layers.norms import NORMS, RMSNorm, make_norm
from tformer.layers.positions import POSITIONS, alibi_slopes, make_positions, sinusoidal_table

__all__ = [
    "ATTENTION_BACKENDS",
    "Attention",
    "AttentionMask",
    "Block",
    "Dropout",
    "FFNS",
    "NORMS",
    "POSITIONS",
    "RESIDUALS",
    "RMSNorm",
    "alibi_slopes",
    "build_mask",
    "make_ffn",
    "make_norm",
    "make_positions",
    "sinusoidal_table",
]
