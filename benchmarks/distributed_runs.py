"""The driver side of benchmarks/train_distributed.py: the strategies compared (Strategy, STRATEGIES), the recipe
every run shares and the tokenizer trained once for all, and one configuration's run: its out_dir and recipe,
the command (alone or under torchrun), the subprocess with its log, timeout and clean stop, and the tokens/s
windows and comm shares it leaves behind (Outcome)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml
from common import median

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().with_name("train_distributed.py")  # every training process runs it with --worker
RECIPE_FILE = "bench-recipe.yaml"
STOP_GRACE_S = 60.0  # seconds a stopped run gets to end its ranks before it is killed
NEVER = 10**9  # eval_every / save_every: no evaluation or checkpoint while measuring


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
        str(SCRIPT),
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
