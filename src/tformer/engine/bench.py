"""`tformer bench`: how fast an engine prefills and decodes on this machine, and what would make it faster.

Decoding one token reads every weight once, so at batch 1 its speed is bounded by memory bandwidth: the report
sets the weight bytes read per token times tokens/s against a measured copy bandwidth. Prefill and batched decoding
reuse each weight across many tokens and are bounded by the matmuls instead. The remedies are the usual ones for
slow inference, each marked by what was measured: the KV cache (always on here), an attention kernel that skips
the score matrix, quantization, batching, and a compiled decode step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from tformer.engine.engine import Engine
from tformer.engine.sampling import SamplingParams
from tformer.kernels.quantize import QUANTIZED_LINEARS, model_bytes


@dataclass
class BenchResult:
    """Tokens per second of each phase, and the bandwidth arithmetic of decoding at batch 1."""

    prompt_tokens: int
    new_tokens: int
    batch: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # batch 1, after the first token
    batch_decode_tokens_per_s: float  # `batch` requests at once, all rows together
    weight_bytes_per_token: int
    bandwidth_bytes_per_s: float

    @property
    def bandwidth_share(self) -> float:
        """Decoding's share of the measured copy bandwidth: near 1, only fewer bytes per token make it faster."""
        return self.weight_bytes_per_token * self.decode_tokens_per_s / self.bandwidth_bytes_per_s


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes one decode step reads: every weight, less the embedding tables, of which it reads one row.

    A table tied to the output head is read whole by the head, so it counts.
    """
    linear_weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    tables = {
        id(m.weight): m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and not any(m.weight is w for w in linear_weights)
    }
    return model_bytes(model) - sum(tables.values())


def copy_bandwidth(megabytes: int = 256, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second of a large tensor copy on `device` (each byte read once and written once), the median of
    `repeats`: the practical memory bandwidth that batch-1 decoding is held against."""
    source = torch.ones(megabytes << 18, device=device)  # float32: 4 bytes each
    target = torch.empty_like(source)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        if source.device.type != "cpu":
            torch.accelerator.synchronize(source.device)
        seconds.append(time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / statistics.median(seconds)


def _prompts(vocab_size: int, batch: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=generator).tolist()


def _run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Runs `prompts` together for `new_tokens` each: (seconds until every request has its first token, seconds
    from then until every request is done)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    started, first, done, all_first = time.perf_counter(), set(), set(), None
    while len(done) < len(ids):
        for out in engine.step():
            first.add(out.request_id)
            if out.finished:
                done.add(out.request_id)
        if all_first is None and len(first) == len(ids):
            all_first = time.perf_counter()
    for request_id in ids:
        engine.abort(request_id)  # finished already: this only forgets the request
    return all_first - started, time.perf_counter() - all_first


def bench_engine(engine: Engine, prompt_tokens: int = 128, new_tokens: int = 32, batch: int = 8) -> BenchResult:
    """Measures prefill and decoding of one `prompt_tokens` prompt, and decoding of `batch` prompts at once, after
    a warm-up. Prefill is the time to the first token; decoding is the time from the first token to the last.

    Every prompt is new (random tokens, another seed each time), so the prefix cache cannot serve any of it.
    """
    vocab = engine.model.config.vocab_size
    _run(engine, _prompts(vocab, 1, prompt_tokens, seed=0), 2)  # warm-up: allocations, a compiled step
    _run(engine, _prompts(vocab, min(batch, 2), prompt_tokens, seed=1), 2)  # batched steps compile apart
    prefill, decode = _run(engine, _prompts(vocab, 1, prompt_tokens, seed=2), new_tokens)
    _, batch_decode = _run(engine, _prompts(vocab, batch, prompt_tokens, seed=3), new_tokens)
    return BenchResult(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        batch=batch,
        prefill_tokens_per_s=prompt_tokens / prefill,
        decode_tokens_per_s=(new_tokens - 1) / decode,
        batch_decode_tokens_per_s=batch * (new_tokens - 1) / batch_decode,
        weight_bytes_per_token=weight_bytes_per_token(engine.model),
        bandwidth_bytes_per_s=copy_bandwidth(device=engine.kv.k[0].device),
    )


def _kv_cache_advice(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    line = "KV cache: always on (a paged cache; each decode step computes only the new token)"
    if kv_cache_dtype == "int8":
        return line + ", int8 keys and values"
    share = "a quarter" if dtype.itemsize == 4 else "half"
    return line + f"; --kv-cache-dtype int8 keeps keys and values in about {share} of the bytes (long contexts)"


def remedies(engine: Engine, result: BenchResult) -> list[str]:
    """The ways to faster inference, each saying whether this engine already uses it or what it would gain."""
    model = engine.model
    quantized = any(isinstance(m, QUANTIZED_LINEARS) for m in model.modules())
    dtype = next(model.parameters()).dtype
    gain = result.batch_decode_tokens_per_s / result.decode_tokens_per_s
    return [
        _kv_cache_advice(engine.config.kv_cache_dtype, engine.kv.dtype),
        f"attention kernel: {model.config.attention_backend}"
        + (
            " (fused, no score matrix)"
            if model.config.attention_backend == "sdpa"
            else " - set attention_backend: sdpa for the fused kernel that never builds the score matrix"
        ),
        "quantization: on"
        if quantized
        else f"quantization: off - decoding reads {result.weight_bytes_per_token / 2**20:.0f} MiB a token in {dtype}; "
        "--quantize int4 reads about an eighth of fp32's bytes, int8 or w8a8 a quarter (with bf16 activations)",
        f"batching: {result.batch} requests at once decode {gain:.1f}x the tokens/s of one; `tformer serve` batches "
        "concurrent requests continuously",
        "compiled decode: on"
        if engine.config.compile
        else "compiled decode: off - --compile fuses each decode step's small ops (minutes the first time)",
    ]


def format_bench(name: str, result: BenchResult, advice: list[str]) -> str:
    """The report `tformer bench` prints."""
    lines = [
        f"model            {name}",
        f"prefill          {result.prefill_tokens_per_s:,.0f} tok/s ({result.prompt_tokens}-token prompt)",
        f"decode, batch 1  {result.decode_tokens_per_s:,.1f} tok/s ({result.new_tokens} new tokens)",
        f"decode, batch {result.batch:<2d} {result.batch_decode_tokens_per_s:,.1f} tok/s in all",
        f"weights read     {result.weight_bytes_per_token / 2**20:,.1f} MiB per decode step; copy bandwidth "
        f"{result.bandwidth_bytes_per_s / 1e9:.1f} GB/s: batch-1 decoding uses {result.bandwidth_share:.0%} of it",
        "to go faster:",
    ]
    return "\n".join(lines + [f"  - {line}" for line in advice])
