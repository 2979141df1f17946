"""Small helpers shared by the benchmarks: threads, load reporting, matmul peak, alternating timing.

CPU timings on a shared machine are noisy, so every benchmark here
- pins torch to all cores explicitly (`set_threads`),
- interleaves the things it compares step by step in one process (`alternating_timing`), so that a burst of
  load from elsewhere hits both sides rather than one,
- reports medians, not means, and
- records the machine's load average beside the numbers (`load_report`).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import torch


def set_threads(n: int | None = None) -> int:
    """Sets torch's intra-op threads to `n` (default: every CPU) and returns the number set."""
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def uptime() -> str:
    """The `uptime` command's line, or the load average from os.getloadavg() where it is missing."""
    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def load_report(label: str) -> str:
    """One line: label, os.getloadavg() (1, 5, 15 minutes) and the `uptime` line."""
    one, five, fifteen = os.getloadavg()
    return f"load {label}: {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min)  [uptime: {uptime()}]"


def machine_info() -> str:
    """CPU model, core count, torch version and thread count, for the header of a report."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"python {platform.python_version()}"
    )


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 10, warmup: int = 3) -> float:
    """Achievable matmul FLOP/s: the median over `repeats` timed (n x n) @ (n x n) products in `dtype`.

    This is the practical ceiling a Transformer's matmuls can reach on this machine and build of torch,
    not the vendor's theoretical peak.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / median(times)


def alternating_timing(
    steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1, swap_order: bool = True
) -> dict[str, list[float]]:
    """Times each callable once per round, interleaved, and returns {name: [seconds per timed round]}.

    `warmup` untimed rounds run first. With `swap_order`, every other round runs the callables in reverse
    order, so neither side always runs right after the other (caches, allocator, CPU clocks).
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        order = names[::-1] if swap_order and i % 2 else names
        for name in order:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def fmt_rate(flops_per_s: float) -> str:
    """A FLOP/s figure in GFLOP/s with one decimal."""
    return f"{flops_per_s / 1e9:.1f} GFLOP/s"
