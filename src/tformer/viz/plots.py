"""Headless matplotlib figures written straight to PNG files.

Each figure is a `matplotlib.figure.Figure` drawn by its own `FigureCanvasAgg`: no pyplot state and no
`matplotlib.use`, so importing tformer (the trainer draws curves.png) leaves a notebook's backend alone.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

# the kinds of record a run's metrics.jsonl holds, each named by the key that tells it apart; the evaluation
# keys come first so that an evaluation record is never taken for a loss record
METRIC_KINDS = ("dev_bleu", "dev_ppl", "loss")


def read_metrics(metrics_file: str | Path) -> dict[str, list[dict]]:
    """A run's metrics.jsonl split by kind of record ("loss", "dev_bleu", "dev_ppl"), each sorted by step.

    A loss record ({"step", "loss", "lr", ...}) and an evaluation record ({"step", "dev_bleu" or "dev_ppl",
    ...}) of the same step are both kept. A resumed run logs some steps twice: the last record of each kind
    per step wins. Records of no known kind are skipped.
    """
    lines = Path(metrics_file).read_text(encoding="utf-8").splitlines()
    latest: dict[str, dict[int, dict]] = {kind: {} for kind in METRIC_KINDS}
    for record in (json.loads(line) for line in lines if line.strip()):
        kind = next((k for k in METRIC_KINDS if k in record), None)
        if kind is not None:
            latest[kind][record["step"]] = record
    return {kind: [by_step[step] for step in sorted(by_step)] for kind, by_step in latest.items()}


def _new_figure(width: float, height: float) -> Figure:
    """A figure with its own Agg canvas, so that `savefig` writes PNG without any global backend."""
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Figure, out: str | Path) -> Path:
    """Writes the figure as a PNG of at most 256 colours. Heat maps draw from 256-entry colour maps, so the
    palette shows the same picture in about a third of the bytes of a true-colour file."""
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=110, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256, dither=Image.Dither.NONE).save(out, format="PNG", optimize=True)
    return Path(out)


def plot_training_curves(metrics_file: str | Path, out: str | Path) -> Path:
    """Loss, learning rate and dev BLEU and/or dev perplexity against the step, from a run's metrics.jsonl.

    A translation run evaluates BLEU and a language-model run perplexity; the dev panels are drawn for the
    evaluations the run logged (none for a run without a dev set).
    """
    metrics = read_metrics(metrics_file)
    train = metrics["loss"]
    panels = [(train, "loss", "training loss (label-smoothed)"), (train, "lr", "learning rate")]
    if metrics["dev_bleu"]:
        panels.append((metrics["dev_bleu"], "dev_bleu", "dev BLEU"))
    if metrics["dev_ppl"]:
        panels.append((metrics["dev_ppl"], "dev_ppl", "dev perplexity"))
    figure = _new_figure(4.35 * len(panels), 3.6)
    for ax, (rows, key, title) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        is_dev = key.startswith("dev_")
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o" if is_dev else None)
        if key == "dev_ppl":
            ax.set_yscale("log")  # perplexity falls by orders of magnitude early in training
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _save(figure, out)


def plot_positional_encoding(table: torch.Tensor, out: str | Path) -> Path:
    """A (positions x dims) heat map of a positional-encoding table, like the seed's figure."""
    figure = _new_figure(8, 4)
    ax = figure.subplots()
    image = ax.imshow(table.detach().cpu().numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    figure.colorbar(image, ax=ax)
    return _save(figure, out)


def plot_attention(weights: torch.Tensor, queries: list[str], keys: list[str], out: str | Path) -> Path:
    """Attention weights (H, Tq, Tk) of one sequence as one heat map per head, labelled with tokens."""
    n_heads = weights.shape[0]
    figure = _new_figure(3.2 * n_heads, 3.4)
    for h, ax in enumerate(figure.subplots(1, n_heads, squeeze=False)[0]):
        ax.imshow(weights[h].detach().float().cpu().numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {h}")
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=6)
        ax.set_yticks(range(len(queries)), queries, fontsize=6)
    return _save(figure, out)


def plot_extrapolation(curves: dict[str, dict[int, float]], train_length: int, out: str | Path) -> Path:
    """Held-out perplexity against the evaluation context length, one line per model (name -> {length: ppl}),
    with the training length marked; both axes logarithmic, since perplexity past the training length can grow
    by orders of magnitude."""
    figure = _new_figure(8, 4.8)
    ax = figure.subplots()
    for name, points in curves.items():
        lengths = sorted(points)
        ax.plot(
            lengths, [points[n] for n in lengths], marker="o", label=name, linestyle="--" if "zero" in name else "-"
        )
    ax.axvline(train_length, color="grey", linewidth=1)
    ax.set_xscale("log", base=2)
    lengths = sorted({n for points in curves.values() for n in points})
    ax.set_xticks(lengths, [str(n) for n in lengths], minor=False)
    ax.set_xticks([], minor=True)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation context length (tokens); grey line: training length")
    ax.set_ylabel("held-out perplexity")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    return _save(figure, out)
