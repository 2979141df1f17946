"""tformer.threads: one thread fewer per core another process keeps busy, decided before torch loads."""

import os
import subprocess
import sys
import time

import pytest

from tformer.threads import apply_thread_policy, busy_elsewhere, cores, running_tasks


def test_a_quiet_machine_keeps_openmps_defaults():
    environ: dict[str, str] = {}
    assert apply_thread_policy(environ, busy=lambda: 0, torch_loaded=False) == {}
    assert environ == {}


def test_each_busy_core_takes_one_thread_away_down_to_one():
    for others, threads in ((1, max(1, cores() - 1)), (cores() + 5, 1)):
        environ: dict[str, str] = {}
        assert apply_thread_policy(environ, busy=lambda n=others: n, torch_loaded=False) == {
            "OMP_NUM_THREADS": str(threads)
        }
        assert environ["OMP_NUM_THREADS"] == str(threads)


def test_the_users_settings_and_a_loaded_torch_win():
    for environ in ({"OMP_NUM_THREADS": "2"}, {"TFORMER_THREAD_POLICY": "off"}):
        before = dict(environ)
        assert apply_thread_policy(environ, busy=lambda: 1, torch_loaded=False) == {}
        assert environ == before
    assert apply_thread_policy({}, busy=lambda: 1, torch_loaded=True) == {}


def test_only_tasks_running_in_every_sample_count_as_busy(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("1.52 1.40 1.47 3/166 18486\n")
    assert running_tasks(loadavg) == 3
    assert running_tasks(tmp_path / "missing") is None
    samples = iter([3, 2, 4, 3, 3])  # a short-lived task shows up in some samples only
    assert busy_elsewhere(lambda: next(samples)) == 1  # the sampling thread itself is one of the running
    assert busy_elsewhere(lambda: None) == 0


PROBE = "import tformer.cli; tformer.cli.main(['info', 'gpt2']); import torch; print(torch.get_num_threads())"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or cores() < 2, reason="needs Linux and 2 cores")
def test_the_cli_runs_fewer_threads_beside_a_busy_process():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TFORMER_THREAD_POLICY")}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    try:
        time.sleep(0.3)
        result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        assert int(result.stdout.split()[-1]) <= cores() - 1  # other neighbours may take more
        mine = subprocess.run(
            [sys.executable, "-c", PROBE], capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "2"}
        )
        assert int(mine.stdout.split()[-1]) == 2  # the user's choice wins
    finally:
        busy.kill()
        busy.wait()
