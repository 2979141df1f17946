"""What `train.histogram_every` costs: TensorBoard histograms of every weight and gradient of the main recipe's model
(configs/en-de-10min.yaml) against one fp32 training step of the same model on the recipe's token budget.

The two alternate (a step, then the histograms the trainer would write after it), so a change of load hits both; the
ratio is the figure to read: with `histogram_every: N` the histograms add about ratio / N to the training time.

    .venv/bin/python benchmarks/tensorboard_cost.py          # under a minute on 2 quiet cores
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import load_report, machine_info

from tformer.models import build_model
from tformer.training import load_recipe
from tformer.training.sinks import MetricsSinks

ROUNDS = 5
PAIRS, LENGTH = 64, 32  # 2,048 target tokens: the recipe's max_tokens


def main() -> None:
    print(machine_info())
    print(load_report("before"))
    model_config, _ = load_recipe(Path(__file__).resolve().parent.parent / "configs" / "en-de-10min.yaml")
    torch.manual_seed(0)
    model = build_model(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    src = torch.randint(4, model_config.vocab_size, (PAIRS, LENGTH))
    tgt = torch.randint(4, model_config.vocab_size, (PAIRS, LENGTH + 1))

    def step() -> None:
        logits = model(src, tgt[:, :-1])  # (PAIRS, LENGTH, vocab)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay for the histograms, as after a trainer step

    with tempfile.TemporaryDirectory() as directory:
        sinks = MetricsSinks(["tensorboard"], Path(directory), model, histogram_every=1)
        step()  # warm-up
        steps, histograms = [], []
        for i in range(1, ROUNDS + 1):
            started = time.perf_counter()
            step()
            steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            sinks.write({"step": i, "loss": 0.0})  # one scalar, then every weight's and gradient's histogram
            sinks.sinks[0].writer.flush()  # the event file written, not just queued
            histograms.append(time.perf_counter() - started)
        sinks.close()
    n = sum(p.numel() for p in model.parameters())
    s, h = statistics.median(steps), statistics.median(histograms)
    print(
        f"{n:,} parameters, {torch.get_num_threads()} torch threads: training step (fp32, {PAIRS * LENGTH:,} target "
        f"tokens) {s:.2f} s, weight and gradient histograms {h:.2f} s = {h / s:.2f} steps (medians of {ROUNDS})"
    )
    print(load_report("after"))


if __name__ == "__main__":
    main()
