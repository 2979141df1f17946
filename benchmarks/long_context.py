"""Training memory and time at long lengths: tformer's block-wise masks against one dense (B, 1|H, T, T) mask.

    .venv/bin/python benchmarks/long_context.py                        # 1k, 4k, 16k tokens; about 15 minutes
    .venv/bin/python benchmarks/long_context.py --lengths 1024 4096 --schemes rope alibi

The model is a small decoder LM (2 layers, d_model 256, 4 heads of 64, vocabulary 512, fp32) trained on a batch of
2 rows, the second padded from 3/4 of its length on: training batches carry a padding mask, which is what made
every batch build a T x T bias before. One forward + backward per measurement:
- blocks: tformer as it is (layers/masks.py, chunked_attention: blocks of 512 queries, each builds its own bias);
- dense: the same model with the whole bias built once (DENSE_BIAS_MAX_ENTRIES raised), then torch's SDPA with
  that mask: the path every padded batch took before 2026-12-01.
Each (scheme, variant, length) runs in a fresh process; the memory printed is its peak resident memory (VmHWM,
reset before the first step) minus its resident memory before it, and the time the median of the repeats after
one warm-up. A dense run whose bias alone would pass --dense-max-gib is skipped and says why.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from common import cpu_flags, load_report, median, set_threads

from tformer import ModelConfig, build_model
from tformer.layers import masks
from tformer.training.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

SCHEMES = {  # name -> ModelConfig overrides
    "sinusoidal": dict(position="sinusoidal"),
    "learned": dict(position="learned"),
    "rope": dict(position="rope"),
    "alibi": dict(position="alibi"),
    "rope + window 1024": dict(position="rope", sliding_window=1024),
}


def measure_one(scheme: str, variant: str, length: int, repeats: int) -> dict[str, float]:
    set_threads()
    torch.manual_seed(0)
    config = ModelConfig(
        family="decoder",
        vocab_size=512,
        d_model=256,
        n_heads=4,
        d_ff=1024,
        n_decoder_layers=2,
        max_seq_len=length,
        dropout=0.0,
        norm_placement="pre",
        **SCHEMES[scheme],
    )
    model = build_model(config).train()
    if variant == "dense":
        masks.DENSE_BIAS_MAX_ENTRIES = length * length
    ids = torch.randint(1, 512, (2, length))
    padding = torch.ones(2, length, dtype=torch.long)
    padding[1, 3 * length // 4 :] = 0

    def step() -> None:
        model(ids, padding).logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    before = rss_bytes()
    reset_peak_rss()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_mib": (peak_rss_bytes() - before) / 2**20, "seconds": median(times[1:])}


def dense_bias_gib(scheme: str, length: int) -> float:
    heads = 4 if scheme == "alibi" else 1
    return 2 * heads * length * length * 4 / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dense-max-gib", type=float, default=6.0)
    parser.add_argument("--one", nargs=3, metavar=("SCHEME", "VARIANT", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        scheme, variant, length = args.one
        print(json.dumps(measure_one(scheme, variant, int(length), args.repeats)))
        return
    print(load_report("before"))
    print(f"CPU flags: {cpu_flags()}")
    print("\n| scheme | tokens | blocks: s | blocks: MiB | dense: s | dense: MiB | memory dense / blocks |")
    print("|---|---|---|---|---|---|---|")
    for scheme in args.schemes:
        for length in args.lengths:
            cells = {}
            for variant in ("blocks", "dense"):
                if variant == "dense" and dense_bias_gib(scheme, length) > args.dense_max_gib:
                    cells[variant] = None
                    continue
                command = [
                    sys.executable,
                    __file__,
                    "--one",
                    scheme,
                    variant,
                    str(length),
                    "--repeats",
                    str(args.repeats),
                ]
                output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                cells[variant] = json.loads(output.strip().splitlines()[-1])
            blocks, dense = cells["blocks"], cells["dense"]
            if dense is None:
                dense_cells = f"skipped: bias alone {dense_bias_gib(scheme, length):.1f} GiB | | "
            else:
                ratio = dense["peak_mib"] / blocks["peak_mib"]
                dense_cells = f"{dense['seconds']:.2f} | {dense['peak_mib']:.0f} | {ratio:.1f}x"
            print(
                f"| {scheme} | {length} | {blocks['seconds']:.2f} | {blocks['peak_mib']:.0f} | {dense_cells} |",
                flush=True,
            )
    print(load_report("after"))


if __name__ == "__main__":
    main()
