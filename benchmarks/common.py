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
from pathlib import Path

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


_last_cpu_times: list[int] = []


def stolen_share(stat: Path = Path("/proc/stat")) -> float | None:
    """The share of CPU time the hypervisor gave to other guests (`steal` in /proc/stat) since the previous call,
    or since boot at the first; None where /proc/stat is missing. On a shared virtual machine it is the load that
    `uptime` does not see: 5-50% in 5-second windows on one such machine (2026-12-03), which made the same decode
    run read 16 to 108 tok/s."""
    try:
        fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    before = _last_cpu_times[:] or [0] * len(fields)
    _last_cpu_times[:] = fields
    spent = [now - then for now, then in zip(fields, before, strict=True)]
    return spent[7] / sum(spent) if sum(spent) > 0 else 0.0


def load_report(label: str) -> str:
    """One line: label, os.getloadavg() (1, 5, 15 minutes), the share of CPU time stolen by other virtual
    machines since the previous report (`stolen_share`) and the `uptime` line."""
    one, five, fifteen = os.getloadavg()
    stolen = stolen_share()
    steal = "" if stolen is None else f", {stolen:.0%} stolen by other guests since the last report"
    return f"load {label}: {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min){steal}  [uptime: {uptime()}]"


def _cpu_ticks(stat: Path) -> tuple[str, int] | None:
    """(name, utime + stime in clock ticks) from a process's or a thread's /proc `stat` file; None if it is gone."""
    try:
        text = stat.read_text(encoding="utf-8")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces and ")"
    return text[text.index("(") + 1 : text.rindex(")")], int(fields[11]) + int(fields[12])


def thread_cpu_seconds(pid: int, proc: Path = Path("/proc")) -> dict[int, float]:
    """CPU seconds (user + system) each thread of process `pid` has used, by thread id; {} without /proc. Two
    readings around some work tell which threads did it: a server's event loop (its main thread, id `pid`) apart
    from its engine and OpenMP threads."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(proc / str(pid) / "task")
    except OSError:
        return {}
    seconds = {}
    for tid in tids:
        read = _cpu_ticks(proc / str(pid) / "task" / tid / "stat")
        if read is not None:
            seconds[int(tid)] = read[1] / hz
    return seconds


def busy_processes(interval: float = 0.5, min_share: float = 0.1) -> str:
    """Other processes that used more than `min_share` of a CPU over `interval` seconds (Linux /proc).

    The load average cannot tell the benchmark's own threads from a competitor; this names the competitors.
    """

    def snapshot() -> dict[int, tuple[str, int]]:
        ticks = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                read = _cpu_ticks(Path("/proc", entry, "stat"))
                if read is not None:
                    ticks[int(entry)] = read
        return ticks

    if not os.path.isdir("/proc"):
        return "unknown (no /proc)"
    hz = os.sysconf("SC_CLK_TCK")
    first = snapshot()
    time.sleep(interval)
    second = snapshot()
    busy = []
    for pid, (name, t) in second.items():
        share = (t - first.get(pid, (name, t))[1]) / hz / interval
        if share >= min_share:
            busy.append((share, pid, name))
    busy.sort(reverse=True)
    return ", ".join(f"{name} (pid {pid}) {share:.0%} of a CPU" for share, pid, name in busy) or "none"


def wait_for_idle(timeout: float, min_share: float = 0.5) -> tuple[float, str]:
    """Polls until no other process uses `min_share` of a CPU, or `timeout` seconds pass.

    Returns (seconds waited, the last busy_processes() answer: 'none' when the machine went quiet).
    """
    start = time.perf_counter()
    busy = busy_processes(1.0, min_share)
    while busy != "none" and time.perf_counter() - start < timeout:
        time.sleep(2.0)
        busy = busy_processes(1.0, min_share)
    return time.perf_counter() - start, busy


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def machine_info() -> str:
    """CPU model with its family and model numbers, core count, torch version and thread count, for the header of a
    report. The numbers tell apart CPUs that a hypervisor names alike: "AMD EPYC" has named a Zen 4 (family 25,
    model 17) and a CPU with AVX-VNNI, which Zen 4 lacks."""
    cpu = platform.processor() or "unknown CPU"
    fields = cpuinfo() or {}
    if "model name" in fields:
        cpu = f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
    return (
        f"{cpu}, {os.cpu_count()} CPUs, flags: {cpu_flags()}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, python {platform.python_version()}"
    )


def kernel_paths() -> str:
    """Which attention and integer-matmul kernels tformer's engine runs on this machine, for a report's header."""
    from tformer.kernels import causal_attention, elementwise, int4, paged_attention, q4k, q6k, w8a8

    if paged_attention.kernel() is None:
        attention = "gathered keys and values (the in-place kernel is unavailable here)"
    else:
        attention = "in place over the paged cache (paged_decode_attention)"
    lines = [f"tformer decode attention: {attention}"]
    for name, module in (("int4", int4), ("q4k", q4k), ("q6k", q6k), ("w8a8", w8a8)):
        if not module.available():
            how = "the formula in torch (the kernel is unavailable here)"
        else:
            how = {"AVX512-VNNI": "AVX512-VNNI dot products", "AVX2": "AVX2 byte multiplies (vpmaddubsw)"}.get(
                module.instructions(), "the kernel's portable loop (neither AVX512-VNNI nor AVX2)"
            )
        lines.append(f"tformer {name} matmuls: {how}")
    if not elementwise.available():
        fused = "torch's ops (the fused kernels are unavailable here)"
    elif elementwise.instructions() == "portable":
        fused = "fused kernels, SiLU in torch (this build has no vector lanes for it)"
    else:
        fused = f"fused kernels (SiLU on {elementwise.instructions()} lanes)"
    lines.append(f"tformer eager RMSNorm, rotary and SwiGLU in bf16: {fused}")
    width = causal_attention.lane_width()
    prompts = f"the causal kernel on {width} lanes, up to {causal_attention.MAX_KEYS} keys" if width else "torch's SDPA"
    lines.append(f"tformer prompt attention in bf16 (packed steps): {prompts}")
    return "\n".join(lines)


MATMUL_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2")


def cpuinfo() -> dict[str, str] | None:
    """The first processor's fields in /proc/cpuinfo ("model name", "cpu family", "flags", ...), or None where the
    file cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block ends
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    return fields


def cpu_flags() -> str:
    """The CPU features that decide which matmul kernels oneDNN and fbgemm pick (AMX tiles, AVX-512 BF16, VNNI):
    the same benchmark runs 2-5x apart on machines that differ here, so every report names them."""
    fields = cpuinfo()
    if fields is None:
        return "unknown"
    present = set(fields.get("flags", "").split())
    return " ".join(flag for flag in MATMUL_FLAGS if flag in present) or "none of " + ", ".join(MATMUL_FLAGS)


def matmul_probe(dtype: torch.dtype = torch.float32, n: int = 2048, count: int = 2) -> tuple[Callable[[], None], int]:
    """A callable doing `count` (n x n) @ (n x n) products in `dtype`, and the FLOPs one call does.

    Put it among the steps of `alternating_timing` to measure the matmul peak under the same conditions
    (load from other processes, clocks) as the steps themselves.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)

    def probe() -> None:
        for _ in range(count):
            torch.matmul(a, b, out=out)

    return probe, 2 * n**3 * count


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 10, warmup: int = 3) -> float:
    """Achievable matmul FLOP/s: the median over `repeats` timed (n x n) @ (n x n) products in `dtype`.

    This is the practical ceiling a Transformer's matmuls can reach on this machine and build of torch,
    not the vendor's theoretical peak.
    """
    probe, flops = matmul_probe(dtype, n, count=1)
    for _ in range(warmup):
        probe()
    return flops / median_seconds(probe, repeats)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


class Timings(dict):
    """{name: [wall seconds per timed round]}, plus `cpu`: {name: [this process's CPU seconds per round]}."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__({name: [] for name in names})
        self.cpu: dict[str, list[float]] = {name: [] for name in names}

    def cpu_share(self, name: str, threads: int) -> float:
        """Median of CPU time / (wall time x threads): near 1.0 when the step had every core to itself.

        Clearly below 1.0 means other processes took cores (or the step has serial stretches); compare
        the two sides of a benchmark, which run under the same conditions.
        """
        return median([c / (w * threads) for c, w in zip(self.cpu[name], self[name], strict=True)])


def alternating_timing(
    steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1, swap_order: bool = True
) -> Timings:
    """Times each callable once per round, interleaved, and returns their Timings.

    `warmup` untimed rounds run first. With `swap_order`, every other round runs the callables in reverse
    order, so neither side always runs right after the other (caches, allocator, CPU clocks).
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times = Timings(names)
    for i in range(rounds):
        order = names[::-1] if swap_order and i % 2 else names
        for name in order:
            cpu, start = time.process_time(), time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
            times.cpu[name].append(time.process_time() - cpu)
    return times


def fmt_rate(flops_per_s: float) -> str:
    """A FLOP/s figure in GFLOP/s with one decimal."""
    return f"{flops_per_s / 1e9:.1f} GFLOP/s"
