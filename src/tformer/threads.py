"""How many threads tformer runs, decided before torch loads, so that a CPU shared with busy processes stays usable.

torch's CPU build runs its intra-op thread pool on GNU OpenMP. Every parallel region (each matmul of a decode
step) waits for its slowest thread; a thread that shares its core with another CPU-bound process gets a turn only
when the scheduler gives one, and OpenMP's spinning waiters use up their own slices meanwhile, so beam search
beside one busy process slows several-fold (docs/shared-host.md has the measurements). Of the levers, passive
waiting (OMP_WAIT_POLICY=PASSIVE) bounds the slowdown but makes the quiet case pay a wake-up per region; one
thread fewer per busy core costs the quiet case nothing. So at start `apply_thread_policy` counts the processes
already running on other cores and, when there are some, asks OpenMP for one thread per core left
(OMP_NUM_THREADS). `tformer.cli.main` applies it before any command imports torch; a variable the user set wins,
and `TFORMER_THREAD_POLICY=off` turns the policy off.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path

SAMPLES, INTERVAL = 5, 0.002  # a busy process is runnable in every sample; a passing one is not


def running_tasks(loadavg: Path = Path("/proc/loadavg")) -> int | None:
    """Tasks runnable now, this one included (the 4th field of /proc/loadavg); None where it cannot be read."""
    try:
        return int(loadavg.read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def busy_elsewhere(sample: Callable[[], int | None] = running_tasks) -> int:
    """Other tasks that were runnable in each of SAMPLES looks a few milliseconds apart: CPU-bound neighbours."""
    counts = []
    for i in range(SAMPLES):
        count = sample()
        if count is None:
            return 0
        counts.append(count)
        if i + 1 < SAMPLES:
            time.sleep(INTERVAL)
    return max(0, min(counts) - 1)  # the sampling thread itself is running


def cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def apply_thread_policy(
    environ: MutableMapping[str, str] = os.environ,
    busy: Callable[[], int] = busy_elsewhere,
    torch_loaded: bool | None = None,
) -> dict[str, str]:
    """When other processes keep cores busy, sets OMP_NUM_THREADS to the cores left (at least 1); returns the
    variables it set. Does nothing once torch is loaded (OpenMP has read its settings; `torch_loaded` None looks
    in sys.modules), when the user set OMP_NUM_THREADS, or with TFORMER_THREAD_POLICY=off."""
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    if torch_loaded or "OMP_NUM_THREADS" in environ or environ.get("TFORMER_THREAD_POLICY") == "off":
        return {}
    n_cores = cores()
    others = busy()
    if others == 0:
        return {}
    chosen = {"OMP_NUM_THREADS": str(max(1, n_cores - others))}
    environ.update(chosen)
    return chosen
