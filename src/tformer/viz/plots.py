"""Headless matplotlib figures written straight to PNG files."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def _read_metrics(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    latest: dict[tuple, dict] = {}
    for record in records:  # a resumed run logs some steps twice: keep the last of each kind
        latest[(record["step"], "dev_bleu" in record)] = record
    return sorted(latest.values(), key=lambda r: r["step"])


def plot_training_curves(metrics_file: str | Path, out: str | Path) -> Path:
    """Loss, learning rate and dev BLEU against the step, from a run's metrics.jsonl."""
    records = _read_metrics(Path(metrics_file))
    train = [r for r in records if "loss" in r]
    dev = [r for r in records if "dev_bleu" in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [(train, "loss", "training loss (label-smoothed)"), (train, "lr", "learning rate"),
              (dev, "dev_bleu", "dev BLEU")]
    for ax, (rows, key, title) in zip(axes, panels):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o" if key == "dev_bleu" else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def plot_positional_encoding(table: torch.Tensor, out: str | Path) -> Path:
    """A (positions x dims) heat map of a positional-encoding table, like the seed's figure."""
    fig, ax = plt.subplots(figsize=(8, 4))
    image = ax.imshow(table.detach().cpu().numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def plot_attention(weights: torch.Tensor, queries: list[str], keys: list[str], out: str | Path) -> Path:
    """Attention weights (H, Tq, Tk) of one sequence as one heat map per head, labelled with tokens."""
    n_heads = weights.shape[0]
    fig, axes = plt.subplots(1, n_heads, figsize=(3.2 * n_heads, 3.4), squeeze=False)
    for h, ax in enumerate(axes[0]):
        ax.imshow(weights[h].detach().float().cpu().numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {h}")
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=6)
        ax.set_yticks(range(len(queries)), queries, fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
