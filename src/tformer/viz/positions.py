"""The position scheme a model uses, drawn: sinusoidal or learned tables, RoPE's frequencies and relative scores,
ALiBi's bias per head. One drawing function per scheme, picked from POSITION_FIGURES by the config's `position`.

The numbers come from tformer.layers (the schemes' own code); this module only draws them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import nn

from tformer.config import ModelConfig
from tformer.errors import ConfigError
from tformer.layers import alibi_slopes, sinusoidal_table
from tformer.layers.position_maps import (
    alibi_biases,
    learned_position_tables,
    relative_bias_maps,
    rope_frequencies,
    rope_relative_scores,
)
from tformer.viz.plots import _new_figure, _save

MAX_ALIBI_HEADS = 8  # heat maps drawn at most; a model with more heads shows this many, spread evenly


def _sinusoidal(config: ModelConfig, model: nn.Module | None, length: int) -> Figure:
    table = sinusoidal_table(length, config.d_model, config.sinusoidal_base, config.sinusoidal_layout)
    figure = _new_figure(8, 4)
    ax = figure.subplots()
    image = ax.imshow(table.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_title(f"sinusoidal positions: {config.sinusoidal_layout} layout, base {config.sinusoidal_base:g}")
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    figure.colorbar(image, ax=ax)
    return figure


def _learned(config: ModelConfig, model: nn.Module | None, length: int) -> Figure:
    if model is None:
        raise ConfigError(
            "this model learns its positions, and a preset or config file has no trained table (its weights are "
            "random until trained); pass a checkpoint directory, or a training run directory, to draw its table"
        )
    tables = learned_position_tables(model)
    figure = _new_figure(8, 3.6 * len(tables))
    for ax, (stack, table) in zip(figure.subplots(len(tables), 1, squeeze=False)[:, 0], tables.items(), strict=True):
        rows = table[:length].float()
        # colours clip at the 99th percentile of |w|, or a few outlying weights wash the rest out (kthvalue, since
        # quantile refuses more than 16M elements)
        magnitudes = rows.abs().flatten()
        limit = magnitudes.kthvalue(max(1, int(0.99 * len(magnitudes)))).values.item() or 1.0
        image = ax.imshow(rows.numpy(), aspect="auto", cmap="RdBu", vmin=-limit, vmax=limit, interpolation="nearest")
        ax.set_title(
            f"learned positions ({stack}): the trained table, {len(rows)} of {len(table)} positions\n"
            "(colours clipped at the 99th percentile of |w|)"
        )
        ax.set_xlabel("dimension")
        ax.set_ylabel("position")
        figure.colorbar(image, ax=ax)
    return figure


def _rope(config: ModelConfig, model: nn.Module | None, length: int) -> Figure:
    frequencies = rope_frequencies(config, length)
    scores = rope_relative_scores(config, length)
    figure = _new_figure(11, 4)
    freq_ax, score_ax = figure.subplots(1, 2)
    pairs = range(len(frequencies.theta))
    freq_ax.semilogy(pairs, frequencies.unscaled, label=f"theta_i = {config.rope_theta:g}^(-2i/{config.head_dim})")
    if config.rope_scaling != "none":
        label = f"{config.rope_scaling} scaling, factor {config.rope_factor:g}"
        if config.rope_scaling == "dynamic-ntk":  # its base grows with the sequence, past the original context
            label += f", at {length} tokens (original {config.rope_original_max_len})"
        freq_ax.semilogy(pairs, frequencies.theta, "--", label=label)
    freq_ax.set_title("RoPE rotation frequency per pair")
    freq_ax.set_xlabel("pair i (dimensions i and i + head_dim/2)")
    freq_ax.set_ylabel("radians per position")
    freq_ax.legend(fontsize=8)
    freq_ax.grid(alpha=0.3, which="both")
    score_ax.plot(range(length), scores)
    title = "relative score q_m . k_0 / head_dim, q = k = 1"
    if frequencies.scale != 1.0:
        title += f"\n(cos and sin scaled by {frequencies.scale:.3g}: {frequencies.scale**2:.3g} at m = 0)"
    score_ax.set_title(title)
    score_ax.set_xlabel("distance m (positions)")
    score_ax.grid(alpha=0.3)
    return figure


def _alibi_heads(n_heads: int) -> list[int]:
    """The heads whose bias is drawn as a heat map: all of them, or MAX_ALIBI_HEADS spread from first to last."""
    if n_heads <= MAX_ALIBI_HEADS:
        return list(range(n_heads))
    return [round(i * (n_heads - 1) / (MAX_ALIBI_HEADS - 1)) for i in range(MAX_ALIBI_HEADS)]


def _alibi(config: ModelConfig, model: nn.Module | None, length: int) -> Figure:
    biases = alibi_biases(config, length)  # (H, length, length)
    slopes = alibi_slopes(config.n_heads)
    heads = _alibi_heads(config.n_heads)
    columns = 3
    rows = math.ceil((len(heads) + 1) / columns)
    figure = _new_figure(4 * columns, 3.4 * rows)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    lines = axes[0]
    for h in range(config.n_heads):
        lines.plot(range(length), biases[h, 0], label=f"head {h}: m = 2^{math.log2(slopes[h]):.3g}")
    lines.set_title("ALiBi bias -m_h * |i - j| per head")
    lines.set_xlabel("distance |i - j|")
    lines.legend(fontsize=5, ncol=2)
    lines.grid(alpha=0.3)
    lowest = biases.min().item()
    for ax, h in zip(axes[1:], heads, strict=False):
        image = ax.imshow(biases[h].numpy(), cmap="viridis", vmin=lowest, vmax=0, interpolation="nearest")
        ax.set_title(f"head {h}, slope {slopes[h].item():.4g}")
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    figure.colorbar(image, ax=ax, label="bias (one scale for all heads)")
    for ax in axes[len(heads) + 1 :]:
        ax.set_visible(False)
    return figure


def _t5(config: ModelConfig, model: nn.Module | None, length: int) -> Figure:
    if model is None:
        raise ConfigError(
            "T5 learns its bias per head and bucket of distance, and a preset or config file has no trained table; "
            "pass a checkpoint directory (or an HF T5 directory converted with tformer convert) to draw it"
        )
    maps = relative_bias_maps(model, length)  # stack -> (H, length, length)
    heads = _alibi_heads(config.n_heads)
    figure = _new_figure(3.2 * len(heads), 3.2 * len(maps))
    axes = figure.subplots(len(maps), len(heads), squeeze=False)
    for row, (stack, biases) in zip(axes, maps.items(), strict=True):
        limit = biases.abs().max().item() or 1.0
        for ax, h in zip(row, heads, strict=True):
            image = ax.imshow(biases[h].numpy(), cmap="RdBu", vmin=-limit, vmax=limit, interpolation="nearest")
            ax.set_title(f"{stack}, head {h}", fontsize=8)
            ax.set_xlabel("key j")
            ax.set_ylabel("query i")
        figure.colorbar(image, ax=row[-1], label="learned bias")
    figure.suptitle("T5 relative position bias: one learned scalar per head and bucket of distance j - i")
    return figure


def _none(config: ModelConfig, model: nn.Module | None, length: int) -> Figure:
    raise ConfigError(
        "nothing to draw: this model uses position 'none' (NoPE), so it adds no position vector, rotates no query "
        "and biases no score; the decoder's causal mask alone tells it the order of the tokens"
    )


POSITION_FIGURES: dict[str, Callable[[ModelConfig, nn.Module | None, int], Figure]] = {
    "sinusoidal": _sinusoidal,
    "learned": _learned,
    "rope": _rope,
    "alibi": _alibi,
    "t5": _t5,
    "none": _none,
}


def position_figure(source: ModelConfig | nn.Module, length: int = 100) -> Figure:
    """The figure of the position scheme of a config (a preset or config file) or of a loaded model.

    A learned table needs a model's weights: a config with learned positions raises ConfigError, as does
    position 'none', which has nothing to draw.
    """
    if length < 1:
        raise ConfigError(f"length is {length}; draw at least 1 position")
    model = None if isinstance(source, ModelConfig) else source
    config = source if model is None else model.config
    with torch.no_grad():
        return POSITION_FIGURES[config.position](config, model, length)


def plot_positions(source: ModelConfig | nn.Module, out: str | Path, length: int = 100) -> Path:
    """Draws `position_figure(source, length)` to the PNG file `out`."""
    return _save(position_figure(source, length), out)
