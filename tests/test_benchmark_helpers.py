"""The benchmarks' own helpers (benchmarks/common.py), against the formula they state."""

import sys
from pathlib import Path

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
