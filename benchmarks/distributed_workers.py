"""What runs inside each training process of benchmarks/train_distributed.py (one rank, or the single process):
the Trainer loop with a profiler window after the measured steps (CommProbe), and the share of that window with
a collective in flight (collective_intervals, covered_length); run_worker is what `train_distributed.py --worker`
runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

# substrings of the profiler's op names that mark a collective: c10d ops (c10d::allreduce_, ...) and the
# functional collectives DTensor uses (_c10d_functional::all_reduce, ::wait_tensor), run on the training
# thread; gloo:* / nccl:* ops, run on the backend's worker threads; record_param_comms (CUDA builds)
COLLECTIVE_MARKERS = ("c10d::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")


def collective_intervals(events: list, window_us: float) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """(start, end) in microseconds of every collective op, clipped to the window, and total ms per op name."""
    intervals, per_name = [], {}
    for event in events:
        if not any(marker in event.name for marker in COLLECTIVE_MARKERS):
            continue
        start, end = max(event.time_range.start, 0.0), min(event.time_range.end, window_us)
        if end > start:
            intervals.append((start, end))
            per_name[event.name] = per_name.get(event.name, 0.0) + (end - start) / 1e3
    return intervals, per_name


def covered_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals: nested or overlapping collectives count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class CommProbe:
    """Profiles `n_steps` whole iterations of the training loop, from step `first_step` on, by wrapping the
    trainer's train_step: the profiler starts as step `first_step` begins and stops as step
    `first_step + n_steps` begins, so the window holds full iterations (batch building, the loop's stop
    check and train_step) and nothing else."""

    def __init__(self, first_step: int, n_steps: int) -> None:
        self.first_step, self.n_steps = first_step, n_steps
        self.profiler = None
        self.started = 0.0
        self.tokens = 0  # trained in the profiled iterations (global batch)
        self.result: dict | None = None

    def wrap(self, trainer: object, train_step):
        def profiled_train_step(batches: list) -> tuple[float, int]:
            upcoming = trainer.step + 1
            if self.n_steps and upcoming == self.first_step:
                self._start()
            elif self.n_steps and upcoming == self.first_step + self.n_steps:
                self._stop()
            loss, n_tokens = train_step(batches)
            if self.profiler is not None and self.result is None:
                self.tokens += n_tokens
            return loss, n_tokens

        return profiled_train_step

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.profiler.start()
        self.started = time.perf_counter()

    def _stop(self) -> None:
        window_us = (time.perf_counter() - self.started) * 1e6
        self.profiler.stop()
        intervals, per_name = collective_intervals(self.profiler.events(), window_us)
        comm_us = covered_length(intervals)
        self.result = {
            "steps": self.n_steps,
            "window_s": window_us / 1e6,
            "comm_s": comm_us / 1e6,
            "share": comm_us / window_us,
            "tokens_per_s": self.tokens / (window_us / 1e6),
            "ms_per_op": per_name,
        }


def run_worker(recipe: Path, measured_steps: int, profile_steps: int) -> None:
    """Trains as `recipe` says (no dev evaluation), profiling the iterations after `measured_steps`."""
    from tformer.training import Trainer, load_recipe, shutdown

    model_config, train_config = load_recipe(recipe)
    try:
        trainer = Trainer(model_config, train_config)
        trainer.data.dev = []  # the benchmark times training: no dev BLEU during or after it
        probe = CommProbe(first_step=measured_steps + 1, n_steps=profile_steps)
        trainer.train_step = probe.wrap(trainer, trainer.train_step)
        trainer.fit()
    finally:
        shutdown()
    if probe.result is not None:
        path = Path(train_config.out_dir) / f"comm-rank{trainer.dist.rank}.json"
        path.write_text(json.dumps(probe.result, indent=1), encoding="utf-8")
