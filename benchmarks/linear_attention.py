"""Performer (FAVOR+) attention against softmax attention: error against the number of features, and time and peak
memory of one layer's forward + backward at growing lengths.

    .venv/bin/python benchmarks/linear_attention.py                     # both tables, about 6 minutes on 2 busy cores
    .venv/bin/python benchmarks/linear_attention.py --skip-errors --lengths 1024 4096

Each (variant, length) runs in a fresh process, so that its peak resident memory (VmHWM, reset just before the
first forward) belongs to it alone; the figure printed is that peak minus the resident memory before the forward
(model, input and torch itself excluded). Times are medians of the repeats after one warm-up step. Variants:
- performer: PerformerAttention, causal prefix-sum form, fp32 features and sums;
- sdpa: softmax attention through torch's fused kernel with is_causal (flash attention on the CPU: no T x T matrix);
- math: softmax attention written out, which keeps the (H, T, T) scores and weights for backward.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import torch
from common import load_report, median, set_threads

from tformer import ModelConfig
from tformer.layers.attention import Attention
from tformer.layers.linear_attention import PerformerAttention, favor_attention, orthogonal_random_features
from tformer.layers.masks import AttentionMask
from tformer.training.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

FEATURE_COUNTS = (16, 64, 256, 1024)


def measure_one(variant: str, length: int, args: argparse.Namespace) -> dict[str, float]:
    """One layer's forward + backward at `length` tokens: peak extra memory (MiB) and median seconds."""
    set_threads(args.threads)
    torch.manual_seed(0)
    backend = "math" if variant == "math" else "sdpa"
    config = ModelConfig(
        family="decoder",
        d_model=args.d_model,
        n_heads=args.heads,
        max_seq_len=length,
        attention="performer" if variant == "performer" else "softmax",
        attention_backend=backend,
        performer_features=args.features,
        position="rope",
    )
    layer = PerformerAttention(config) if variant == "performer" else Attention(config)
    x = torch.randn(1, length, args.d_model, requires_grad=True)
    mask = AttentionMask(is_causal=True)

    def step() -> None:
        layer(x, mask).square().mean().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    before = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    peak = peak_rss_bytes()
    times = []
    for _ in range(args.repeats - 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_mib": (peak - before) / 2**20, "seconds": median(times) if times else first}


def favor_errors(head_dim: int, logit_std: float, length: int, seeds: int) -> tuple[float, list[tuple[float, float]]]:
    """The RMS error of uniform causal averaging (all logits 0) against softmax, and (mean, std over feature draws)
    of the RMS error of causal FAVOR+ against softmax, per feature count.

    q and k are Gaussian with standard deviation sqrt(logit_std), so q . k / sqrt(head_dim) has std logit_std;
    values are unit Gaussians, so errors are in units of their standard deviation.
    """
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, length, head_dim, generator=generator) for _ in range(3))
    q, k = q * logit_std**0.5, k * logit_std**0.5
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    reference = torch.softmax(scores, dim=-1) @ v
    uniform = torch.softmax(scores.masked_fill(scores.isfinite(), 0.0), dim=-1) @ v  # the mean of earlier values
    rows = []
    for m in FEATURE_COUNTS:
        errors = torch.tensor(
            [
                float(
                    (favor_attention(q, k, v, orthogonal_random_features(m, head_dim, s), True) - reference)
                    .square()
                    .mean()
                )
                ** 0.5
                for s in range(seeds)
            ]
        )
        rows.append((float(errors.mean()), float(errors.std())))
    return float((uniform - reference).square().mean()) ** 0.5, rows


def print_errors(args: argparse.Namespace) -> None:
    print(
        f"\nRMS error of causal FAVOR+ against softmax attention ({args.error_length} tokens, 4 heads, "
        f"{args.seeds} feature draws; values ~ N(0, 1))\n"
    )
    print("| head_dim | logit std | uniform average | " + " | ".join(f"{m} features" for m in FEATURE_COUNTS) + " |")
    print("|---|---|---|" + "---|" * len(FEATURE_COUNTS))
    for head_dim in (16, 64):
        for logit_std in (0.25, 0.5, 1.0):
            uniform, rows = favor_errors(head_dim, logit_std, args.error_length, args.seeds)
            cells = " | ".join(f"{mean:.4f} ± {std:.4f}" for mean, std in rows)
            print(f"| {head_dim} | {logit_std} | {uniform:.4f} | {cells} |", flush=True)


def print_costs(args: argparse.Namespace) -> None:
    print(
        f"\nOne causal attention layer, forward + backward, batch 1, d_model {args.d_model}, {args.heads} heads, "
        f"fp32, {args.threads} threads; performer with {args.features} features\n"
    )
    print("| tokens | variant | seconds | peak extra MiB | MiB per 1k tokens |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        for variant in args.variants:
            if variant == "math" and length > args.math_max:
                scores_gib = 2 * args.heads * length**2 * 4 / 2**30
                print(f"| {length} | math | skipped | scores + weights alone {scores_gib:.1f} GiB | |", flush=True)
                continue
            command = [sys.executable, __file__, "--one", variant, str(length), *forwarded(args)]
            result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            per_k = result["peak_mib"] / (length / 1024)
            print(
                f"| {length} | {variant} | {result['seconds']:.3f} | {result['peak_mib']:.0f} | {per_k:.1f} |",
                flush=True,
            )


def forwarded(args: argparse.Namespace) -> list[str]:
    return [
        "--d-model",
        str(args.d_model),
        "--heads",
        str(args.heads),
        "--features",
        str(args.features),
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--variants", nargs="+", default=["performer", "sdpa", "math"])
    parser.add_argument("--math-max", type=int, default=4096, help="longest length the math variant runs at")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--error-length", type=int, default=512)
    parser.add_argument("--skip-errors", action="store_true")
    parser.add_argument("--skip-costs", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args)))
        return
    print(f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(load_report("before"))
    if not args.skip_errors:
        print_errors(args)
    if not args.skip_costs:
        print_costs(args)
    print(load_report("after"))


if __name__ == "__main__":
    main()
