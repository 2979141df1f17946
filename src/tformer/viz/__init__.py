"""Plots: training curves, position schemes and cross-attention maps (matplotlib, headless)."""

from tformer.viz.attention import attention_figure, plot_cross_attention
from tformer.viz.plots import plot_attention, plot_positional_encoding, plot_training_curves, read_metrics
from tformer.viz.positions import POSITION_FIGURES, plot_positions, position_figure

__all__ = [
    "POSITION_FIGURES",
    "attention_figure",
    "plot_attention",
    "plot_cross_attention",
    "plot_positional_encoding",
    "plot_positions",
    "plot_training_curves",
    "position_figure",
    "read_metrics",
]
