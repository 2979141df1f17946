"""Activation checkpointing measured: peak memory and step time of one training step with and without it.

    .venv/bin/python benchmarks/activation_checkpointing.py                   # 256, 1k, 4k tokens; about 5 minutes
    .venv/bin/python benchmarks/activation_checkpointing.py --lengths 256 1024 --rounds 3

The seed claims "memory -50%, speed -20%". The model is the LLaMA-style pretraining recipe's
(configs/llama-small-clm.yaml: 4 layers, d_model 256, RoPE, RMSNorm, SwiGLU, tied, vocabulary 4,000) with
max_seq_len raised to the longest length, trained as the recipe trains it: bf16 autocast, AdamW, gradient
clipping. Every step takes the same 4,096 tokens (16 x 256, 4 x 1,024, 1 x 4,096 by default), so the lengths
differ only in how long each sequence is. `model.activation_checkpointing` recomputes each block's forward in
the backward pass (torch.utils.checkpoint, non-reentrant), keeping only the block inputs.

Memory: each (length, mode) runs in a fresh process (the RSS high-water mark is per process, and the allocator
keeps pages a previous step freed), one warm-up step to create the optimizer state, then one measured step:
- live-tensor peak: the bytes of all live tensor storages at their highest during the step, weights, gradients,
  optimizer state and batch included (tformer.training.memory.LiveTensorTracker); "step growth" is that peak
  minus what was live before the step (activations, gradients, temporaries);
- peak RSS: the process's resident-memory high-water mark during the step minus its RSS before it.
Time: both modes' models (same initial weights) in this process, one warm-up round, then `--rounds` steps of
each, alternated step by step (the order swapped every round); the median of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
from common import alternating_timing, load_report, machine_info, median, set_threads

from tformer import ModelConfig, build_model
from tformer.training import load_recipe
from tformer.training.evaluate import forward_logits
from tformer.training.losses import label_smoothed_cross_entropy
from tformer.training.memory import measure_training_step, synthetic_batch
from tformer.training.optim import adamw_cosine

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "llama-small-clm.yaml"
MODES = {"off": False, "on": True}


def model_config(max_len: int, vocab_size: int = 4000) -> ModelConfig:
    """The recipe's model with the vocabulary its BPE gets and room for `max_len` positions."""
    model, _ = load_recipe(RECIPE)
    return replace(model, vocab_size=vocab_size, max_seq_len=max_len, pad_token_id=0)


def measure_memory(length: int, batch_size: int, checkpointing: bool, max_len: int) -> dict:
    """One measured step in this process (called in a fresh subprocess by `memory_in_subprocess`)."""
    config = replace(model_config(max_len), activation_checkpointing=checkpointing)
    step = measure_training_step(config, batch_size, length, dtype="bf16-autocast", optimizer="adamw")
    return {
        "live_peak": step.peak_bytes,
        "live_growth": step.peak_bytes - step.start_bytes,
        "rss_growth": step.rss_growth,
    }


def memory_in_subprocess(length: int, batch_size: int, mode: str, max_len: int) -> dict:
    command = [sys.executable, __file__, "--memory-probe", str(length), str(batch_size), mode, str(max_len)]
    result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(result.stdout.strip().splitlines()[-1])


def training_step(config: ModelConfig, batch_size: int, length: int):
    """A callable doing one training step of a model built from `config` on a fixed synthetic batch."""
    torch.manual_seed(0)
    model = build_model(config).train()
    optimizer, _ = adamw_cosine(model, 1e-3, 10, 100)
    batch = synthetic_batch(config, batch_size, length)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            logits = forward_logits(model, batch)
        loss_sum, n_tokens = label_smoothed_cross_entropy(logits, batch.labels, 0.0)
        (loss_sum / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step: batch size = tokens // length")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps of each mode, alternated")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    parser.add_argument("--memory-probe", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = set_threads()
    if args.memory_probe:
        length, batch_size, mode, max_len = args.memory_probe
        print(json.dumps(measure_memory(int(length), int(batch_size), MODES[mode], int(max_len))))
        return
    max_len = max(args.lengths)
    lines = [
        "activation checkpointing: one training step with and without it (model.activation_checkpointing)",
        f"machine: {machine_info()}",
        f"model: configs/llama-small-clm.yaml's, vocabulary 4,000, max_seq_len {max_len}; bf16 autocast, AdamW; "
        f"{args.tokens} tokens a step; {threads} threads",
        load_report("before"),
        "",
        "| length | batch | mode | live-tensor peak | step growth (live) | peak RSS growth | step time (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    ratios = []
    for length in args.lengths:
        batch_size = max(1, args.tokens // length)
        memory = {mode: memory_in_subprocess(length, batch_size, mode, max_len) for mode in MODES}
        base = model_config(max_len)
        steps = {
            mode: training_step(replace(base, activation_checkpointing=on), batch_size, length)
            for mode, on in MODES.items()
        }
        timings = alternating_timing(steps, args.rounds, warmup=1)
        seconds = {mode: median(times) for mode, times in timings.items()}
        for mode in MODES:
            m, all_times = memory[mode], ", ".join(f"{t:.2f}" for t in timings[mode])
            row = (
                f"| {length} | {batch_size} | {mode} | {mib(m['live_peak'])} | {mib(m['live_growth'])} | "
                f"{mib(m['rss_growth'])} | {seconds[mode]:.3f} s ({all_times}) |"
            )
            lines.append(row)
            print(row, flush=True)
        on, off = memory["on"], memory["off"]
        ratios.append(
            f"| {length} | {on['live_peak'] / off['live_peak']:.2f}x | {on['live_growth'] / off['live_growth']:.2f}x "
            f"| {on['rss_growth'] / max(off['rss_growth'], 1):.2f}x | {seconds['on'] / seconds['off']:.2f}x |"
        )
    tail = [
        "",
        "ratios, checkpointing on / off (below 1: less memory; above 1: slower)",
        "",
        "| length | live-tensor peak | step growth (live) | peak RSS growth | step time |",
        "|---|---|---|---|---|",
        *ratios,
        "",
        load_report("after"),
    ]
    print("\n".join(tail))
    lines += tail
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
