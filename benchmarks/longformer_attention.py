"""Longformer attention against dense attention: time and peak memory of one layer's forward + backward.

One self-attention layer (d_model 256, 4 heads of 64, fp32, batch 1, one global token, window 512 = 256 tokens
each side, HF's default), at several lengths, for:
- tformer's `LongformerAttention` (banded blocks, O(T * w));
- Hugging Face's `LongformerSelfAttention` (sliding chunks), the peer;
- tformer's dense `Attention` with the math backend (a materialized T x T score matrix);
- tformer's dense `Attention` with SDPA (torch's fused kernel: no T x T matrix in memory, but O(T^2) time).
Each (layer, length) runs in a fresh process; memory is its peak resident set (getrusage ru_maxrss) above the
size just before the first step, time the median of the timed steps. One torch thread, so that the other
processes sharing this machine disturb the figures less.

    .venv/bin/python benchmarks/longformer_attention.py                      # 1k, 4k, 16k tokens
    .venv/bin/python benchmarks/longformer_attention.py --lengths 1024 2048 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

D_MODEL, HEADS, WINDOW = 256, 4, 512
LAYERS = ("longformer", "hf-longformer", "dense-math", "dense-sdpa")
MATH_MAX_TOKENS = 8192  # beyond it the math backend's score matrices (4 heads, fp32) pass 12 GiB


def build(layer: str):
    """The layer and a function (x, is_global) -> output."""
    import torch

    from tformer import ModelConfig
    from tformer.layers import Attention, AttentionMask
    from tformer.layers.sparse_attention import LongformerAttention

    config = ModelConfig(
        family="encoder", n_decoder_layers=0, d_model=D_MODEL, n_heads=HEADS, attention_window=WINDOW, dropout=0.0
    )
    if layer == "longformer":
        module = LongformerAttention(ModelConfig(**{**config.to_dict(), "attention": "longformer"}))
        return module, lambda x, g: module(x, AttentionMask(global_tokens=g))
    if layer == "hf-longformer":
        from transformers import LongformerConfig
        from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

        hf = LongformerConfig(hidden_size=D_MODEL, num_attention_heads=HEADS, attention_window=[WINDOW])
        module = LongformerSelfAttention(hf, layer_id=0)

        def run(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            mask = g.float() * 10000.0  # HF's encoding: 0 local, > 0 global, < 0 padding
            return module(x, mask, is_index_masked=mask < 0, is_index_global_attn=g, is_global_attn=True)[0]

        return module, run
    module = Attention(ModelConfig(**{**config.to_dict(), "attention_backend": layer.removeprefix("dense-")}))
    return module, lambda x, g: module(x, AttentionMask())


def measure(layer: str, tokens: int, steps: int) -> dict[str, float]:
    """Runs in a child process: median seconds of forward + backward and peak MiB above the start."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module, run = build(layer)
    x = torch.randn(1, tokens, D_MODEL, requires_grad=True)
    is_global = torch.zeros(1, tokens, dtype=torch.bool)
    is_global[0, 0] = True  # a classification token
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = []
    for _ in range(steps + 1):  # the first step warms up
        begin = time.perf_counter()
        run(x, is_global).square().mean().backward()
        seconds.append(time.perf_counter() - begin)
        x.grad = None
        module.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - start
    return {"seconds": statistics.median(seconds[1:]), "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("LAYER", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.steps)))
        return
    print(f"load before: {os.getloadavg()}")
    print("| tokens | " + " | ".join(f"{layer} s / MiB" for layer in LAYERS) + " |")
    print("|---" * (len(LAYERS) + 1) + "|")
    for tokens in args.lengths:
        cells = []
        for layer in LAYERS:
            if layer == "dense-math" and tokens > MATH_MAX_TOKENS:
                cells.append("not run")
                continue
            command = [sys.executable, __file__, "--steps", str(args.steps), "--child", layer, str(tokens)]
            result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            cells.append(f"{result['seconds']:.3f} s / {result['peak_mib']:.0f} MiB")
        print(f"| {tokens:,} | " + " | ".join(cells) + " |", flush=True)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
