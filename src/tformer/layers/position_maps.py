"""The data behind the position pictures, computed by the schemes themselves so that a figure shows what a model uses.

`tformer viz positions` draws these: RoPE's rotation frequencies and its relative-score pattern, ALiBi's bias per
head, and a checkpoint's learned tables (sinusoidal tables come from `sinusoidal_table`). Tests check each against
its paper's formula written out by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.errors import ConfigError
from tformer.layers.positions import (
    ALiBiPositions,
    LearnedPositions,
    RelativeBucketPositions,
    RotaryPositions,
    apply_rotary,
    rope_inv_freq,
)


@dataclass
class RopeFrequencies:
    """RoPE's rotation frequency theta_i (radians per position) of each pair i of a head's dimensions."""

    theta: torch.Tensor  # (head_dim / 2,) what the model rotates a `seq_len`-token sequence by, after scaling
    unscaled: torch.Tensor  # (head_dim / 2,) rope_theta^(-2i / head_dim), before any scaling
    scale: float  # the magnitude of cos and sin: YaRN's attention temperature, else 1
    seq_len: int  # dynamic-NTK scaling depends on it (it grows the base past rope_original_max_len)


def _require(config: ModelConfig, position: str) -> None:
    if config.position != position:
        raise ConfigError(f"this model uses position '{config.position}', not '{position}'")


def rope_frequencies(config: ModelConfig, seq_len: int) -> RopeFrequencies:
    """The frequencies a RoPE model rotates a sequence of `seq_len` tokens by, beside the unscaled ones."""
    _require(config, "rope")
    theta, scale = rope_inv_freq(config, seq_len)
    unscaled, _ = rope_inv_freq(dataclasses.replace(config, rope_scaling="none", rope_factor=1.0))
    return RopeFrequencies(theta, unscaled, scale, seq_len)


def rope_relative_scores(config: ModelConfig, length: int) -> torch.Tensor:
    """q_m . k_0 / head_dim for m = 0 .. length-1, with q = k = (1, ..., 1) rotated by the model's own RoPE.

    The score depends only on the distance m (RoPE's point), and for these vectors it is
    scale^2 * (2 / head_dim) * sum_i cos(m * theta_i): 1 at m = 0 (times scale^2), then oscillating with a
    shrinking envelope, RoFormer's long-term decay.
    """
    _require(config, "rope")
    rotary = RotaryPositions(config).rotary(torch.arange(length)[None])  # one call, so dynamic NTK sees `length`
    ones = torch.ones(1, 1, length, config.head_dim)  # (B, H, T, head_dim)
    rotated = apply_rotary(ones, rotary)[0, 0]  # (T, head_dim): the vector rotated to each position
    return rotated @ rotated[0] / config.head_dim  # (T,): the query at m against the key at 0


def alibi_biases(config: ModelConfig, length: int) -> torch.Tensor:
    """ALiBi's additive score bias -slope_h * |i - j| of every head, query i and key j: (n_heads, length, length)."""
    _require(config, "alibi")
    positions = torch.arange(length)[None]
    return ALiBiPositions(config).attention_bias(positions, positions)[0]


def learned_position_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained (max_seq_len, d_model) position table of each stack that learns one, by stack name."""
    tables = {
        name.removesuffix(".positions") or "model": module.embedding.weight.detach()
        for name, module in model.named_modules()
        if isinstance(module, LearnedPositions)
    }
    if not tables:
        position = getattr(getattr(model, "config", None), "position", "unknown")
        raise ConfigError(f"this model has no learned position table (its position scheme is '{position}')")
    return tables


def relative_bias_maps(model: nn.Module, length: int) -> dict[str, torch.Tensor]:
    """T5: each stack's learned bias (H, length, length) for queries and keys at positions 0..length-1, by stack."""
    positions = torch.arange(length)[None]
    maps = {
        name.removesuffix(".positions") or "model": module.attention_bias(positions, positions)[0].detach()
        for name, module in model.named_modules()
        if isinstance(module, RelativeBucketPositions)
    }
    if not maps:
        raise ConfigError("this model has no relative position bias (its position scheme is not 't5')")
    return maps
