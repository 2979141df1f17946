"""The seed's three inference claims as A/Bs with one variable changed each, on SmolLM2-135M-Instruct (fp32, its Q4_1
GGUF dequantized), on this CPU. Each part is its own invocation (a few minutes each); results merge into
benchmarks/results/engine_claims.json, and `plot` draws docs/engine-claims.png from it.

    .venv/bin/python benchmarks/engine_claims.py kv-cache  [--lengths 128 512 2048] [--full-uncached 128]
    .venv/bin/python benchmarks/engine_claims.py batching  [--requests 32] [--max-seqs 8] [--rounds 2]
    .venv/bin/python benchmarks/engine_claims.py paged     [--requests 32] [--kv-mib 360] [--max-len 2048]
    .venv/bin/python benchmarks/engine_claims.py plot

- kv-cache (seed: "O(n^2) -> O(n), 10x"): greedy decoding of SmolLM2 with its KV cache on (each step feeds the new
  token to the model's contiguous cache) against off (each step runs the whole sequence so far through the stack
  and the output head on the last position), one variable changed in one plain loop; the engine's own batch-1
  decode (paged cache, scheduler, sampler) is a third column. The cost of the step that produces token n is timed
  at sampled n (up to 2,048: a context of n - 1 real tokens after the prompt, prefilled untimed; the median of
  `--steps` decode steps, one uncached forward), and tokens/s over n tokens is n over the sum of the step costs
  1..n, linear between the samples: a whole uncached run of 2,048 tokens would take hours here. Whole runs of
  `--full-cached` and `--full-uncached` tokens check that estimate, and that both sides choose the same tokens.
- batching (seed: continuous batching "10x"): the same engine with `EngineConfig(static_batching=True)` (a batch is
  admitted only when the last has finished, as HF `generate` and FasterTransformer batch) against continuous
  batching (a finished request's slot refills at the next step), `--requests` requests arriving together with
  output lengths drawn from a long-tailed (log-normal) distribution, `--max-seqs` running at once.
- paged (seed: paged attention "no fragmentation, 2-3x"): the same engine and the same KV bytes, blocks of 16 tokens
  against one block of `--max-len` tokens per request (contiguous preallocation of the maximum length, as HF and
  FasterTransformer do): how many requests run at once, throughput, and the reserved token slots that hold no token.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import cpu_flags, load_report, machine_info, set_threads  # noqa: E402
from conftest import smollm2_path  # noqa: E402

from tformer import ModelConfig, build_model  # noqa: E402
from tformer.checkpoints import load_pretrained  # noqa: E402
from tformer.data.corpora import bible_text  # noqa: E402
from tformer.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tformer.engine.paged import kv_bytes_per_token  # noqa: E402
from tformer.models.stack import StackInputs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "engine_claims.json"
FIGURE = Path(__file__).resolve().parents[1] / "docs" / "engine-claims.png"


def save(part: str, result: dict) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    result["machine"] = {"info": machine_info(), "cpu_flags": cpu_flags(), "date": time.strftime("%Y-%m-%d %H:%M")}
    data[part] = result
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    print(f"saved {part} to {RESULTS}")


def story_prompt(tokenizer) -> list[int]:
    return chat_ids(tokenizer, "Tell me a long story about a lighthouse keeper and the ships she saved.")


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


# ---- KV cache on against off ------------------------------------------------------------------------------------


@torch.inference_mode()
def cached_loop(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with the model's contiguous KV cache: the tokens and each decode step's seconds."""
    cache = model.new_cache(1, len(prompt) + n)
    logits = model(torch.tensor([prompt]), cache=cache, start=0)[0, -1]
    tokens, times = [int(logits.argmax())], []
    for i in range(n - 1):
        start = time.perf_counter()
        logits = model(torch.tensor([[tokens[-1]]]), cache=cache, start=len(prompt) + i)[0, -1]
        tokens.append(int(logits.argmax()))
        times.append(time.perf_counter() - start)
    return tokens, times


@torch.inference_mode()
def cached_step_at(model, context: list[int], steps: int) -> float:
    """Median seconds of `steps` cached decode steps after a context of len(context) tokens (prefilled untimed)."""
    cache = model.new_cache(1, len(context) + steps)
    model(torch.tensor([context[:-1]]), cache=cache, start=0)
    token, times = context[-1], []
    for i in range(steps):
        start = time.perf_counter()
        token = int(model(torch.tensor([[token]]), cache=cache, start=len(context) - 1 + i)[0, -1].argmax())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def uncached_step(model, ids: list[int]) -> int:
    """One step without a cache: the whole sequence through the stack, the output head on its last position only."""
    x = torch.tensor([ids])
    hidden = model.decoder(x, StackInputs.from_prefix(x))
    return int(model.output_logits(hidden[0, -1]).argmax())


def uncached_loop(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, times = list(prompt), []
    for _ in range(n):
        start = time.perf_counter()
        ids.append(uncached_step(model, ids))
        times.append(time.perf_counter() - start)
    return ids[len(prompt) :], times


def engine_step_at(engine: Engine, context: list[int], steps: int) -> float:
    """Median seconds of the engine's batch-1 decode steps after a prompt of len(context) tokens (its prefill and the
    first decode untimed)."""
    engine.add_request(context, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def kv_cache(args) -> None:
    model, tokenizer = load_pretrained(smollm2_path())
    model.eval()
    prompt = story_prompt(tokenizer)
    cached_tokens, cached_times = cached_loop(model, prompt, args.full_cached)
    full_tokens, full_times = uncached_loop(model, prompt, args.full_uncached)
    agree = full_tokens == cached_tokens[: args.full_uncached]
    print(f"uncached and cached greedy tokens agree on all {args.full_uncached}: {agree}", flush=True)
    text = tokenizer.encode(" ".join(bible_text("test")))  # real tokens to stand for what a long output generated
    longest = max(args.lengths)
    engine = Engine(model, tokenizer, EngineConfig(max_model_len=len(prompt) + longest + 16, prefix_caching=False))
    samples = sorted({*args.sample_lengths, *args.lengths})
    cost = {"cached": {}, "uncached": {}, "engine": {}}  # side -> tokens generated before the step -> seconds
    for length in samples:
        context = prompt + text[: length - 1]
        cost["cached"][length] = cached_step_at(model, context, args.steps)
        cost["uncached"][length] = statistics.median(
            _timed(lambda context=context: uncached_step(model, context)) for _ in range(args.repeats)
        )
        cost["engine"][length] = engine_step_at(engine, context, args.steps)
        print(
            f"step producing token {length}: cached {1e3 * cost['cached'][length]:.1f} ms, uncached "
            f"{1e3 * cost['uncached'][length]:.0f} ms, engine {1e3 * cost['engine'][length]:.1f} ms",
            flush=True,
        )
    rows = [
        {
            "tokens": n,
            **{f"{side}_tok_s": n / integrate(cost[side], n) for side in cost},
            **{f"{side}_step_ms": 1e3 * cost[side][n] for side in cost},
        }
        for n in args.lengths
    ]
    checks = {
        "cached": {"tokens": args.full_cached, "whole_run_tok_s": (args.full_cached - 1) / sum(cached_times)},
        "uncached": {"tokens": args.full_uncached, "whole_run_tok_s": args.full_uncached / sum(full_times)},
    }
    for side, check in checks.items():
        check["from_sampled_steps_tok_s"] = check["tokens"] / integrate(cost[side], check["tokens"])
        print(
            f"{side}: tokens/s over {check['tokens']} tokens, whole run {check['whole_run_tok_s']:.2f}, from the "
            f"sampled steps {check['from_sampled_steps_tok_s']:.2f}"
        )
    print("\n| output tokens | cached tok/s | uncached tok/s | cached / uncached | engine tok/s | ms a step there |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['cached_tok_s']:.1f} | {r['uncached_tok_s']:.2f} | "
            f"{r['cached_tok_s'] / r['uncached_tok_s']:.1f}x | {r['engine_tok_s']:.1f} | "
            f"cached {r['cached_step_ms']:.1f}, uncached {r['uncached_step_ms']:.0f}, engine {r['engine_step_ms']:.1f}"
        )
    print(load_report("after"))
    save(
        "kv_cache",
        {
            "args": vars(args),
            "prompt_tokens": len(prompt),
            "rows": rows,
            "step_s": cost,
            "whole_runs": checks,
            "tokens_agree": agree,
            "load": load_report("end"),
        },
    )


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def integrate(step_seconds: dict[int, float], n: int) -> float:
    """Seconds to generate tokens 1..n from step times sampled at some lengths (linear between them, flat before the
    first sample)."""
    points = sorted(step_seconds.items())
    total = 0.0
    for t in range(1, n + 1):
        if t <= points[0][0]:
            total += points[0][1]
            continue
        for (a, sa), (b, sb) in zip(points, points[1:], strict=False):
            if a <= t <= b:
                total += sa + (sb - sa) * (t - a) / (b - a)
                break
        else:
            raise ValueError(f"length {n} is past the last sampled step {points[-1][0]}")
    return total


# ---- continuous against static batching, paged against contiguous ------------------------------------------------


def long_tailed_workload(tokenizer, n: int, median_tokens: int, sigma: float, cap: int, seed: int = 0):
    """(prompt ids, output tokens) per request: Bible passages of 5-90 words, and output lengths log-normal around
    `median_tokens` (a few requests many times longer than most), capped at `cap`."""
    rng = random.Random(seed)
    words = " ".join(bible_text("test")).split()
    requests = []
    for _ in range(n):
        start = rng.randrange(len(words) - 200)
        text = " ".join(words[start : start + rng.randint(5, 90)])
        ids = chat_ids(tokenizer, f"Continue: {text}")
        out = min(cap, max(4, round(rng.lognormvariate(math.log(median_tokens), sigma))))
        requests.append((ids, out))
    return requests


def run_workload(engine: Engine, requests) -> dict:
    """All requests arrive at once; throughput, latency, concurrency and the KV slots reserved but empty."""
    start = time.perf_counter()
    ids = {
        engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)): m for p, m in requests
    }
    latency, running, used, reserved = {}, [], 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                latency[out.request_id] = time.perf_counter() - start
        live = engine.scheduler.running
        running.append(len(live))
        used += sum(s.n_computed for s in live)
        reserved += engine.num_blocks_in_use * engine.config.block_size
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "tok_s": sum(ids.values()) / seconds,
        "mean_latency_s": statistics.mean(latency.values()),
        "p50_latency_s": statistics.median(latency.values()),
        "max_running": max(running),
        "mean_running": statistics.mean(running),
        "steps": len(running),
        "empty_reserved_share": 1 - used / max(1, reserved),
        "preemptions": engine.num_preemptions,
    }


def alternate(engines: dict[str, callable], requests, rounds: int) -> dict[str, list[dict]]:
    """After a short warm-up of each, every round runs every engine once, each time a fresh engine (no prefix-cache
    hits carry over), the order swapped every round."""
    results: dict[str, list[dict]] = {name: [] for name in engines}
    names = list(engines)
    for name in names:  # warm-up: the first steps of a process pay one-time costs (kernels, allocations)
        run_workload(engines[name](), [(p, min(m, 8)) for p, m in requests[:4]])
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run_workload(engines[name](), requests))
            res = results[name][-1]
            print(f"round {r} {name}: {json.dumps(res)}", flush=True)  # a run killed later keeps what it measured
    return results


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def tiny_like(model):
    """A tiny random decoder with `model`'s vocabulary: the scheduler's books (steps, concurrency, block slots) of a
    workload without the big model's time."""
    return build_model(ModelConfig.from_preset("tiny-llama", vocab_size=model.config.vocab_size, max_seq_len=4096))


def batching(args) -> None:
    model, tokenizer = load_pretrained(smollm2_path())
    if args.books_only:
        model = tiny_like(model)
    requests = long_tailed_workload(tokenizer, args.requests, args.median_tokens, args.sigma, args.cap)
    outs = sorted(m for _, m in requests)
    print(f"output lengths: {outs} (total {sum(outs)})")
    base = dict(max_seqs=args.max_seqs, max_model_len=2048, prefix_caching=False)
    engines = {
        "static": lambda: Engine(model, tokenizer, EngineConfig(**base, static_batching=True)),
        "continuous": lambda: Engine(model, tokenizer, EngineConfig(**base)),
    }
    results = alternate(engines, requests, args.rounds)
    summary = {name: medians(runs) for name, runs in results.items()}
    s, c = summary["static"], summary["continuous"]
    print(
        f"\nthroughput continuous / static {c['tok_s'] / s['tok_s']:.2f}x; mean latency static / continuous "
        f"{s['mean_latency_s'] / c['mean_latency_s']:.2f}x"
    )
    print(load_report("after"))
    part = "batching_books" if args.books_only else "batching"
    save(part, {"args": vars(args), "output_lengths": outs, "runs": results, "median": summary})


def paged(args) -> None:
    model, tokenizer = load_pretrained(smollm2_path())
    requests = long_tailed_workload(tokenizer, args.requests, args.median_tokens, args.sigma, args.cap)
    per_token = kv_bytes_per_token(model, "auto")
    budget = args.kv_mib << 20
    print(f"KV bytes per token {per_token}; budget {args.kv_mib} MiB = {budget // per_token} tokens")
    if args.books_only:  # the same token slots and block books on a tiny random model: concurrency and empty slots
        model = tiny_like(model)
        budget = budget // per_token * kv_bytes_per_token(model, "auto")
    base = dict(kv_cache_bytes=budget, max_seqs=args.requests, max_model_len=args.max_len, prefix_caching=False)
    engines = {
        "contiguous": lambda: Engine(model, tokenizer, EngineConfig(**base, block_size=args.max_len)),
        "paged": lambda: Engine(model, tokenizer, EngineConfig(**base, block_size=16)),
    }
    results = alternate(engines, requests, args.rounds)
    summary = {name: medians(runs) for name, runs in results.items()}
    for name, res in summary.items():
        print(
            f"{name}: at most {res['max_running']} running, {res['empty_reserved_share']:.1%} of reserved slots empty"
        )
    print(load_report("after"))
    save(
        "paged_books" if args.books_only else "paged",
        {
            "args": vars(args),
            "kv_bytes_per_token": per_token,
            "output_lengths": sorted(m for _, m in requests),
            "prompt_lengths": sorted(len(p) for p, _ in requests),
            "runs": results,
            "median": summary,
        },
    )


def plot(_args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(RESULTS.read_text())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    kv = data["kv_cache"]
    ax = axes[0]
    labels = {"cached": "KV cache on (model loop)", "engine": "KV cache on (engine)", "uncached": "KV cache off"}
    for side, label in labels.items():
        xs = sorted(int(k) for k in kv["step_s"][side])
        ax.plot(xs, [1e3 * kv["step_s"][side][str(x)] for x in xs], "o-", label=label)
    ax.set(xlabel="token being generated", ylabel="ms per token", xscale="log", yscale="log")
    ax.set_title("KV cache: cost of one token")
    ax.legend(fontsize=8)
    ax = axes[1]
    if "batching" in data:
        med, names = data["batching"]["median"], ("static", "continuous")
        bars = [med[n]["tok_s"] for n in names]
        ax.bar(names, bars, color=["tab:gray", "tab:blue"])
        for i, n in enumerate(names):
            label = f"{bars[i]:.1f} tok/s\nmean latency {med[n]['mean_latency_s']:.0f} s"
            ax.text(i, bars[i], label, ha="center", va="bottom", fontsize=8)
        ax.set(ylabel="output tokens/s", ylim=(0, 1.3 * max(bars)))
        args = data["batching"]["args"]
        ax.set_title(f"{args['requests']} requests, {args['max_seqs']} at once")
    books = data.get("paged") or data["paged_books"]  # concurrency and empty slots are the same in both
    med, names, ax = books["median"], ("contiguous", "paged"), axes[2]
    bars = [med[n]["max_running"] for n in names]
    ax.bar(names, bars, color=["tab:gray", "tab:blue"])
    for i, n in enumerate(names):
        label = f"{bars[i]:.0f} at once\n{med[n]['empty_reserved_share']:.0%} of reserved slots empty"
        ax.text(i, bars[i], label, ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="most requests running at once", ylim=(0, 1.3 * max(bars)))
    ax.set_title(f"same KV bytes ({books['args']['kv_mib']} MiB), 32 requests")
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=110)
    print(f"wrote {FIGURE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("kv-cache")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--full-cached", type=int, default=128)
    p.add_argument("--full-uncached", type=int, default=64)
    p.add_argument("--sample-lengths", type=int, nargs="+", default=[1, 32, 64, 256, 1024])
    p.add_argument("--steps", type=int, default=5, help="decode steps timed at each sampled length (cached, engine)")
    p.add_argument("--repeats", type=int, default=1, help="uncached steps timed at each sampled length")
    for name in ("batching", "paged"):
        p = sub.add_parser(name)
        p.add_argument("--requests", type=int, default=32)
        p.add_argument("--median-tokens", type=int, default=48)
        p.add_argument("--sigma", type=float, default=1.0)
        p.add_argument("--cap", type=int, default=512)
        p.add_argument("--rounds", type=int, default=2)
        p.add_argument(
            "--books-only",
            action="store_true",
            help="a tiny random model with the same scheduler settings: steps, concurrency, empty slots; not the speed",
        )
        if name == "batching":
            p.add_argument("--max-seqs", type=int, default=8)
        else:
            p.add_argument("--kv-mib", type=int, default=360)
            p.add_argument("--max-len", type=int, default=2048)

    sub.add_parser("plot")
    for p in sub.choices.values():
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    args = parser.parse_args()
    if args.part != "plot":
        set_threads(args.threads)
        print(machine_info())
        print(f"CPU flags: {cpu_flags()}")
        print(load_report("before"))
    {"kv-cache": kv_cache, "batching": batching, "paged": paged, "plot": plot}[args.part](args)


if __name__ == "__main__":
    main()
