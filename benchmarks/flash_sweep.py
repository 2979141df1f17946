"""FlashAttention's claims ("显存节省 20x", "2x speed") over length on this CPU: causal attention with the score
matrix materialized against the fused kernel and tformer's chunked path, forward and forward + backward, one
attention call and a whole small model.

    .venv/bin/python benchmarks/flash_sweep.py --lengths 1024 4096 16384 32768 [--parts op model]
    .venv/bin/python benchmarks/flash_sweep.py --plot          # docs/flash-sweep.png from the JSON

One attention call (`op`): q, k, v of (1 row, 4 heads, T, 64) in fp32, causal.
- math: `layers.attention.math_attention`, softmax(Q K^T / sqrt(d) + causal mask) V with the (H, T, T) scores and
  weights as tensors (what attention was before FlashAttention; the reference every test compares with);
- sdpa: torch's `scaled_dot_product_attention(is_causal=True)`, which on the CPU is its flash-attention kernel
  (tiles of queries and keys, online softmax, no score matrix; CUDA's memory-efficient kernel does not exist here);
- chunked: `layers.attention.chunked_attention`, tformer's path for masks the kernel cannot take: blocks of 512
  queries, each building its own bias block and calling the kernel, checkpointed in training.
A whole model (`model`): a 2-layer decoder LM (d_model 256, 4 heads of 64, vocabulary 512, fp32), forward +
backward of one row, with `attention_backend: math` against `sdpa`.

Each (part, variant, mode, length) runs in a fresh process: memory is the peak of live tensor bytes during one call
(`LiveTensorTracker`, every tensor storage, inputs included; the analogue of CUDA's max_memory_allocated) and the
growth of peak RSS; time is the median of the timed calls (without the tracker) after one warm-up below 8k tokens.
A math run whose (H, T, T) fp32 scores alone pass --math-max-gib is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import cpu_flags, load_report, machine_info, median, set_threads

from tformer import ModelConfig, build_model
from tformer.layers.attention import chunked_attention, math_attention
from tformer.layers.masks import AttentionMask
from tformer.training.memory import LiveTensorTracker, peak_rss_bytes, reset_peak_rss, rss_bytes

RESULTS = Path(__file__).resolve().parent / "results" / "flash_sweep.json"
FIGURE = Path(__file__).resolve().parents[1] / "docs" / "flash-sweep.png"
HEADS, HEAD_DIM = 4, 64
CAUSAL = AttentionMask(is_causal=True)
OPS = {
    "math": lambda q, k, v: math_attention(q, k, v, CAUSAL, 0.0)[0],
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "chunked": lambda q, k, v: chunked_attention(q, k, v, CAUSAL, 0.0),
}
MODEL_VARIANTS = ("math", "sdpa")


def op_step(variant: str, length: int, backward: bool):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, generator=generator).requires_grad_(backward) for _ in range(3))
    grad = torch.randn(1, HEADS, length, HEAD_DIM, generator=generator)

    def step() -> None:
        with torch.set_grad_enabled(backward):
            out = OPS[variant](q, k, v)
            if backward:
                out.backward(grad)
                for t in (q, k, v):
                    t.grad = None

    return step, [q, k, v, grad]


def model_step(variant: str, length: int, backward: bool):
    torch.manual_seed(0)
    config = ModelConfig(
        family="decoder",
        vocab_size=512,
        d_model=256,
        n_heads=HEADS,
        d_ff=1024,
        n_decoder_layers=2,
        max_seq_len=length,
        dropout=0.0,
        attn_dropout=0.0,
        norm_placement="pre",
        position="rope",
        attention_backend=variant,
    )
    model = build_model(config).train(backward)
    ids = torch.randint(1, 512, (1, length))

    def step() -> None:
        with torch.set_grad_enabled(backward):
            loss = model(ids).logsumexp(-1).mean()
            if backward:
                loss.backward()
                model.zero_grad(set_to_none=True)

    return step, [*model.parameters(), ids]


def measure_one(part: str, variant: str, mode: str, length: int, repeats: int) -> dict[str, float]:
    set_threads()
    backward = mode == "fwd+bwd"
    step, inputs = (op_step if part == "op" else model_step)(variant, length, backward)
    before = rss_bytes()
    reset_peak_rss()
    tracker = LiveTensorTracker()
    with tracker:
        tracker.track(inputs)
        step()
    rss_growth = peak_rss_bytes() - before
    times = []
    for _ in range(repeats + (1 if length < 8192 else 0)):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times = times[1:] if length < 8192 else times
    return {"live_peak_mib": tracker.peak / 2**20, "rss_growth_mib": rss_growth / 2**20, "seconds": median(times)}


def scores_gib(part: str, length: int) -> float:
    return HEADS * length * length * 4 / 2**30


def run_child(args, part: str, variant: str, mode: str, length: int) -> dict | None:
    if variant == "math" and scores_gib(part, length) > args.math_max_gib:
        return None
    command = [sys.executable, __file__, "--one", part, variant, mode, str(length), "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def sweep(args) -> None:
    print(machine_info())
    print(f"CPU flags: {cpu_flags()}")
    print(load_report("before"))
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for part in args.parts:
        variants = list(OPS) if part == "op" else list(MODEL_VARIANTS)
        for mode in args.modes:
            print(f"\n{part}, {mode}\n| tokens | " + " | ".join(f"{v}: s, live MiB, RSS MiB" for v in variants) + " |")
            print("|---|" + "---|" * len(variants))
            for length in args.lengths:
                cells = []
                for variant in variants:
                    res = run_child(args, part, variant, mode, length)
                    key = f"{part}/{mode}/{variant}/{length}"
                    if res is None:
                        cells.append(f"skipped: scores alone {scores_gib(part, length):.0f} GiB")
                        data[key] = {"skipped": f"scores alone {scores_gib(part, length):.1f} GiB"}
                    elif "error" in res:
                        cells.append(f"failed: {res['error'][:60]}")
                        data[key] = res
                    else:
                        cells.append(f"{res['seconds']:.3f}, {res['live_peak_mib']:.0f}, {res['rss_growth_mib']:.0f}")
                        data[key] = {**res, "date": time.strftime("%Y-%m-%d %H:%M")}
                    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
                print(f"| {length} | " + " | ".join(cells) + " |", flush=True)
    data["machine"] = {"info": machine_info(), "cpu_flags": cpu_flags()}
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    print(load_report("after"))


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(RESULTS.read_text())
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, mode in enumerate(("fwd", "fwd+bwd")):
        for part, variants, style in (("op", list(OPS), "-"), ("model", list(MODEL_VARIANTS), "--")):
            for variant in variants:
                rows = sorted(
                    (int(key.rsplit("/", 1)[1]), value)
                    for key, value in data.items()
                    if key.startswith(f"{part}/{mode}/{variant}/") and "seconds" in value
                )
                if not rows:
                    continue
                xs = [x for x, _ in rows]
                label = f"{'one call' if part == 'op' else '2-layer model'}: {variant}"
                axes[0, col].plot(xs, [r["live_peak_mib"] for _, r in rows], style, marker="o", label=label)
                axes[1, col].plot(xs, [r["seconds"] for _, r in rows], style, marker="o", label=label)
        axes[0, col].set(title=f"{mode}: peak live tensors", ylabel="MiB")
        axes[1, col].set(title=f"{mode}: time", ylabel="seconds")
        for ax in axes[:, col]:
            ax.set(xscale="log", yscale="log", xlabel="tokens")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=110)
    print(f"wrote {FIGURE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--parts", nargs="+", default=["op", "model"], choices=["op", "model"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--math-max-gib", type=float, default=1.0)
    parser.add_argument("--plot", action="store_true")
    parser.add_argument("--one", nargs=4, metavar=("PART", "VARIANT", "MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        part, variant, mode, length = args.one
        print(json.dumps(measure_one(part, variant, mode, int(length), args.repeats)))
    elif args.plot:
        plot()
    else:
        sweep(args)


if __name__ == "__main__":
    main()
