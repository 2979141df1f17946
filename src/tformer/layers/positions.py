"""Position schemes: sinusoidal, learned, RoPE (with linear / dynamic-NTK / YaRN scaling), ALiBi, T5's buckets, none.

Every scheme answers the same three questions, so a model never branches on the scheme's name:
- `embed(positions)`: a vector to add to the token embeddings, or None;
- `rotary(positions)`: the (cos, sin) pair that rotates queries and keys, or None;
- `attention_bias(q_pos, k_pos)`: a per-head additive bias on the attention scores, or None.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.errors import RequestError
from tformer.layers.relative_position import RelativePositionBias

Rotary = tuple[torch.Tensor, torch.Tensor]


class PositionScheme(nn.Module):
    """No positional information (a 'NoPE' model, which relies on the causal mask alone)."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()

    def embed(self, positions: torch.Tensor) -> torch.Tensor | None:
        return None

    def rotary(self, positions: torch.Tensor) -> Rotary | None:
        return None

    def attention_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return None

    def layer_attention_bias(self, layer: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The bias function layer `layer` adds to its scores: the scheme's one for every layer, or None."""
        return self.attention_bias if self.has_attention_bias else None

    @property
    def has_attention_bias(self) -> bool:
        """Whether `attention_bias` adds anything (the scheme overrides it)."""
        return type(self).attention_bias is not PositionScheme.attention_bias


SINUSOIDAL_LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "interleaved": lambda sin, cos: torch.stack([sin, cos], dim=-1).flatten(-2),  # sin, cos, sin, cos, ...
    "split": lambda sin, cos: torch.cat([sin, cos], dim=-1),  # every sine, then every cosine (Marian, fairseq)
}


def sinusoidal_table(n_positions: int, dim: int, base: float = 10000.0, layout: str = "interleaved") -> torch.Tensor:
    """The paper's PE[t, 2i] = sin(t / base^(2i/d)), PE[t, 2i+1] = cos(t / base^(2i/d)), shape (n_positions, dim).

    `layout` "split" puts the same values in another order: PE[t, i] = sin(...), PE[t, d/2 + i] = cos(...).
    """
    t = torch.arange(n_positions, dtype=torch.float64)[:, None]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = t * inv_freq  # (n_positions, dim/2)
    return SINUSOIDAL_LAYOUTS[layout](angles.sin(), angles.cos()).float()


def _last_position(positions: torch.Tensor) -> int:
    """The largest position id, or -1 when there is none or under torch.compile (where reading it back would
    break the graph; compiled callers stay within max_seq_len)."""
    if torch.compiler.is_compiling() or positions.numel() == 0:
        return -1
    return int(positions.max())


class SinusoidalPositions(PositionScheme):
    """The paper's fixed encodings, added to the (scaled) token embeddings; computed past max_seq_len too."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        table = sinusoidal_table(config.max_seq_len, config.d_model, config.sinusoidal_base, config.sinusoidal_layout)
        self.register_buffer("table", table, persistent=False)

    def embed(self, positions: torch.Tensor) -> torch.Tensor:
        last = _last_position(positions)
        if last >= self.table.shape[0]:  # the formula holds at any position: extend the table for this call
            c = self.config
            table = sinusoidal_table(last + 1, c.d_model, c.sinusoidal_base, c.sinusoidal_layout)
            return table.to(self.table.device)[positions]
        return self.table[positions]


class LearnedPositions(PositionScheme):
    """One trained vector per absolute position (GPT-2, BERT): none exists past max_seq_len.

    RoBERTa's table starts with `position_offset` rows that no real token reads (fairseq numbers positions from
    pad_token_id + 1), so position p reads row p + position_offset.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.offset = config.position_offset
        self.embedding = nn.Embedding(config.max_seq_len + self.offset, config.d_model)

    def embed(self, positions: torch.Tensor) -> torch.Tensor:
        last, limit = _last_position(positions), self.embedding.num_embeddings - self.offset
        if last >= limit:
            raise RequestError(
                f"position {last} is past this model's learned positions (max_seq_len {limit}): learned positions "
                f"have no vector there; give at most {limit} tokens, or use a model with position 'sinusoidal', "
                f"'rope' or 'alibi', which extend past the training length"
            )
        return self.embedding(positions + self.offset if self.offset else positions)


def rope_inv_freq(config: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of each rotated pair and the cos/sin scale, after the configured scaling.

    linear: positions divided by the factor (position interpolation, Chen et al., 2023).
    dynamic-ntk: the base grows once the sequence passes the original context (bloc97 / Code Llama).
    yarn: per-frequency blend of interpolation and extrapolation plus attention temperature (Peng et al., 2023).
    llama3: long wavelengths interpolated, short ones kept, a smooth blend between (Llama 3.1's release).
    """
    dim, base, factor = config.head_dim, config.rope_theta, config.rope_factor
    original = config.rope_original_max_len
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    if config.rope_scaling == "dynamic-ntk":
        seq_len = max(seq_len or original, original)
        base = base * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / base**exponents
    if config.rope_scaling == "linear":
        return inv_freq / factor, 1.0
    if config.rope_scaling == "yarn":
        return _yarn_inv_freq(inv_freq, config), 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    if config.rope_scaling == "llama3":
        return _llama3_inv_freq(inv_freq, config), 1.0
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Pairs whose wavelength exceeds original / low_freq_factor turn `factor` times slower; those shorter than
    original / high_freq_factor keep their speed; in between, a blend linear in original / wavelength."""
    original, factor = config.rope_original_max_len, config.rope_factor
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    dim, base, original = config.head_dim, config.rope_theta, config.rope_original_max_len

    def pair_index(n_rotations: float) -> float:  # the pair that turns n_rotations times over the context
        return dim * math.log(original / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_index(config.yarn_beta_fast)), 0)
    high = min(math.ceil(pair_index(config.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 for high-frequency pairs, which keep their original frequency
    return inv_freq / config.rope_factor * (1 - extrapolate) + inv_freq * extrapolate


class RotaryPositions(PositionScheme):
    """RoPE (Su et al., 2021) in the half-split layout used by LLaMA checkpoints."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        inv_freq, scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale

    def rotary(self, positions: torch.Tensor) -> Rotary:
        inv_freq = self.inv_freq
        if self.config.rope_scaling == "dynamic-ntk":
            seq_len = int(positions.max()) + 1
            if seq_len > self.config.rope_original_max_len:
                inv_freq = rope_inv_freq(self.config, seq_len)[0].to(inv_freq.device)
        angles = positions[..., None].float() * inv_freq  # (B, T, head_dim/2)
        angles = torch.cat([angles, angles], dim=-1)  # (B, T, head_dim)
        if self.scale == 1.0:  # YaRN's attention scale; others leave it at 1
            return angles.cos(), angles.sin()
        return angles.cos() * self.scale, angles.sin() * self.scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotates x (B, H, T, head_dim) by the per-position angles in (cos, sin), each (B, T, head_dim)."""
    cos, sin = rotary[0][:, None], rotary[1][:, None]  # (B, 1, T, head_dim)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head slopes from the ALiBi paper: a geometric sequence starting at 2^(-8/n).

    For a head count that is not a power of two, take the slopes of the nearest lower power of two,
    then every other slope of the next power of two (as in the paper's reference code).
    """

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two_slopes(closest)
    slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBiPositions(PositionScheme):
    """Attention with Linear Biases (Press et al., 2022): score - slope_h * |i - j|, no embeddings."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(config.n_heads), persistent=False)

    def attention_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        distance = (q_pos[:, :, None] - k_pos[:, None, :]).abs().float()  # (B, Tq, Tk)
        return -self.slopes[None, :, None, None] * distance[:, None]  # (B, H, Tq, Tk)


class RelativeBucketPositions(PositionScheme):
    """T5: no embeddings; a learned per-head bias for each bucket of relative distance, one table per stack.

    An encoder buckets distances both ways; a decoder (`causal`) only those to earlier keys, as in T5.
    """

    def __init__(self, config: ModelConfig, causal: bool = False) -> None:
        super().__init__()
        self.relative_bias = RelativePositionBias(
            config.n_heads, config.relative_attention_buckets, config.relative_attention_max_distance, not causal
        )

    def attention_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return self.relative_bias(q_pos, k_pos)  # (B|1, H, Tq, Tk)


class LayerRelativeBucketPositions(PositionScheme):
    """umT5: T5's buckets with a table of its own in every layer, where T5 shares its first layer's in the stack."""

    def __init__(self, config: ModelConfig, causal: bool = False) -> None:
        super().__init__()
        n_layers = config.n_decoder_layers if causal else config.n_encoder_layers
        buckets, distance = config.relative_attention_buckets, config.relative_attention_max_distance
        self.relative_biases = nn.ModuleList(
            RelativePositionBias(config.n_heads, buckets, distance, not causal) for _ in range(n_layers)
        )

    def attention_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return self.relative_biases[0](q_pos, k_pos)  # the first layer's (B|1, H, Tq, Tk), as plots show it

    def layer_attention_bias(self, layer: int) -> RelativePositionBias:
        return self.relative_biases[layer]


POSITIONS: dict[str, type[PositionScheme]] = {
    "sinusoidal": SinusoidalPositions,
    "learned": LearnedPositions,
    "rope": RotaryPositions,
    "alibi": ALiBiPositions,
    "t5": RelativeBucketPositions,
    "none": PositionScheme,
}


def local_rotary_positions(config: ModelConfig) -> RotaryPositions | None:
    """The plain RoPE of base `rope_local_theta` that sliding-window layers use (Gemma 3), or None without one."""
    if config.rope_local_theta is None:
        return None
    return RotaryPositions(dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling="none"))


def make_positions(config: ModelConfig, causal: bool = False) -> PositionScheme:
    """The position scheme the config names, for a causal stack (a decoder) or a bidirectional one.

    Only T5's buckets depend on the direction, so only they are told it.
    """
    if config.position == "t5":
        scheme = LayerRelativeBucketPositions if config.relative_attention_per_layer else RelativeBucketPositions
        return scheme(config, causal)
    return POSITIONS[config.position](config)
