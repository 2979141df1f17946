"""Figures: training curves read every kind of metrics record, and tformer never changes matplotlib's backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from helpers import assert_png

from tformer.viz import plot_attention, plot_positional_encoding, plot_training_curves, read_metrics


def loss(step: int, value: float) -> dict:
    return {"step": step, "loss": value, "lr": step * 1e-4, "tokens_per_s": 100.0}


def bleu(step: int, value: float) -> dict:
    return {"step": step, "dev_bleu": value, "dev_sentences": 4}


def ppl(step: int, value: float) -> dict:
    return {"step": step, "dev_ppl": value, "dev_sentences": 4}


def write_metrics(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_metrics_keep_loss_bleu_and_perplexity_of_one_step_and_the_last_of_a_resumed_step(tmp_path: Path) -> None:
    metrics = write_metrics(
        tmp_path / "metrics.jsonl",
        [
            loss(10, 5.0),
            bleu(10, 1.0),
            ppl(10, 90.0),
            loss(20, 4.0),
            bleu(20, 2.0),
            ppl(20, 50.0),
            # killed after step 20 and resumed from the checkpoint at step 10: step 20 is logged again
            loss(20, 3.9),
            bleu(20, 2.5),
            ppl(20, 45.0),
            loss(30, 3.0),
            ppl(30, 30.0),
            {"step": 30, "note": "a record of no known kind"},
        ],
    )
    assert read_metrics(metrics) == {
        "loss": [loss(10, 5.0), loss(20, 3.9), loss(30, 3.0)],
        "dev_bleu": [bleu(10, 1.0), bleu(20, 2.5)],
        "dev_ppl": [ppl(10, 90.0), ppl(20, 45.0), ppl(30, 30.0)],
    }
    assert_png(plot_training_curves(metrics, tmp_path / "curves.png"))


def test_curves_of_a_language_model_run_and_of_a_run_without_dev_set(tmp_path: Path) -> None:
    clm = write_metrics(tmp_path / "clm.jsonl", [loss(10, 5.0), ppl(10, 80.0)])
    assert [r["dev_ppl"] for r in read_metrics(clm)["dev_ppl"]] == [80.0]
    assert read_metrics(clm)["dev_bleu"] == []
    assert_png(plot_training_curves(clm, tmp_path / "clm.png"))
    no_dev = write_metrics(tmp_path / "no-dev.jsonl", [loss(10, 5.0), loss(20, 4.0)])
    assert_png(plot_training_curves(no_dev, tmp_path / "no-dev.png"))


def test_other_figures_are_png_files(tmp_path: Path) -> None:
    assert_png(
        plot_positional_encoding(
            torch.sin(torch.arange(64.0)[:, None] / (1 + torch.arange(16.0))), tmp_path / "positions.png"
        )
    )
    weights = torch.softmax(torch.randn(2, 3, 4), -1)
    assert_png(plot_attention(weights, ["a", "b", "c"], ["w", "x", "y", "z"], tmp_path / "attention.png"))


def test_importing_tformer_leaves_the_matplotlib_backend_alone(tmp_path: Path) -> None:
    # a notebook picks its backend before importing tformer; "pdf" stands in for an interactive one
    script = f"""
import sys, matplotlib
matplotlib.use("pdf")
import tformer.training, tformer.viz
assert matplotlib.get_backend() == "pdf", matplotlib.get_backend()
assert "matplotlib.pyplot" not in sys.modules, "tformer imported pyplot"
path = tformer.viz.plot_training_curves({str(write_metrics(tmp_path / "m.jsonl", [loss(1, 2.0)]))!r}, "c.png")
assert matplotlib.get_backend() == "pdf", matplotlib.get_backend()
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert_png(tmp_path / "c.png")
