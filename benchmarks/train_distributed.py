"""Training throughput of tformer's distributed strategies on this machine's CPU, and the share of a step
spent in collectives.

Compared, all with the same model, data, seed and global batch (grad_accum x max_tokens tokens a step,
grad_accum = 2 so that two data-parallel ranks take one batch each):

- 1 process, no torchrun, torch using every core (and optionally `single-1t`: one thread, one rank's share);
- 2 ranks (torchrun, gloo) with train.parallel = ddp, fsdp (fsdp_sharding full: ZeRO-3), fsdp (grad-op:
  ZeRO-2) and tp (tensor parallel over both ranks, which then both see the two batches of a step);
- optionally fsdp+tp on 4 ranks (tp_size 2): `--strategies ...,fsdp+tp`.

Each configuration is one subprocess that runs tformer's own Trainer (the `tformer train` loop, dev BLEU
switched off) for `--steps` steps in its own temporary out_dir; the trainer logs tokens/s (global target
tokens over training time) to metrics.jsonl every `--log-every` steps. The first window is warm-up and
dropped; the table gives the median of the others. The tokenizer is trained once and copied into every
out_dir, so no run trains its own.

Communication share: after the measured steps every rank runs `--profile-steps` more loop iterations under
torch.profiler (CPU activity). The share is the time during which at least one collective was in flight in
rank 0 (the union of the intervals of the c10d / functional-collective ops on the training thread and of
gloo's own ops on its worker threads: issuing, transferring and waiting for the other rank), divided by the
wall time of those iterations. Collectives that overlap compute (DDP's gradient buckets during backward)
count in full, so this is an upper bound on the time communication costs a step. Every rank is profiled,
so the profiler slows them alike; its windows are not part of the tokens/s.

On a 2-core machine 2 ranks cannot show a scaling speedup over 1 process: each rank gets one core
(OMP_NUM_THREADS = cores / ranks) while the single process uses both, and the ranks' collectives run on
those same cores. This measures the overhead of each strategy, not its scaling (a ratio above 1 only means
that two processes keep two cores busier than one process's intra-op threads); 4 ranks oversubscribe 2 cores.

    nice -n 19 .venv/bin/python benchmarks/train_distributed.py                          # ~7 min on 2 cores
    nice -n 19 .venv/bin/python benchmarks/train_distributed.py --steps 20 --log-every 4 --rounds 2 \
        --strategies single,single-1t,ddp,fsdp,fsdp-grad-op,tp,fsdp+tp --wait-idle 300 \
        --output benchmarks/results/train_distributed.txt                              # the results file, ~17 min
    nice -n 19 .venv/bin/python benchmarks/train_distributed.py --steps 6 --log-every 2 --preset tiny-transformer \\
        --set train.max_len=60 --set train.vocab_size=500                                # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml
from common import busy_processes, load_report, machine_info, median, uptime, wait_for_idle
from train_step import Report, source_state

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = ROOT / "configs" / "en-de-10min.yaml"
RECIPE_FILE = "bench-recipe.yaml"
STOP_GRACE_S = 60.0  # seconds a stopped run gets to end its ranks before it is killed
NEVER = 10**9  # eval_every / save_every: no evaluation or checkpoint while measuring

# substrings of the profiler's op names that mark a collective: c10d ops (c10d::allreduce_, ...) and the
# functional collectives DTensor uses (_c10d_functional::all_reduce, ::wait_tensor), run on the training
# thread; gloo:* / nccl:* ops, run on the backend's worker threads; record_param_comms (CUDA builds)
COLLECTIVE_MARKERS = ("c10d::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")

SPEEDUP_CAVEAT = (
    "2 ranks on 2 cores cannot show a scaling speedup: each rank gets one core while the single process uses both, "
    "and the collectives run on those same cores. This measures each strategy's overhead, not its scaling; a ratio "
    "above 1 only means two processes keep the two cores busier than one process's two intra-op threads do."
)


@dataclass(frozen=True)
class Strategy:
    key: str  # the name on the command line
    label: str  # the name in the table
    ranks: int  # processes; 1 runs without torchrun
    overrides: tuple[str, ...] = ()
    threads: int | None = None  # torch threads per rank; None: the cores shared out evenly (--threads / ranks)


STRATEGIES = {
    s.key: s
    for s in (
        Strategy("single", "1 process", 1),
        Strategy("single-1t", "1 process, 1 thr", 1, threads=1),  # what one rank's core does alone
        Strategy("ddp", "ddp", 2, ("train.parallel=ddp",)),
        Strategy("fsdp", "fsdp (full)", 2, ("train.parallel=fsdp", "train.fsdp_sharding=full")),
        Strategy("fsdp-grad-op", "fsdp (grad-op)", 2, ("train.parallel=fsdp", "train.fsdp_sharding=grad-op")),
        Strategy("tp", "tp", 2, ("train.parallel=tp",)),
        Strategy("fsdp+tp", "fsdp+tp", 4, ("train.parallel=fsdp+tp", "train.tp_size=2")),
    )
}
DEFAULT_STRATEGIES = "single,ddp,fsdp,fsdp-grad-op,tp"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated, from: {', '.join(STRATEGIES)} (default {DEFAULT_STRATEGIES})",
    )
    p.add_argument("--steps", type=int, default=30, help="measured training steps per strategy (default 30)")
    p.add_argument(
        "--log-every", type=int, default=5, help="steps per tokens/s window; the first is warm-up (default 5)"
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=3,
        help="loop iterations profiled after the measured steps for the comm share; 0: none (default 3)",
    )
    p.add_argument(
        "--recipe", type=Path, default=DEFAULT_RECIPE, help="recipe giving model and data (default %(default)s)"
    )
    p.add_argument("--preset", default=None, help="train this model preset instead of the recipe's model section")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="recipe override, repeatable, e.g. --set model.d_model=512 --set train.max_len=60",
    )
    p.add_argument("--max-tokens", type=int, default=2048, help="token budget per batch (default 2048)")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=2,
        help="batches per step (global batch = grad_accum x max_tokens), a multiple of the dp ranks (default 2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="cores to use: the single process gets all, each of N ranks threads // N (default: all)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs per strategy, in alternating order; the table pools their windows (default 1)",
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other busy processes to finish (default 0)",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before a configuration is abandoned")
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="run in DIR and keep the out_dirs and logs (default: a temporary directory)",
    )
    p.add_argument("--output", type=Path, default=None, help="also write the report to this file")
    # worker mode: one training process, started by this script (alone or under torchrun)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for key in args.strategies:
        if key not in STRATEGIES:
            p.error(f"unknown strategy '{key}'; choose from {', '.join(STRATEGIES)}")
    if args.steps < 2 * args.log_every or args.log_every < 1:
        p.error("--steps must cover at least two --log-every windows (the first is warm-up)")
    if args.rounds < 1 or args.profile_steps < 0 or args.max_tokens < 2 or args.grad_accum < 1 or args.threads < 1:
        p.error("need --rounds >= 1, --profile-steps >= 0, --max-tokens >= 2, --grad-accum >= 1, --threads >= 1")
    return args


# ---- inside a training process ------------------------------------------------------------------------
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


# ---- the driver -----------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """One strategy's measurements, over all its runs (--rounds)."""

    strategy: Strategy
    threads_per_rank: int
    windows: list[float] = field(default_factory=list)  # tokens/s of the measured windows, warm-up dropped
    first_loss: float | None = None  # mean loss of the first window of the first run
    comm: list[dict[int, dict]] = field(default_factory=list)  # per run: rank -> CommProbe.result
    run_seconds: list[float] = field(default_factory=list)  # per run: the whole subprocess, startup included
    other_cores: list[float] = field(default_factory=list)  # per run: CPU used by other processes, in cores
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return median(self.windows) if self.windows else None

    @property
    def comm_share(self) -> float | None:
        """Rank 0's share, median over the runs."""
        shares = [run[0]["share"] for run in self.comm if 0 in run]
        return median(shares) if shares else None

    @property
    def profiled_tokens_per_s(self) -> float | None:
        """tokens/s of the profiled iterations (median over runs), to compare with the unprofiled windows."""
        rates = [run[0]["tokens_per_s"] for run in self.comm if 0 in run]
        return median(rates) if rates else None


def base_recipe(args: argparse.Namespace) -> dict:
    """The recipe every strategy shares: the model and data of --recipe / --preset, with the benchmark's
    batch, step count and logging, and no evaluation or checkpoint before the end."""
    from tformer.config import read_config_file

    recipe = read_config_file(args.recipe)
    model = {"preset": args.preset} if args.preset else dict(recipe.get("model") or {})
    train = dict(recipe.get("train") or {})
    train.update(
        max_tokens=args.max_tokens,
        grad_accum=args.grad_accum,
        log_every=args.log_every,
        max_steps=args.steps + args.profile_steps + (1 if args.profile_steps else 0),
        time_budget=0.0,
        eval_every=NEVER,
        save_every=NEVER,
        keep_last=1,
    )
    return {"model": model, "train": train}


def write_recipe(directory: Path, recipe: dict, overrides: list[str]) -> tuple[Path, object, object]:
    """Writes `recipe` with `overrides` applied and checked by tformer into directory/RECIPE_FILE."""
    from tformer.training import load_recipe

    directory.mkdir(parents=True, exist_ok=True)
    draft = directory / RECIPE_FILE
    draft.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    model_config, train_config = load_recipe(draft, overrides)
    draft.write_text(
        yaml.safe_dump({"model": model_config.to_dict(), "train": train_config.to_dict()}, sort_keys=False),
        encoding="utf-8",
    )
    return draft, model_config, train_config


def check_lengths(model_config: object, train_config: object) -> None:
    if train_config.max_len + 2 > model_config.max_seq_len:
        raise SystemExit(
            f"train.max_len ({train_config.max_len}) + 2 exceeds the model's max_seq_len "
            f"({model_config.max_seq_len}); add --set train.max_len={model_config.max_seq_len - 2}"
        )


def prepare_tokenizer(root: Path, recipe: dict, overrides: list[str]) -> tuple[Path, object, object]:
    """Trains the recipe's tokenizer once (tformer's prepare_data), for every run to reuse; returns its file and
    the model and train configs, the model's with the tokenizer's vocabulary as the trainer sets it."""
    from tformer.data.tokenizer import FILE_NAME
    from tformer.training.corpus import prepare_data

    directory = root / "tokenizer"
    _, model_config, train_config = write_recipe(directory, recipe, [*overrides, f"train.out_dir={directory}"])
    check_lengths(model_config, train_config)
    tokenizer = prepare_data(train_config, directory).tokenizer
    model_config = replace(
        model_config, vocab_size=tokenizer.vocab_size, tgt_vocab_size=None, pad_token_id=tokenizer.pad_id
    )
    return directory / FILE_NAME, model_config, train_config


def launch_command(strategy: Strategy, recipe: Path, args: argparse.Namespace) -> list[str]:
    worker = [
        str(Path(__file__).resolve()),
        "--worker",
        str(recipe),
        "--steps",
        str(args.steps),
        "--log-every",
        str(args.log_every),
        "--profile-steps",
        str(args.profile_steps),
    ]
    if strategy.ranks == 1:
        return [sys.executable, *worker]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(strategy.ranks),
        *worker,
    ]


def run_strategy(outcome: Outcome, root: Path, recipe: dict, tokenizer: Path, args: argparse.Namespace) -> str:
    """Trains one configuration in a fresh out_dir, adds its tokens/s windows and comm shares to `outcome`, and
    says in a line how the run went."""
    strategy = outcome.strategy
    out_dir = root / strategy.key
    shutil.rmtree(out_dir, ignore_errors=True)
    path, _, _ = write_recipe(out_dir, recipe, [*args.overrides, *strategy.overrides, f"train.out_dir={out_dir}"])
    shutil.copy(tokenizer, out_dir / tokenizer.name)
    env = {**os.environ, "OMP_NUM_THREADS": str(outcome.threads_per_rank), "PYTHONUNBUFFERED": "1"}
    log = out_dir / "log.txt"
    started, machine_cpu, own_cpu = time.perf_counter(), machine_cpu_seconds(), children_cpu_seconds()
    code = run_logged(launch_command(strategy, path, args), env, log, args.timeout)
    outcome.run_seconds.append(time.perf_counter() - started)
    others = (machine_cpu_seconds() - machine_cpu) - (children_cpu_seconds() - own_cpu)
    outcome.other_cores.append(max(others, 0.0) / outcome.run_seconds[-1])
    if code != 0:
        failure = "timed out" if code is None else f"exit code {code}"
        outcome.errors.append(f"{failure}; last lines of {log}:\n" + "\n".join(log_tail(log)))
        return f"FAILED, {outcome.errors[-1]}"
    windows, first_loss = read_metrics(out_dir / "metrics.jsonl", args.steps)
    outcome.windows += windows
    if outcome.first_loss is None:
        outcome.first_loss = first_loss
    ranks = {
        int(p.stem.removeprefix("comm-rank")): json.loads(p.read_text(encoding="utf-8"))
        for p in out_dir.glob("comm-rank*.json")
    }
    if ranks:
        outcome.comm.append(ranks)
    share = f", comm share {ranks[0]['share']:.0%}" if 0 in ranks else ""
    return f"{median(windows):.0f} tokens/s{share}; other processes used {outcome.other_cores[-1]:.2f} cores"


def machine_cpu_seconds() -> float:
    """CPU seconds all processes have used since boot, from /proc/stat (0 where it is missing)."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this script's finished child processes and theirs (torchrun waits for its ranks)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_logged(command: list[str], env: dict[str, str], log: Path, timeout: float) -> int | None:
    """Runs `command` with its output in `log`; the exit code, or None when it ran past `timeout`. On a timeout,
    Ctrl-C or when this script is terminated, the command gets SIGTERM (torchrun passes it on to its ranks, which
    run in process groups of their own), then SIGKILL if it is still there after `STOP_GRACE_S`."""
    with open(log, "w", encoding="utf-8") as f:
        process = subprocess.Popen(
            command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )  # a Ctrl-C in the terminal reaches this script only
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def log_tail(log: Path, n: int = 12) -> list[str]:
    lines = [
        line
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines()
        if line.strip() and "train:" not in line and not line.startswith("USDT")
    ]
    return ["    " + line for line in lines[-n:]]


def read_metrics(metrics: Path, measured_steps: int) -> tuple[list[float], float]:
    """From the trainer's metrics.jsonl: tokens/s of the windows ending at or before `measured_steps`, the
    first (warm-up) dropped; and the loss of the first window, to check that every strategy trains the same
    thing."""
    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    windows = [r for r in records if "tokens_per_s" in r and r["step"] <= measured_steps]
    return [r["tokens_per_s"] for r in windows[1:]], windows[0]["loss"]


# ---- the report -----------------------------------------------------------------------------------------
def table(outcomes: list[Outcome]) -> list[str]:
    baseline = next((o.tokens_per_s for o in outcomes if o.strategy.key == "single" and o.tokens_per_s), None)
    header = (
        f"{'strategy':<16} {'ranks x threads':>15} {'tokens/s':>9} {'min-max':>11} {'vs 1 process':>12} "
        f"{'comm share':>10} {'loss w1':>8} {'run s':>6} {'others':>6}"
    )
    lines = [header, "-" * len(header)]
    for o in outcomes:
        shape = f"{o.strategy.ranks} x {o.threads_per_rank}"
        if o.tokens_per_s is None:
            lines.append(f"{o.strategy.label:<16} {shape:>15} {'failed':>9}")
            continue
        spread = f"{min(o.windows):.0f}-{max(o.windows):.0f}"
        ratio = f"{o.tokens_per_s / baseline:.2f}x" if baseline else "-"
        share = f"{o.comm_share:.0%}" if o.comm_share is not None else "-"
        lines.append(
            f"{o.strategy.label:<16} {shape:>15} {o.tokens_per_s:>9.0f} {spread:>11} {ratio:>12} "
            f"{share:>10} {o.first_loss:>8.3f} {median(o.run_seconds):>6.0f} {max(o.other_cores):>6.2f}"
        )
    return lines


def comm_details(outcome: Outcome, top: int = 3) -> str:
    """Every run's per-rank shares, the profiled iterations' speed and rank 0's most expensive collective ops."""
    runs = "; ".join(", ".join(f"rank {r} {c['share']:.0%}" for r, c in sorted(run.items())) for run in outcome.comm)
    ops = sorted(outcome.comm[0].get(0, {}).get("ms_per_op", {}).items(), key=lambda kv: -kv[1])[:top]
    named = ", ".join(f"{name} {ms:.0f} ms" for name, ms in ops) or "none"
    return (
        f"{outcome.strategy.label}: comm share by run and rank: {runs}. The profiled iterations ran at "
        f"{outcome.profiled_tokens_per_s:.0f} tokens/s against {outcome.tokens_per_s:.0f} unprofiled (the "
        f"profiler's cost plus batch-to-batch variation). Rank 0's top collectives over "
        f"{outcome.comm[0][0]['steps']} iterations (summed, may nest): {named}"
    )


def describe_model(config: object) -> str:
    from tformer.info import model_info

    layers = [
        f"{config.n_encoder_layers} encoder" if config.has_encoder else "",
        f"{config.n_decoder_layers} decoder" if config.has_decoder else "",
    ]
    return (
        f"{config.family}, d_model {config.d_model}, {config.n_heads} heads, d_ff {config.d_ff}, "
        f"{' + '.join(filter(None, layers))} layers, vocab {config.vocab_size}, "
        f"{model_info(config).n_params:,} parameters"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args.worker, args.steps, args.profile_steps)
        return 0
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # clean up as after Ctrl-C
    out = Report(args.output)
    out("train_distributed: tformer training throughput per distributed strategy, CPU (gloo), one machine")
    out(f"machine: {machine_info()}")
    out(f"command: {' '.join(sys.argv)}")
    out(f"tformer source: {source_state()}")
    out(f"uptime before: {uptime()}")
    out(f"other busy processes before: {busy_processes()}")
    out(f"NOTE: {SPEEDUP_CAVEAT}")
    recipe = base_recipe(args)
    root = args.keep or Path(tempfile.mkdtemp(prefix="tformer-train-distributed-"))
    outcomes = {
        key: Outcome(STRATEGIES[key], STRATEGIES[key].threads or max(1, args.threads // STRATEGIES[key].ranks))
        for key in args.strategies
    }
    try:
        started = time.perf_counter()
        tokenizer, model_config, train_config = prepare_tokenizer(root, recipe, args.overrides)
        describe_settings(out, args, model_config, train_config, time.perf_counter() - started)
        for round_ in range(args.rounds):
            order = args.strategies[::-1] if round_ % 2 else args.strategies  # load drifts: alternate the order
            for key in order:
                if args.wait_idle > 0:
                    waited, busy = wait_for_idle(args.wait_idle)
                    out(f"waited {waited:.0f} s for other processes to go quiet; still busy: {busy}")
                outcome = outcomes[key]
                result = run_strategy(outcome, root, recipe, tokenizer, args)
                out(
                    f"round {round_ + 1}, {outcome.strategy.label}: {result} (run {outcome.run_seconds[-1]:.0f} s); "
                    f"{load_report('after')}"
                )
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    out()
    for line in table(list(outcomes.values())):
        out(line)
    out(
        "tokens/s: target tokens of the global batch per second of training, median of the windows of all rounds; "
        "comm share: rank 0's time with a collective in flight / wall time of the profiled iterations (an upper "
        "bound: collectives that overlap compute count in full); run s: the whole subprocess, startup included; "
        "others: the most CPU other processes used during one of its runs, in cores (from /proc/stat less this "
        "script's children); well above 0: the run shared its cores, its tokens/s may be low"
    )
    out(
        "loss w1: mean loss of the first window; the same global batches and seed give about the same loss "
        "(dropout masks differ between data-parallel layouts)"
    )
    for outcome in outcomes.values():
        if outcome.comm and outcome.strategy.ranks > 1:
            out(comm_details(outcome))
    out(f"NOTE: {SPEEDUP_CAVEAT}")
    out(f"uptime after: {uptime()}")
    out(f"other busy processes after: {busy_processes()}")
    out.save()
    return 0 if not any(o.errors for o in outcomes.values()) else 1


def describe_settings(
    out: Report, args: argparse.Namespace, model_config: object, train_config: object, tokenizer_s: float
) -> None:
    source = f"recipe {args.recipe}" + (f", preset {args.preset}" if args.preset else "")
    overrides = f"; {' '.join(args.overrides)}" if args.overrides else ""
    out(f"model: {describe_model(model_config)} ({source}{overrides})")
    out(
        f"data: {train_config.corpus} ({train_config.objective}), vocab {train_config.vocab_size}, max_len "
        f"{train_config.max_len}; global batch = grad_accum {train_config.grad_accum} x max_tokens "
        f"{train_config.max_tokens} = {train_config.grad_accum * train_config.max_tokens} padded tokens a step "
        f"for every strategy; bf16 {train_config.bf16}, optimizer {train_config.optimizer}"
    )
    out(
        f"runs: {args.rounds} round(s), order reversed every other round; each run trains {args.steps} measured "
        f"steps (tokens/s logged every {args.log_every}, the first window dropped as warm-up), then "
        f"{args.profile_steps} profiled; the tokenizer was trained once ({tokenizer_s:.0f} s) and is copied into "
        f"every run; threads: --threads {args.threads} shared out evenly between the ranks (OMP_NUM_THREADS)"
    )
    out()


if __name__ == "__main__":
    sys.exit(main())
