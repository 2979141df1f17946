"""A Llama-3.2-1B-shaped model and a small Mixtral-shaped MoE as Q4_K_M GGUF files, made by llama.cpp's own
quantizer: tformer's engine against llama.cpp (llama-cpp-python) on the same file, and against Hugging Face
`generate` in bf16 on the same weights (issue 51, "Speed").

Nothing is downloaded. `make` builds the model with random weights (tformer's own initialization: normal with
std 0.02, the residual projections scaled down by depth, which keeps the logits spread rather than flat or
one-hot; `make` prints their spread), writes it as an F16 GGUF with tformer's writer (`to_gguf`, what `tformer
convert --to gguf --type f16` runs), quantizes that with `llama_cpp.llama_model_quantize` to Q4_K_M, and saves
the Q4_K_M file's weights, dequantized by tformer, as a bf16 Hugging Face directory for the HF side. Scratch
files go to --dir (default /tmp/tformer_gguf_bench), never into the repository.

The timed parts, each one invocation (run them under an exclusive `flock /tmp/cpu.lock`, one at a time):
- `decode`: batch-1 greedy decode tokens/s (one request of --tokens new tokens, end-of-sequence ignored, prompt
  of 16 tokens), then prompt processing of --prompt-tokens (512) tokens/s (time to the first token of one
  request of that length; tformer's prefix caching off, llama.cpp `reset()` before each run), the two sides
  alternating run by run (order reversed every other run), medians. The bandwidth share: weight bytes read per
  token x tok/s against a large copy's bandwidth (bytes read + written, `copy_bandwidth`) measured in the same
  run. Bytes per token: llama.cpp, every tensor as stored in the file (a tied embedding is read whole by the
  head); tformer, every parameter and buffer less an embedding table only looked up by row; for the MoE both
  count n_experts_per_token / n_experts of the expert weights (each token reads its 2 experts of 4).
- `serve`: 32 requests with random prompts (8-128 tokens) and outputs (8-96 tokens) arriving together: total
  output tok/s of tformer's engine (continuous batching, the file served as stored) against HF `generate`
  static batching in bf16 (one left-padded batch, generated to the longest output), on the bf16 weights
  dequantized from the same Q4_K_M file; alternating rounds, medians.
- `memory`: resident memory (VmRSS) after load, each side in a fresh process: loaded, then one 16-token greedy
  request (llama.cpp maps the file and touches its pages then), against the file's size. Reported as the growth
  over the process's RSS before the load (the interpreter and its libraries: torch for tformer, llama_cpp for
  llama.cpp) and as the absolute RSS; both with the same KV-cache size (a 2,048-token context, 16-bit).
- `profile`: torch.profiler's top operators of tformer's decode steps and of one long prompt (printed only).
- `report`: the results of every part (kept in benchmarks/results/gguf_vs_llamacpp.json) as
  benchmarks/results/gguf_vs_llamacpp.txt, with the ratios against the goals.

    .venv/bin/python benchmarks/gguf_vs_llamacpp.py make --model llama-1b        # and --model moe
    flock /tmp/cpu.lock .venv/bin/python benchmarks/gguf_vs_llamacpp.py decode --model llama-1b
    flock /tmp/cpu.lock .venv/bin/python benchmarks/gguf_vs_llamacpp.py serve --model llama-1b
    flock /tmp/cpu.lock .venv/bin/python benchmarks/gguf_vs_llamacpp.py memory --model llama-1b
    .venv/bin/python benchmarks/gguf_vs_llamacpp.py report

Needs the `bench` extra (llama-cpp-python, built from source) and about 8 GB of free memory for `make --model
llama-1b` (the fp32 model and its f16 copy).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import subprocess
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
    set_threads,
    uptime,
)
from engine_vs_hf import read_bandwidth, run_engine_workload, run_hf_static  # noqa: E402
from engine_vs_llamacpp import LLAMACPP, Batch1, gguf_weight_bytes, gguf_weight_formats  # noqa: E402

from tformer import ModelConfig, build_model  # noqa: E402
from tformer.data.tokenizer import Tokenizer  # noqa: E402
from tformer.engine import EngineConfig, SamplingParams  # noqa: E402
from tformer.engine.bench import copy_bandwidth, weight_bytes_per_token  # noqa: E402
from tformer.engine.loading import load_engine, stored_quantization  # noqa: E402
from tformer.interop.gguf import from_gguf  # noqa: E402
from tformer.interop.gguf_writer import to_gguf  # noqa: E402
from tformer.interop.hf import to_hf  # noqa: E402
from tformer.kernels.quantize import model_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {  # name: (preset, overrides)
    "llama-1b": ("llama3.2-1b", {}),
    # Mixtral's layout at about 0.5B parameters: 4 experts of width 2816, 2 chosen per token, untied head
    "moe": (
        "mixtral-8x7b",
        {
            "vocab_size": 32000,
            "d_model": 1024,
            "n_decoder_layers": 12,
            "n_heads": 16,
            "n_kv_heads": 4,
            "d_ff": 2816,
            "n_experts": 4,
            "n_experts_per_token": 2,
            "max_seq_len": 4096,
        },
    ),
}
MATMULS = ("tformer::int4_matmul", "tformer::w8a8_matmul", "tformer::q6k_matmul")
CONTEXT = 2048  # both sides' context (llama.cpp n_ctx, tformer max_model_len) in `decode` and `memory`
TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the bird sang at dawn", "rain fell on the hills"] * 20
Q4_K_M = "Q4_K_M"


def files(directory: Path, model: str) -> dict[str, Path]:
    return {
        "f16": directory / f"{model}-f16.gguf",
        "q4_k_m": directory / f"{model}-q4_k_m.gguf",
        "hf": directory / f"{model}-hf-bf16",
    }


def config_of(model: str) -> ModelConfig:
    preset, overrides = MODELS[model]
    return ModelConfig.from_preset(preset, **overrides)


def quantize_q4_k_m(source: Path, target: Path, threads: int) -> None:
    """llama.cpp's own quantizer (what its `llama-quantize` tool runs): F16 GGUF in, Q4_K_M GGUF out."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {target}) failed with status {status}")


def write_f16(name: str, path: Path) -> None:
    """The model with tformer's random initialization, written by tformer's GGUF writer at f16."""
    config = config_of(name)
    torch.manual_seed(0)
    start = time.perf_counter()
    model = build_model(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
        logits = model(ids).float()[0]
    probs = logits.softmax(-1).max(-1).values
    print(
        f"{name}: {n_params:,} parameters built in {time.perf_counter() - start:.0f} s; logits over 32 random "
        f"tokens: std {logits.std():.3f}, top-1 probability median {probs.median():.2e} "
        f"(uniform: {1 / config.vocab_size:.2e}), {len(set(logits.argmax(-1).tolist()))} distinct argmaxes"
    )
    tokenizer = Tokenizer.train(TEXTS, vocab_size=300)
    start = time.perf_counter()
    to_gguf(model, path, tokenizer, "f16", name=f"tformer {name} (random weights)")
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")


def make(args: argparse.Namespace) -> None:
    paths = files(args.dir, args.model)
    args.dir.mkdir(parents=True, exist_ok=True)
    if not paths["f16"].exists():  # the slow part (8 GB at 1B): kept across runs, --dir is scratch
        write_f16(args.model, paths["f16"])
    start = time.perf_counter()
    quantize_q4_k_m(paths["f16"], paths["q4_k_m"], args.threads)
    print(
        f"llama.cpp quantized it to {paths['q4_k_m']} ({paths['q4_k_m'].stat().st_size / 1e9:.3f} GB, "
        f"{gguf_weight_formats(paths['q4_k_m'])}) in {time.perf_counter() - start:.0f} s"
    )
    start = time.perf_counter()
    hf_model = from_gguf(paths["q4_k_m"], dtype=torch.bfloat16)
    to_hf(hf_model, paths["hf"])
    print(f"wrote the Q4_K_M weights dequantized, bf16, as {paths['hf']} in {time.perf_counter() - start:.0f} s")


def load_llamacpp(path: Path, threads: int, context: int, batch: int = 512):
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=context,
        n_batch=batch,
        verbose=False,
    )


def engine_config(**overrides) -> EngineConfig:
    """tformer's engine as `tformer generate` builds it, with a 2,048-token context and its KV pool sized to
    llama.cpp's 16-bit cache of that context (so resident memory compares like for like)."""
    return EngineConfig(**{"max_model_len": CONTEXT, "prefix_caching": False, **overrides})


def kv_bytes(config: ModelConfig, tokens: int, element: int = 2) -> int:
    return 2 * config.n_decoder_layers * config.n_kv_heads * config.head_dim * tokens * element


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, vocab) for _ in range(n)]  # past the tokenizer's own tokens: plain rows


def decode(args: argparse.Namespace) -> dict:
    threads = set_threads(args.threads)
    path = files(args.dir, args.model)["q4_k_m"]
    print(machine_info())
    print(kernel_paths())
    print(load_report("before"))
    import llama_cpp

    start = time.perf_counter()
    quantize = stored_quantization(path, "auto")
    kv = kv_bytes(config_of(args.model), CONTEXT)
    engine = load_engine(path, engine_config(kv_cache_bytes=kv, compile=args.compile), quantize="auto")
    load_seconds = time.perf_counter() - start
    model = engine.model
    name = f"tformer {quantize or 'float'}{' + compile' if args.compile else ''}"
    llama = load_llamacpp(path, threads, CONTEXT)
    vocab = model.config.vocab_size

    short = random_prompt(vocab, 16, seed=1)
    bench = Batch1({name: engine}, llama, short, args.tokens)
    steps = {name: lambda: bench.tformer(name), LLAMACPP: bench.llamacpp}
    decode_timings = alternating_timing(steps, rounds=args.runs, warmup=1)
    for side in bench.results:  # Batch1 records the warm-up run too
        del bench.results[side][0]

    long = random_prompt(vocab, args.prompt_tokens, seed=2)
    prefill: dict[str, list[float]] = {name: [], LLAMACPP: []}

    def tformer_prefill() -> None:
        start = time.perf_counter()
        engine.generate(long, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        prefill[name].append(time.perf_counter() - start)

    def llamacpp_prefill() -> None:
        llama.reset()
        start = time.perf_counter()
        llama.eval(long)
        prefill[LLAMACPP].append(time.perf_counter() - start)

    prefill_timings = alternating_timing({name: tformer_prefill, LLAMACPP: llamacpp_prefill}, args.prompt_runs, 1)
    for side in prefill:
        del prefill[side][0]  # the warm-up run
    bandwidth, reading = copy_bandwidth(512), read_bandwidth()
    config = model.config
    unread = 1 - config.n_experts_per_token / config.n_experts if config.n_experts else 0.0
    read = {  # at batch 1 a mixture of experts reads n_experts_per_token of its experts per token
        name: weight_bytes_per_token(model) - unread * expert_bytes(model),
        LLAMACPP: gguf_weight_bytes(path) - unread * gguf_expert_bytes(path),
    }
    result = {
        "tformer": name,
        "tformer_load_s": load_seconds,
        "file_bytes": path.stat().st_size,
        "file_formats": gguf_weight_formats(path),
        "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        "copy_bandwidth": bandwidth,
        "read_bandwidth": reading,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "runs": args.runs,
        "prompt_runs": args.prompt_runs,
        "threads": threads,
        "greedy_agree": agreeing_prefix(bench.last_tokens[name], bench.last_tokens[LLAMACPP]),
        "llama_cpp_version": llama_cpp.__version__,
        "sides": {},
    }
    for side in (name, LLAMACPP):
        _, rate, _ = bench.summary(side)
        pp = args.prompt_tokens / median(prefill[side])
        result["sides"][side] = {
            "decode_tok_s": rate,
            "decode_runs": [(p - 1) / (t - f) for f, t, p in bench.results[side]],
            "prompt_tok_s": pp,
            "prompt_runs": [args.prompt_tokens / s for s in prefill[side]],
            "bytes_per_token": read[side],
            "bw_share": read[side] * rate / bandwidth,
            "cpu_share_decode": decode_timings.cpu_share(side, threads),
            "cpu_share_prompt": prefill_timings.cpu_share(side, threads),
        }
    result["model_bytes"] = model_bytes(model)
    result["load_after"] = load_report("after")
    print_decode(args.model, result)
    return result


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of every expert's weights (parameters and buffers under `ffn.experts`)."""
    return sum(
        t.numel() * t.element_size()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if ".ffn.experts." in name
    )


def gguf_expert_bytes(path: Path) -> int:
    """Bytes of the file's stacked expert tensors (`ffn_{gate,up,down}_exps`)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps." in t.name)


def print_decode(model: str, r: dict) -> None:
    name = r["tformer"]
    print(
        f"\n{model}: {r['file_formats']} file of {r['file_bytes'] / 1e9:.3f} GB; batch-1 greedy from a 16-token "
        f"prompt, {r['tokens']} new tokens, median of {r['runs']} alternating runs; prompt of {r['prompt_tokens']} "
        f"tokens, median of {r['prompt_runs']}; {r['threads']} threads each; copy bandwidth "
        f"{r['copy_bandwidth'] / 1e9:.1f} GB/s (a pure read {r['read_bandwidth'] / 1e9:.1f} GB/s); "
        f"llama-cpp-python {r['llama_cpp_version']}, tformer load {r['tformer_load_s']:.1f} s"
    )
    print(
        f"{'':16s} {'decode tok/s':>13s} {'vs llama.cpp':>13s} {'MB/token':>9s} {'BW share':>9s} "
        f"{'prompt tok/s':>13s} {'vs llama.cpp':>13s} {'CPU share':>10s}"
    )
    base = r["sides"][LLAMACPP]
    for side, s in r["sides"].items():
        print(
            f"{side:16s} {s['decode_tok_s']:13.1f} {s['decode_tok_s'] / base['decode_tok_s']:12.2f}x "
            f"{s['bytes_per_token'] / 1e6:9.0f} {s['bw_share']:8.0%} {s['prompt_tok_s']:13.1f} "
            f"{s['prompt_tok_s'] / base['prompt_tok_s']:12.2f}x {s['cpu_share_decode']:9.0%}"
        )
        print(f"{'':16s} decode runs {fmt(s['decode_runs'])}; prompt runs {fmt(s['prompt_runs'])}")
    print(f"greedy tokens: {name} and llama.cpp agree on the first {r['greedy_agree']} of {r['tokens']}")
    print(r["load_after"])


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def workload(vocab: int, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max new tokens) per request: 8-128 prompt tokens, 8-96 to generate (engine_vs_hf's spread)."""
    rng = random.Random(seed)
    return [([rng.randrange(300, vocab) for _ in range(rng.randint(8, 128))], rng.randint(8, 96)) for _ in range(n)]


def serve(args: argparse.Namespace) -> dict:
    import transformers

    threads = set_threads(args.threads)
    paths = files(args.dir, args.model)
    print(machine_info())
    print(kernel_paths())
    print(load_report("before"))
    config = EngineConfig(block_size=16, compile=args.compile)
    engine = load_engine(paths["q4_k_m"], config, quantize="auto")  # as stored: `tformer generate`'s default
    quantize = stored_quantization(paths["q4_k_m"], "auto")
    model, tokenizer = engine.model, engine.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=torch.bfloat16).eval()
    requests = workload(model.config.vocab_size, args.requests)
    from tformer.engine import Engine

    # both sides warm up on 3 other requests, untimed; the engine as the timed rounds build theirs (outside
    # inference_mode: a compiled step guards on its KV tensors' dispatch keys, which inference_mode changes)
    warm = workload(model.config.vocab_size, 3, seed=1)
    run_engine_workload(Engine(model, tokenizer, config), warm)
    with torch.inference_mode():
        run_hf_static(hf, warm, 0)
    runs: dict[str, list[dict[str, float]]] = {"tformer": [], "hf": []}
    steps = {  # a fresh engine each round: no prefix-cache hits from the previous round
        "tformer": lambda: runs["tformer"].append(run_engine_workload(Engine(model, tokenizer, config), requests)),
        "hf": lambda: runs["hf"].append(run_hf_static(hf, requests, 0)),
    }
    timings = alternating_timing(steps, rounds=args.rounds, warmup=0)
    result = {
        "tformer": f"tformer {quantize or 'float'}{' + compile' if args.compile else ''}, continuous batching",
        "hf": f"HF transformers {transformers.__version__} generate, bf16, static batching",
        "requests": args.requests,
        "prompt_range": [min(len(p) for p, _ in requests), max(len(p) for p, _ in requests)],
        "output_range": [min(m for _, m in requests), max(m for _, m in requests)],
        "output_tokens": sum(m for _, m in requests),
        "rounds": args.rounds,
        "threads": threads,
        "sides": {
            side: {
                "tok_s": median([r["tok_s"] for r in runs[side]]),
                "tok_s_runs": [r["tok_s"] for r in runs[side]],
                "seconds": median([r["seconds"] for r in runs[side]]),
                "p50": median([r["p50"] for r in runs[side]]),
                "p99": median([r["p99"] for r in runs[side]]),
                "cpu_share": timings.cpu_share(side, threads),
            }
            for side in runs
        },
        "load_after": load_report("after"),
    }
    print_serve(args.model, result)
    return result


def print_serve(model: str, r: dict) -> None:
    print(
        f"\n{model}: {r['requests']} requests arriving together, prompts {r['prompt_range'][0]}-"
        f"{r['prompt_range'][1]} tokens, outputs {r['output_range'][0]}-{r['output_range'][1]} "
        f"({r['output_tokens']} in all), greedy, median of {r['rounds']} alternating rounds, {r['threads']} threads"
    )
    print(f"{'':52s} {'seconds':>8s} {'out tok/s':>10s} {'p50 s':>7s} {'p99 s':>7s} {'CPU share':>10s}")
    for key in ("tformer", "hf"):
        s = r["sides"][key]
        print(
            f"{r[key]:52s} {s['seconds']:8.1f} {s['tok_s']:10.1f} {s['p50']:7.1f} {s['p99']:7.1f} "
            f"{s['cpu_share']:9.0%}   rounds: {fmt(s['tok_s_runs'])}"
        )
    print(f"ratio tformer / HF bf16 tokens/s: {r['sides']['tformer']['tok_s'] / r['sides']['hf']['tok_s']:.2f}x")
    print(r["load_after"])


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_child(args: argparse.Namespace) -> None:
    """In a fresh process: RSS before the load, after it, and after a 16-token request; one JSON line."""
    set_threads(args.threads)
    path = files(args.dir, args.model)["q4_k_m"]
    prompt = random_prompt(config_of(args.model).vocab_size, 16, seed=1)
    if args.side == "tformer":
        before = rss_bytes()
        engine = load_engine(
            path, engine_config(kv_cache_bytes=kv_bytes(config_of(args.model), CONTEXT)), quantize="auto"
        )
        loaded = rss_bytes()
        engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        parts = {"model_bytes": model_bytes(engine.model), "kv_bytes": engine.kv.nbytes}
    else:
        import llama_cpp  # noqa: F401  (its shared libraries count in `before`, as torch's do on the other side)

        before, parts = rss_bytes(), {}
        llama = load_llamacpp(path, args.threads, CONTEXT)
        loaded = rss_bytes()
        for count, _ in enumerate(llama.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0), start=1):
            if count == 16:
                break
    print(json.dumps({"before": before, "loaded": loaded, "after_request": rss_bytes(), **parts}))


def memory(args: argparse.Namespace) -> dict:
    path = files(args.dir, args.model)["q4_k_m"]
    print(load_report("before"))
    result = {"file_bytes": path.stat().st_size, "sides": {}}
    for side in ("tformer", LLAMACPP):
        command = [sys.executable, __file__, "memory-child", "--model", args.model, "--dir", str(args.dir)]
        command += ["--side", "tformer" if side == "tformer" else "llamacpp", "--threads", str(args.threads)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        result["sides"][side] = json.loads(out)
    result["load_after"] = load_report("after")
    print_memory(args.model, result)
    return result


def print_memory(model: str, r: dict) -> None:
    size = r["file_bytes"]
    print(f"\n{model}: resident memory (VmRSS), each side in a fresh process; file {size / 1e9:.3f} GB")
    print(
        f"{'':12s} {'before load':>12s} {'after load':>11s} {'growth':>8s} {'x file':>7s} {'after 16 tok':>13s} "
        f"{'growth':>8s} {'x file':>7s}"
    )
    for side, s in r["sides"].items():
        grown, after = s["loaded"] - s["before"], s["after_request"] - s["before"]
        print(
            f"{side:12s} {s['before'] / 1e9:11.2f}G {s['loaded'] / 1e9:10.2f}G {grown / 1e9:7.2f}G "
            f"{grown / size:6.2f}x "
            f"{s['after_request'] / 1e9:12.2f}G {after / 1e9:7.2f}G {after / size:6.2f}x"
        )
        if "model_bytes" in s:
            print(
                f"{'':12s} of which weights and buffers {s['model_bytes'] / 1e9:.3f} GB, KV pool "
                f"{s['kv_bytes'] / 1e9:.3f} GB ({CONTEXT} tokens, 16-bit, as llama.cpp's n_ctx cache)"
            )
    print(r["load_after"])


def profile_parts(args: argparse.Namespace) -> None:
    """Where tformer's time goes: torch.profiler's top operators by self CPU time over 16 batch-1 decode steps
    and over one prompt of --prompt-tokens tokens (printed, not stored)."""
    from torch.profiler import ProfilerActivity, profile

    set_threads(args.threads)
    path = files(args.dir, args.model)["q4_k_m"]
    engine = load_engine(path, engine_config(kv_cache_bytes=kv_bytes(config_of(args.model), CONTEXT)), quantize="auto")
    vocab = engine.model.config.vocab_size
    engine.generate(random_prompt(vocab, 16, seed=1), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for label, prompt, n in (
        ("decode, 16 steps after a 16-token prompt", random_prompt(vocab, 16, seed=1), 17),
        (f"a prompt of {args.prompt_tokens} tokens", random_prompt(vocab, args.prompt_tokens, seed=2), 1),
    ):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        print(f"=== {args.model}: {label}")
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
        total = sum(a.self_cpu_time_total for a in averages)
        kernels = sum(a.self_cpu_time_total for a in averages if a.key in MATMULS)
        print(f"INT4, INT8 and Q6_K matmul kernels: {kernels / total:.1%} of the self CPU time")
    print(load_report("after"))


def store(model: str, part: str, result: dict) -> None:
    """Adds one part's result to benchmarks/results/gguf_vs_llamacpp.json, with the machine and the time."""
    file = RESULTS / "gguf_vs_llamacpp.json"
    data = json.loads(file.read_text()) if file.exists() else {}
    result = {**result, "machine": machine_info(), "uptime": uptime(), "date": time.strftime("%Y-%m-%d %H:%M UTC")}
    data.setdefault(model, {})[part] = result
    file.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


GOALS = {  # measure: (what, goal, whether the goal is a floor)
    "decode": ("batch-1 decode tok/s vs llama.cpp", 1.0, True),
    "prompt": ("prompt 512 tok/s vs llama.cpp", 1.0, True),
    "serve": ("32 requests tok/s vs HF bf16", 3.0, True),
    "memory": ("RSS growth after load / file size", 1.2, False),
}
PRINTERS = {"decode": print_decode, "serve": print_serve, "memory": print_memory}


def goals(parts: dict) -> list[tuple[str, float, float, bool]]:
    """(what, measured ratio, goal, met) for each goal the parts measured (a compiled run is its own row)."""
    rows = []
    for part, r in parts.items():
        kind, _, compiled = part.partition("+")
        suffix = f" ({r['tformer']})" if kind != "memory" else ""
        if kind == "decode":
            ours, theirs = r["sides"][r["tformer"]], r["sides"][LLAMACPP]
            rows.append(("decode", suffix, ours["decode_tok_s"] / theirs["decode_tok_s"]))
            rows.append(("prompt", suffix, ours["prompt_tok_s"] / theirs["prompt_tok_s"]))
        elif kind == "serve":
            rows.append(("serve", suffix, r["sides"]["tformer"]["tok_s"] / r["sides"]["hf"]["tok_s"]))
        elif kind == "memory":
            s = r["sides"]["tformer"]
            rows.append(("memory", "", (s["loaded"] - s["before"]) / r["file_bytes"]))
    out = []
    for goal, suffix, ratio in rows:
        what, target, floor = GOALS[goal]
        out.append(
            (
                what + suffix,
                ratio,
                f"{'>=' if floor else '<='} {target}x",
                ratio >= target if floor else ratio <= target,
            )
        )
    return out


def report(args: argparse.Namespace) -> None:
    import contextlib
    import io

    data = json.loads((RESULTS / "gguf_vs_llamacpp.json").read_text())
    lines: list[str] = []
    for model, parts in data.items():
        lines.append(f"==== {model} ====")
        lines.append(next(iter(parts.values()))["machine"])
        for part, result in sorted(parts.items()):
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                PRINTERS[part.partition("+")[0]](model, result)
            lines.append(f"\n[{part}: {result['date']}; uptime: {result['uptime']}]")
            lines.append(buffer.getvalue().strip())
        lines.append(f"\n{model}: goals")
        for what, ratio, goal, met in goals(parts):
            lines.append(f"  {what:70s} {ratio:6.2f}x  goal {goal}  {'met' if met else 'NOT met'}")
        lines.append("")
    text = "\n".join(lines) + "\n"
    (RESULTS / "gguf_vs_llamacpp.txt").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["make", "decode", "serve", "memory", "memory-child", "profile", "report"])
    parser.add_argument("--model", choices=list(MODELS), default="llama-1b")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tformer_gguf_bench"), help="scratch files")
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp n_threads")
    parser.add_argument("--tokens", type=int, default=64, help="decode: new tokens per batch-1 run")
    parser.add_argument("--runs", type=int, default=5, help="decode: timed batch-1 runs per side")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="decode: prompt processing length")
    parser.add_argument("--prompt-runs", type=int, default=3, help="decode: timed prompt runs per side")
    parser.add_argument("--requests", type=int, default=32, help="serve: concurrent requests")
    parser.add_argument("--rounds", type=int, default=2, help="serve: alternating rounds per side")
    parser.add_argument("--compile", action="store_true", help="decode, serve: tformer's decode steps compiled")
    parser.add_argument("--side", choices=["tformer", "llamacpp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "make":
        make(args)
    elif args.part == "memory-child":
        memory_child(args)
    elif args.part == "report":
        report(args)
    elif args.part == "profile":
        profile_parts(args)
    else:
        result = {"decode": decode, "serve": serve, "memory": memory}[args.part](args)
        print(f"uptime: {uptime()}")
        store(args.model, args.part + ("+compile" if getattr(args, "compile", False) else ""), result)


if __name__ == "__main__":
    main()
