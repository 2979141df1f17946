"""A Mamba LM (family ssm) against a LLaMA-style Transformer LM of the same size (docs/ssm-vs-transformer.md).

    .venv/bin/python benchmarks/ssm_vs_transformer.py perplexity    # the two trained runs on the held-out books
    .venv/bin/python benchmarks/ssm_vs_transformer.py train-speed   # training tok/s on real batches, alternating
    .venv/bin/python benchmarks/ssm_vs_transformer.py decode        # per-token decode time and memory, 1k-16k
    .venv/bin/python benchmarks/ssm_vs_transformer.py curve         # one layer's forward against n (the plot)

The models are the ones configs/llama-lm-baseline.yaml and configs/ssm-lm.yaml build (4.04M and 4.09M parameters).
`perplexity` reads the trained runs; `decode` and `curve` use random weights of the same shapes, since the trained
Transformer's RoPE saw 129 positions and neither model was trained past them (the timing does not depend on the
weights). Every mode runs both sides in this process, alternating, takes medians, and prints both figures, their
ratio, the CPU flags and `uptime`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from common import cpu_flags, load_report, median, set_threads

from tformer import ModelConfig, build_model, load
from tformer.checkpoints import list_checkpoints
from tformer.data import TokenBatchSampler, Tokenizer, Vocab, bible_text, causal_lm, lm_lengths
from tformer.layers import ssm
from tformer.models.stack import StackInputs
from tformer.training.evaluate import perplexity
from tformer.training.memory import LiveTensorTracker, peak_rss_bytes, reset_peak_rss, rss_bytes

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"transformer": ROOT / "configs/llama-lm-baseline.yaml", "ssm": ROOT / "configs/ssm-lm.yaml"}
RUNS = {"transformer": ROOT / "runs/llama-lm-baseline", "ssm": ROOT / "runs/ssm-lm"}
MIB = 2**20


def model_config(side: str, **overrides: object) -> ModelConfig:
    """The recipe's model with the trained tokenizer's vocabulary size (4,000 BPE tokens)."""
    config = ModelConfig.from_file(RECIPES[side])
    return ModelConfig.from_dict({**config.to_dict(), "vocab_size": 4000, **overrides})


def header() -> None:
    print(f"cpu flags: {cpu_flags()}   threads: {torch.get_num_threads()}")
    print(load_report("before"))


# ---- perplexity of the trained runs ----------------------------------------------------------------------------


def run_perplexity(args: argparse.Namespace) -> None:
    rows = {}
    for side, run in RUNS.items():
        model = load(list_checkpoints(run)[-1])
        tokenizer = Tokenizer.load(run / "tokenizer.json")
        vocab = Vocab.of(tokenizer)
        records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
        steps = [r for r in records if "tokens_per_s" in r]
        row = {"params": model.num_parameters(), "steps": steps[-1]["step"], "elapsed": steps[-1]["elapsed"]}
        row["train tok/s (median of logs)"] = median([r["tokens_per_s"] for r in steps])
        for split in ("dev", "test"):
            encoded = tokenizer.encode_batch(bible_text(split), add_bos=False)
            batches = [causal_lm(encoded[i : i + 32], vocab) for i in range(0, len(encoded), 32)]
            row[f"{split} ppl"] = perplexity(model, batches)
        rows[side] = row
    print_rows(rows, lower_is_better={"dev ppl", "test ppl"})


def print_rows(rows: dict[str, dict], lower_is_better: set[str] = frozenset()) -> None:
    keys, note = list(next(iter(rows.values()))), " (lower is better)"
    print(f"| {'':28} | {'transformer':>14} | {'ssm':>14} | ssm / transformer |")
    for key in keys:
        t, s = rows["transformer"][key], rows["ssm"][key]
        fmt = "{:>14,.0f}" if abs(t) >= 100 else "{:>14.3f}"
        print(
            f"| {key:28} | {fmt.format(t)} | {fmt.format(s)} | {s / t:.3f}x{note if key in lower_is_better else ''} |"
        )
    print(load_report("after"))


# ---- training speed on real batches ----------------------------------------------------------------------------


def run_train_speed(args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.load(RUNS["transformer"] / "tokenizer.json")
    vocab = Vocab.of(tokenizer)
    examples = [ids for ids in tokenizer.encode_batch(bible_text("train"), add_bos=False) if 0 < len(ids) <= 128]
    sampler = TokenBatchSampler(lm_lengths(examples), 4096, seed=1)
    batches = [causal_lm([examples[i] for i in b], vocab) for b in sampler.batches(0)[: args.steps]]
    steps = {}
    for side in RECIPES:
        torch.manual_seed(1)
        model = build_model(model_config(side)).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        steps[side] = (model, optimizer)
    times = {side: [] for side in steps}
    for i, batch in enumerate(batches):
        for side in list(steps)[:: 1 if i % 2 else -1]:
            model, optimizer = steps[side]
            start = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16):
                logits = model(batch.input_ids, batch.attention_mask)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times[side].append((time.perf_counter() - start, int((batch.labels != -100).sum())))
    rows = {}
    for side, pairs in times.items():
        pairs = pairs[1:]  # the first step warms up
        rows[side] = {"train tok/s (median step)": median([n / t for t, n in pairs]), "steps timed": len(pairs)}
    print(f"{args.steps} real batches of <= 4096 tokens (bf16 autocast, AdamW), alternating; first step untimed")
    print_rows(rows)


# ---- decoding against context length ---------------------------------------------------------------------------


def decode_side(side: str, model: torch.nn.Module, context: int, new_tokens: int) -> dict:
    """Prefills `context` random tokens; returns the prefill's time and RSS growth, a one-token step, the cache."""
    prompt = torch.randint(1, 4000, (1, context), generator=torch.Generator().manual_seed(context))
    rss_before = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    cache = model.new_cache(1, context + new_tokens + 2) if side == "transformer" else model.new_cache(1)
    logits = model(prompt, cache=cache)
    prefill = time.perf_counter() - start
    rss_growth = peak_rss_bytes() - rss_before
    token, position = logits[:, -1:].argmax(-1), context

    def step() -> None:
        nonlocal token, position
        kwargs = {"start": position} if side == "transformer" else {}
        token = model(token, cache=cache, **kwargs)[:, -1:].argmax(-1)
        position += 1

    return {"prefill": prefill, "rss": rss_growth, "step": step, "cache": cache, "model": model}


def state_bytes(side: str, cache: list, positions: int) -> int:
    """Bytes of the decoding state: the KV entries of `positions` tokens, or the SSM's fixed conv and h."""
    if side == "transformer":
        per_position = sum(c.self_attn.k[0, :, 0].nbytes + c.self_attn.v[0, :, 0].nbytes for c in cache)
        return per_position * positions
    return sum(s.nbytes() for s in cache)


@torch.no_grad()
def run_decode(args: argparse.Namespace) -> None:
    models = {}
    for side in RECIPES:
        torch.manual_seed(1)
        overrides = {"max_seq_len": max(args.lengths) + args.tokens + 8}
        if side == "transformer":
            overrides["attention_backend"] = "sdpa"  # flash attention for the long prefill; decode reads the cache
        models[side] = build_model(model_config(side, **overrides)).eval()
    print(f"batch 1, random weights of the recipes' shapes, fp32, {args.tokens} greedy tokens after each prompt")
    print(
        "| context | transformer ms/token | ssm ms/token | ssm speedup | transformer KV cache MiB | ssm state MiB "
        "| transformer step live peak MiB | ssm step live peak MiB | transformer RSS peak growth MiB "
        "| ssm RSS peak growth MiB | prefill s (transformer / ssm) |"
    )
    for context in args.lengths:
        sides = {}
        for side, model in models.items():  # one prefill at a time, so that each RSS peak is its own
            sides[side] = decode_side(side, model, context, args.tokens)
        per_token = {side: [] for side in sides}
        for i in range(args.tokens):
            for side in list(sides)[:: 1 if i % 2 else -1]:
                start = time.perf_counter()
                sides[side]["step"]()
                per_token[side].append(time.perf_counter() - start)
        peaks = {}
        for side, s in sides.items():  # one more step under the live-tensor tracker (untimed: the mode is slow)
            with LiveTensorTracker() as tracker:
                tracker.track(state_tensors(s["cache"]))
                s["step"]()
            peaks[side] = tracker.peak
        t, m = median(per_token["transformer"][1:]), median(per_token["ssm"][1:])
        kv = state_bytes("transformer", sides["transformer"]["cache"], context + args.tokens)
        state = state_bytes("ssm", sides["ssm"]["cache"], 0)
        print(
            f"| {context:,} | {t * 1e3:.2f} | {m * 1e3:.2f} | {t / m:.2f}x | {kv / MIB:.1f} | {state / MIB:.3f} "
            f"| {peaks['transformer'] / MIB:.1f} | {peaks['ssm'] / MIB:.1f} | {sides['transformer']['rss'] / MIB:.0f} "
            f"| {sides['ssm']['rss'] / MIB:.0f} "
            f"| {sides['transformer']['prefill']:.2f} / {sides['ssm']['prefill']:.2f} |",
            flush=True,
        )
        del sides
    print(load_report("after"))


def state_tensors(cache: list) -> list[torch.Tensor]:
    tensors = []
    for c in cache:
        tensors += [c.self_attn.k, c.self_attn.v] if hasattr(c, "self_attn") else [c.conv, c.ssm]
    return tensors


# ---- one layer's forward against sequence length: the O(n^2) against O(n) row ----------------------------------

LAYERS = ("transformer sdpa", "transformer math", "ssm sequential scan", "ssm parallel scan")


def layer_forward(name: str, length: int) -> tuple[object, dict]:
    """A callable running one layer (with its embedding) on `length` tokens, and its parameter count."""
    side = name.split()[0]
    overrides = {"n_decoder_layers": 1, "max_seq_len": length}
    if side == "transformer":
        overrides["attention_backend"] = name.split()[1]
    torch.manual_seed(1)
    model = build_model(model_config(side, **overrides)).eval()
    ids = torch.randint(1, 4000, (1, length), generator=torch.Generator().manual_seed(length))
    if side == "transformer":
        return lambda: model.decoder(ids, StackInputs.from_prefix(ids)), model
    scan = {"sequential": ssm.sequential_scan, "parallel": ssm.parallel_scan}[name.split()[1]]

    def run() -> torch.Tensor:
        saved = ssm.SCANS.get("cpu")
        ssm.SCANS["cpu"] = scan
        try:
            return model.layers[0](model.tokens(ids))
        finally:
            ssm.SCANS["cpu"] = saved

    return run, model


@torch.no_grad()
def run_curve(args: argparse.Namespace) -> None:
    results = {name: {} for name in LAYERS}
    for length in args.lengths:
        runs = {}
        for name in LAYERS:
            if name == "transformer math" and length > args.math_max:
                continue  # the (H, n, n) scores alone: 4 x 16k^2 x 4 bytes = 4 GiB, twice with the softmax
            runs[name] = layer_forward(name, length)[0]
        for name, run in runs.items():  # memory first, one untimed pass each
            with LiveTensorTracker() as tracker:
                run()
            results[name][length] = {"peak": tracker.peak}
        times = {name: [] for name in runs}
        for i in range(args.runs):
            for name in list(runs)[:: 1 if i % 2 else -1]:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        for name, ts in times.items():
            results[name][length]["seconds"] = median(ts)
        print(
            f"n={length:>6,}: "
            + "  ".join(
                f"{n} {results[n][length]['seconds'] * 1e3:,.1f} ms {results[n][length]['peak'] / MIB:,.1f} MiB"
                for n in runs
            ),
            flush=True,
        )
    print_curve_table(results, args.lengths)
    plot_curve(results, args.plot)
    print(load_report("after"))


def print_curve_table(results: dict, lengths: list[int]) -> None:
    print("| n | " + " | ".join(f"{n} ms" for n in LAYERS) + " | " + " | ".join(f"{n} MiB" for n in LAYERS) + " |")
    for n in lengths:
        cells = [results[name].get(n) for name in LAYERS]
        ms = [f"{c['seconds'] * 1e3:,.1f}" if c else "-" for c in cells]
        mib = [f"{c['peak'] / MIB:,.1f}" if c else "-" for c in cells]
        print(f"| {n:,} | " + " | ".join(ms) + " | " + " | ".join(mib) + " |")
    print("growth exponent from the last two lengths each ran (time ~ n^k, memory ~ n^k):")
    for name in LAYERS:
        ns = sorted(results[name])[-2:]
        if len(ns) == 2:
            k_t = math.log(results[name][ns[1]]["seconds"] / results[name][ns[0]]["seconds"]) / math.log(ns[1] / ns[0])
            k_m = math.log(results[name][ns[1]]["peak"] / results[name][ns[0]]["peak"]) / math.log(ns[1] / ns[0])
            print(f"  {name:22} n {ns[0]:,} -> {ns[1]:,}: time k = {k_t:.2f}, memory k = {k_m:.2f}")


def plot_curve(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in LAYERS:
        ns = sorted(results[name])
        ax_time.plot(ns, [results[name][n]["seconds"] * 1e3 for n in ns], marker="o", label=name)
        ax_mem.plot(ns, [results[name][n]["peak"] / MIB for n in ns], marker="o", label=name)
    for ax, title, unit in ((ax_time, "forward time of one layer", "ms"), (ax_mem, "live-tensor peak", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n (batch 1)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.suptitle("Transformer (d 256, 4 heads, SwiGLU 640) vs Mamba block (d 256, expand 2, N 16), fp32, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("perplexity")
    speed = sub.add_parser("train-speed")
    speed.add_argument("--steps", type=int, default=9)
    decode = sub.add_parser("decode")
    decode.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    decode.add_argument("--tokens", type=int, default=16)
    curve = sub.add_parser("curve")
    curve.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    curve.add_argument("--runs", type=int, default=3)
    curve.add_argument("--math-max", type=int, default=8192)
    curve.add_argument("--plot", default=str(ROOT / "docs/ssm-vs-transformer.png"))
    args = parser.parse_args()
    set_threads()
    header()
    {"perplexity": run_perplexity, "train-speed": run_train_speed, "decode": run_decode, "curve": run_curve}[args.mode](
        args
    )


if __name__ == "__main__":
    main()
