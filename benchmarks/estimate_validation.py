"""`tformer estimate` against measured training steps on this CPU: the live-tensor peak and the growth of RSS.

Each configuration of the grid (three families, several widths, depths, batch sizes and lengths, fp32 and bf16
autocast, activation checkpointing on and off) runs in a fresh process, which
- builds the model and runs one training step (creating the Adam state),
- measures a second step (zero_grad, forward, the label-smoothed loss, backward, clipping, fused Adam) with
  tformer.training.memory: the peak of live tensor bytes (a TorchDispatchMode that counts every storage an
  operator returns until it is freed) and the RSS high-water mark (VmHWM, reset before the step).

The estimate's total is compared with the live-tensor peak. The RSS growth during the step is compared with the
estimated growth (the total less the weights and optimizer state, resident before the step starts). The child
processes run with MALLOC_MMAP_THRESHOLD_=262144 so that glibc returns a freed tensor's pages to the kernel at once:
with its default, adaptive threshold freed blocks stay in the heap and RSS keeps an earlier step's high-water mark.

    .venv/bin/python benchmarks/estimate_validation.py --output benchmarks/results/estimate_validation.txt
    .venv/bin/python benchmarks/estimate_validation.py --only 3   # the first three configurations
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from common import set_threads  # benchmarks run as scripts: `python benchmarks/estimate_validation.py`
from train_step import Report

from tformer import ModelConfig
from tformer.info import format_bytes
from tformer.training.estimate import estimate_memory, format_estimate
from tformer.training.memory import measure_training_step

TOLERANCE = 0.15
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "262144"}

PAPER = {"preset": "tiny-transformer", "n_heads": 4}  # post-norm, ReLU, dropout 0.1 and attention dropout 0.1
MAIN_JOB = {**PAPER, "norm_placement": "pre", "dropout": 0.0, "attn_dropout": 0.0}  # configs/en-de-10min.yaml
GPT2 = {"preset": "tiny-gpt2", "n_heads": 4}  # pre-norm, tanh-GELU, learned positions, both dropouts 0.1
LLAMA = {"preset": "tiny-llama", "n_heads": 4, "n_kv_heads": 2}  # RMSNorm, RoPE, SwiGLU, GQA, no dropout
BERT = {"preset": "tiny-bert", "n_heads": 4}  # post-norm, GELU, embedding norm, MLM head, both dropouts 0.1


def _model(base: dict, d: int, layers: int, vocab: int = 4000, **extra: object) -> dict:
    sizes = {"d_model": d, "d_ff": 4 * d, "vocab_size": vocab, "max_seq_len": 1024}
    if base["preset"] == "tiny-transformer":
        sizes |= {"n_encoder_layers": layers, "n_decoder_layers": layers}
    elif base["preset"] == "tiny-bert":
        sizes |= {"n_encoder_layers": layers}
    else:
        sizes |= {"n_decoder_layers": layers}
    if base["preset"] == "tiny-llama":
        sizes["d_ff"] = 8 * d // 3
    return {**base, **sizes, **extra}


# (label, model config, batch tokens, sequence length, dtype, activation checkpointing)
GRID = [
    ("paper enc-dec", _model(PAPER, 128, 2), 2048, 64, "fp32", False),
    ("paper enc-dec", _model(PAPER, 256, 3), 4096, 128, "fp32", True),
    ("paper enc-dec", _model(PAPER, 256, 2), 2048, 256, "bf16-autocast", False),
    ("paper enc-dec", _model(PAPER, 128, 2), 2048, 512, "fp32", False),
    ("main-job enc-dec", _model(MAIN_JOB, 256, 3), 2048, 128, "bf16-autocast", False),
    ("main-job enc-dec", _model(MAIN_JOB, 256, 3), 4096, 64, "bf16-autocast", True),
    ("main-job enc-dec", _model(MAIN_JOB, 384, 2, vocab=8000), 4096, 256, "fp32", False),
    ("main-job enc-dec", _model(MAIN_JOB, 256, 2), 4096, 512, "bf16-autocast", False),
    ("main-job enc-dec", _model(MAIN_JOB, 128, 6), 8192, 128, "fp32", False),
    ("gpt2 decoder", _model(GPT2, 128, 4), 4096, 128, "fp32", False),
    ("gpt2 decoder", _model(GPT2, 256, 4), 4096, 256, "bf16-autocast", False),
    ("gpt2 decoder", _model(GPT2, 256, 6), 8192, 512, "fp32", True),
    ("gpt2 decoder", _model(GPT2, 384, 2), 2048, 256, "bf16-autocast", True),
    ("gpt2 decoder, ALiBi", _model(GPT2, 256, 4, position="alibi"), 4096, 128, "fp32", False),
    ("llama decoder", _model(LLAMA, 256, 4), 4096, 256, "fp32", False),
    ("llama decoder", _model(LLAMA, 256, 4), 8192, 512, "bf16-autocast", False),
    ("llama decoder", _model(LLAMA, 384, 6), 4096, 128, "bf16-autocast", True),
    ("llama decoder", _model(LLAMA, 128, 2), 2048, 64, "fp32", True),
    ("llama decoder, math attention", _model(LLAMA, 256, 4, attention_backend="math"), 4096, 256, "fp32", False),
    ("llama decoder", _model(LLAMA, 256, 4), 4096, 1024, "fp32", False),
    ("llama decoder, pure bf16", _model(LLAMA, 256, 4), 4096, 256, "bf16-pure", False),
    ("bert encoder", _model(BERT, 128, 2), 2048, 64, "fp32", False),
    ("bert encoder", _model(BERT, 256, 4), 4096, 128, "bf16-autocast", False),
    ("bert encoder", _model(BERT, 256, 4), 4096, 256, "fp32", True),
    ("bert encoder", _model(BERT, 256, 4), 4096, 512, "bf16-autocast", False),
    ("bert encoder", _model(BERT, 128, 6), 8192, 64, "bf16-autocast", True),
]


def run_one(row: list) -> dict:
    """Measures one configuration of the grid (in this process) and estimates it; returns the figures."""
    _, model, batch_tokens, seq_len, dtype, checkpointing = row
    config = ModelConfig.from_dict({**model, "activation_checkpointing": checkpointing})
    started = time.perf_counter()
    measured = measure_training_step(config, batch_tokens // seq_len, seq_len, dtype)
    estimate = estimate_memory(config, batch_tokens, seq_len, dtype, device="cpu")
    return {
        "estimate": estimate.total,
        "estimated_growth": estimate.total - estimate.weights - estimate.optimizer_state,
        "peak": measured.peak_bytes,
        "rss_growth": measured.rss_growth,
        "seconds": time.perf_counter() - started,
    }


def run_in_child(row: tuple, threads: int) -> dict:
    command = [sys.executable, __file__, "--child", json.dumps(row), "--threads", str(threads)]
    env = {**os.environ, **MALLOC_ENV}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"configuration {row[0]} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(row: tuple) -> str:
    label, model, batch_tokens, seq_len, dtype, checkpointing = row
    layers = model.get("n_decoder_layers") if "n_encoder_layers" not in model else model["n_encoder_layers"]
    return (
        f"{label:30s} d{model['d_model']:<4d} L{layers:<2d} {batch_tokens:5d} x {seq_len:<5d}"
        f"{dtype:14s}{'ckpt' if checkpointing else '    '}"
    )


def ratio_summary(out: Report, name: str, ratios: list[float]) -> None:
    inside = sum(abs(r - 1) <= TOLERANCE for r in ratios)
    worst = max(ratios, key=lambda r: abs(r - 1))
    out(
        f"{name}: {inside} of {len(ratios)} within +-{TOLERANCE:.0%} ({inside / len(ratios):.0%}; goal >= 90%), "
        f"worst ratio {worst:.3f}, range {min(ratios):.3f} .. {max(ratios):.3f}"
    )


def large_models(out: Report) -> None:
    """The standard mixed-precision Adam setup (ZeRO paper): half weights and gradients, fp32 master and states."""
    out("\nlarge models, mixed-precision Adam (bf16 weights and gradients, fp32 master weights, m and v), CUDA:")
    for name, seq_len in (("llama2-7b", 4096), ("gpt3-175b", 2048)):
        config = ModelConfig.from_preset(name)
        for checkpointing in (False, True):
            estimate = estimate_memory(config, seq_len, seq_len, "bf16-mixed", checkpointing, device="cuda")
            out(format_estimate(name, config, estimate))
            out(f"                 ({estimate.model_states / estimate.n_params:.6f} bytes per parameter)\n")
        for stage, world in ((3, 8), (3, 64)):
            estimate = estimate_memory(config, seq_len, seq_len, "bf16-mixed", True, stage, world, device="cuda")
            out(f"{name}, ZeRO-3 over {world} ranks, checkpointing on: peak {format_bytes(estimate.total)} per rank")
        out("")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: os.cpu_count())")
    p.add_argument("--only", type=int, default=0, help="run only the first N configurations")
    p.add_argument("--output", type=Path, default=None, help="also write the report to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    if args.child:
        print(json.dumps(run_one(json.loads(args.child))))
        return 0
    out = Report(args.output)
    out.header("estimate_validation: tformer estimate against measured training steps (live-tensor peak, RSS)")
    out(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; children run with {MALLOC_ENV}")
    out(
        "one step = zero_grad, forward, label-smoothed loss, backward, clip, fused Adam; measured after a first "
        "step;\nratio = estimate / measured; RSS columns: growth during the step vs estimated growth\n"
    )
    out(
        f"{'configuration':30s} {'size':9s}{'tokens x T':14s}{'dtype':14s}    {'estimate':>10s} {'peak':>10s} "
        f"{'ratio':>6s}  {'est. growth':>11s} {'RSS growth':>10s} {'ratio':>6s} {'s':>5s}"
    )
    grid = GRID[: args.only] if args.only else GRID
    peaks, rss, started = [], [], time.perf_counter()
    for row in grid:
        r = run_in_child(row, threads)
        peaks.append(r["estimate"] / r["peak"])
        rss.append(r["estimated_growth"] / r["rss_growth"])
        mib = 2**20
        out(
            f"{describe(row)} {r['estimate'] / mib:8.1f}Mi {r['peak'] / mib:8.1f}Mi {peaks[-1]:6.3f}  "
            f"{r['estimated_growth'] / mib:9.1f}Mi {r['rss_growth'] / mib:8.1f}Mi {rss[-1]:6.3f} {r['seconds']:5.1f}"
        )
    out("")
    ratio_summary(out, "live-tensor peak", peaks)
    ratio_summary(out, "RSS growth", rss)
    out(f"grid time {time.perf_counter() - started:.0f} s for {len(grid)} configurations")
    large_models(out)
    out.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
