"""A translation's cross-attention map drawn: one heat map per decoder layer and head, each layer's mean over its
heads, and the mean over everything. The data comes from `tformer.decoding.attention_map.cross_attention_map`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tformer.viz.plots import _new_figure, _save

if TYPE_CHECKING:  # only named here: importing the inference package would load Dynamo for every plot
    from tformer.decoding.attention_map import CrossAttentionMap

PANEL_INCHES = 2.3  # a heat map's side, enough for about 30 token labels


def _heat_map(
    ax: Axes, weights: torch.Tensor, title: str, keys: list[str] | None = None, queries: list[str] | None = None
) -> None:
    """One (out_len, src_len) map; source tokens label the x axis and output tokens the y axis where given."""
    ax.imshow(weights.numpy(), cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title, fontsize=8)
    ax.set_xticks(range(weights.shape[1]), keys or [], rotation=90, fontsize=5)
    ax.set_yticks(range(weights.shape[0]), queries or [], fontsize=5)


def attention_figure(attention: CrossAttentionMap) -> Figure:
    """The map as a grid: a row per decoder layer with a column per head and one for the layer's head mean, and
    a last row with the mean over all layers and heads (output tokens down, source tokens across)."""
    n_layers, n_heads = attention.weights.shape[:2]
    columns = n_heads + 1
    figure = _new_figure(PANEL_INCHES * columns, PANEL_INCHES * (n_layers + 1))
    axes = figure.subplots(n_layers + 1, columns, squeeze=False)
    src, out = attention.source_tokens, attention.output_tokens
    for layer in range(n_layers):
        for head in range(n_heads):
            keys = src if layer == n_layers - 1 else None
            queries = out if head == 0 else None
            _heat_map(axes[layer, head], attention.weights[layer, head], f"layer {layer} head {head}", keys, queries)
        mean = attention.weights[layer].mean(0)
        _heat_map(axes[layer, n_heads], mean, f"layer {layer}, mean of heads", src if layer == n_layers - 1 else None)
    _heat_map(axes[n_layers, 0], attention.mean(), "mean of all layers and heads", src, out)
    for ax in axes[n_layers, 1:]:
        ax.set_visible(False)
    figure.suptitle("cross-attention: which source token each output token attends to", fontsize=10)
    return figure


def plot_cross_attention(attention: CrossAttentionMap, out: str | Path) -> Path:
    """Draws `attention_figure(attention)` to the PNG file `out`."""
    return _save(attention_figure(attention), out)
