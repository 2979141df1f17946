"""Dequantizing one realistic GGUF tensor (2048 x 8192, a 1B model's FFN matrix): tformer's vectorized torch
(`tformer.interop.gguf_quants`) against the `gguf` package's numpy (`gguf.quants.dequantize`), for each type.

Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 blocks come from `gguf.quants.quantize`; the K-quants (gguf-py cannot quantize
them) are random blocks with finite f16 scales. Each side runs `--repeats` times, alternating; medians are printed
with their ratio (gguf's time over tformer's), after a check that both give the same floats.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/gguf_dequant.py
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch
from common import load_report, machine_info, median, set_threads
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tformer.interop.gguf_quants import DEQUANTIZERS

QUANTIZED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
K_QUANTS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # f16 byte offsets


def blocks_of(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(n_blocks, block_bytes) uint8 for a rows x cols tensor of `kind`."""
    block, block_bytes = GGML_QUANT_SIZES[kind]
    if kind in QUANTIZED:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        return gguf.quants.quantize(values, kind).view(np.uint8).reshape(-1, block_bytes)
    n_blocks = rows * cols // block
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for start in K_QUANTS[kind]:
        scale = (rng.standard_normal(n_blocks) * 1e-3).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    print(machine_info())
    print(f"{load_report('before')}; torch threads {threads}")
    print(f"tensor {args.rows} x {args.cols} ({args.rows * args.cols / 1e6:.1f}M values), medians of {args.repeats}")
    print(f"{'type':6} {'tformer ms':>11} {'gguf ms':>9} {'ratio':>7}  {'tformer GB/s out':>16}")
    rng = np.random.default_rng(0)
    for kind in (*QUANTIZED, *K_QUANTS):
        raw = blocks_of(kind, args.rows, args.cols, rng)
        ours_input = torch.from_numpy(raw)
        ours_out = DEQUANTIZERS[kind](ours_input)
        theirs_out = gguf.quants.dequantize(raw, kind)
        assert torch.equal(ours_out.reshape(-1), torch.from_numpy(theirs_out.astype(np.float32).reshape(-1))), kind
        ours, theirs = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            DEQUANTIZERS[kind](ours_input)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            gguf.quants.dequantize(raw, kind)
            theirs.append(time.perf_counter() - start)
        mine, peer = median(ours), median(theirs)
        rate = args.rows * args.cols * 4 / mine / 1e9
        print(f"{kind.name:6} {mine * 1e3:11.1f} {peer * 1e3:9.1f} {peer / mine:6.2f}x  {rate:16.2f}")
    print(load_report("after"))


if __name__ == "__main__":
    main()
