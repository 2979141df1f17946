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
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from common import busy_processes, load_report, machine_info, median, uptime, wait_for_idle
from distributed_runs import (
    DEFAULT_STRATEGIES,
    ROOT,
    STRATEGIES,
    Outcome,
    base_recipe,
    prepare_tokenizer,
    run_strategy,
)
from distributed_workers import run_worker
from train_step import Report, source_state

DEFAULT_RECIPE = ROOT / "configs" / "en-de-10min.yaml"

SPEEDUP_CAVEAT = (
    "2 ranks on 2 cores cannot show a scaling speedup: each rank gets one core while the single process uses both, "
    "and the collectives run on those same cores. This measures each strategy's overhead, not its scaling; a ratio "
    "above 1 only means two processes keep the two cores busier than one process's two intra-op threads do."
)


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
