"""Plots: training curves, positional encodings and attention maps (matplotlib, headless)."""

from tformer.viz.plots import plot_attention, plot_positional_encoding, plot_training_curves, read_metrics

__all__ = ["plot_attention", "plot_positional_encoding", "plot_training_curves", "read_metrics"]
