"""The benchmarks' own helpers (benchmarks/common.py), against the formula they state."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402


def write_stat(path: Path, user: int, system: int, idle: int, steal: int) -> Path:
    # /proc/stat's first line: cpu user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {user} 0 {system} {idle} 0 0 0 {steal} 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
    return path


def test_stolen_share_is_the_steal_delta_over_the_total_delta(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "_last_cpu_times", [])
    stat = tmp_path / "stat"
    assert common.stolen_share(write_stat(stat, 600, 100, 200, 100)) == 100 / 1000  # since boot
    assert common.stolen_share(write_stat(stat, 700, 150, 250, 400)) == 300 / 500  # since the previous call
    assert common.stolen_share(stat) == 0.0  # nothing elapsed
    assert common.stolen_share(tmp_path / "missing") is None


def write_thread_stat(proc: Path, pid: int, tid: int, name: str, utime: int, stime: int) -> None:
    # /proc/<pid>/task/<tid>/stat: pid (comm) state ppid ... with utime and stime the 14th and 15th fields
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True)
    rest = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30
    (task / "stat").write_text(f"{tid} ({name}) {' '.join(rest)}\n")


def test_thread_cpu_seconds_reads_each_threads_user_and_system_ticks(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    write_thread_stat(tmp_path, 42, 42, "python", 300, 20)
    write_thread_stat(tmp_path, 42, 43, "odd) name (x", 7, 1)  # a name may hold spaces and parentheses
    assert common.thread_cpu_seconds(42, tmp_path) == {42: 320 / hz, 43: 8 / hz}
    assert common.thread_cpu_seconds(7, tmp_path) == {}  # no such process


def test_thread_cpu_seconds_matches_the_threads_own_clock():
    """Linux: the current thread's reading moves with time.thread_time(), to within the ticks' resolution."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs Linux /proc")
    tick, tid = 1 / os.sysconf("SC_CLK_TCK"), threading.get_native_id()
    before, clock = common.thread_cpu_seconds(os.getpid())[tid], time.thread_time()
    while time.thread_time() - clock < 0.3:
        pass
    spent = common.thread_cpu_seconds(os.getpid())[tid] - before
    assert abs(spent - (time.thread_time() - clock)) <= 2 * tick + 0.01


def test_step_ab_alternates_two_steps_each_and_rates_whole_windows():
    import step_ab

    assert [step_ab.variant_at(step, 0) for step in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [step_ab.variant_at(step, 1) for step in range(4)] == [1, 1, 0, 0]
    steps = [(0, 2.0), (0, 1.0), (1, 1.0), (1, 0.5), (1, 4.0), (1, 2.0), (0, 1.0), (0, 1.0), (0, 9.0)]
    assert step_ab.window_ratios(steps) == [3.0 / 1.5, 2.0 / 6.0]  # the trailing step makes no window
