"""Context parallelism (ring attention, `train.context_parallel`) against one process: time per training step and
peak memory per rank, at a few sequence lengths, on this machine's CPU.

The model is a small LLaMA-style decoder (RoPE, GQA 4/2 heads, SwiGLU, d 256, 4 layers, vocab 512), one sequence
of T random tokens a step, fp32, AdamW. The same code the trainer runs: one process calls the model with torch's
SDPA (its CPU flash kernel: attention memory is already linear in T there), 2 ranks (torchrun, gloo) wrap it in
`ContextParallel` (zigzag shards, ring attention, DDP all-reduce) and feed it `shard_lm_batch`'s shard.

Memory is the peak resident set of each process (getrusage ru_maxrss) above its size just before the first step
(model, optimizer and inputs built, torch imported), so it counts activations, gradients, Adam's moments and the
allocator's slack. Time is the median of the steps after the first (warm-up): wall time, and the CPU time the
processes used (every thread, summed over ranks), which a busy machine inflates far less than wall time.

On 2 cores, 2 ranks get one thread each while the single process gets both, and the ranks' sends and all-reduces
run on the same cores: this cannot show a speed-up. What context parallelism buys here is memory per rank.

    .venv/bin/python benchmarks/context_parallel.py                         # 4k and 16k tokens, ~5 min on 2 cores
    .venv/bin/python benchmarks/context_parallel.py --lengths 1024 --steps 2  # smoke run
    .venv/bin/python benchmarks/context_parallel.py --output benchmarks/results/context_parallel.txt
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import load_report, wait_for_idle

MODEL = {
    "preset": "tiny-llama",
    "vocab_size": 512,
    "d_model": 256,
    "n_decoder_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_ff": 688,
    "dropout": 0.0,
    "attn_dropout": 0.0,
}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def worker(seq_len: int, steps: int) -> None:
    """One process's measurement; prints a JSON line from rank 0 (every rank's figures gathered)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tformer.config import ModelConfig
    from tformer.data import LMBatch
    from tformer.models import build_model
    from tformer.training.context_parallel import context_parallel, shard_lm_batch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict({**MODEL, "max_seq_len": seq_len}))
    ids = torch.randint(0, MODEL["vocab_size"], (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = LMBatch(ids[:, :-1], torch.ones(1, seq_len, dtype=torch.long), ids[:, 1:])
    module = model
    if world > 1:
        dist.init_process_group("gloo")
        module = context_parallel(model, "clm", torch.device("cpu"), 0)
        batch = shard_lm_batch(batch, dist.get_rank(), world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    baseline, seconds, cpu_seconds, losses = peak_rss_mib(), [], [], []
    for _ in range(steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        # one process: no mask, so SDPA takes its causal kernel (an all-ones mask would only cost it time)
        logits = module(batch.input_ids, batch.attention_mask) if world > 1 else module(batch.input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum") / seq_len
        (loss * world).backward()  # DDP averages over the ranks: make it a sum of their shares
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.process_time() - cpu_started)
        losses.append(loss.item())
    mine = {
        "peak_mib": peak_rss_mib() - baseline,
        "seconds": statistics.median(seconds[1:]),
        "cpu_seconds": statistics.median(cpu_seconds[1:]),
        "losses": losses,
    }
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() != 0:
            return
    losses = [sum(step) for step in zip(*(r["losses"] for r in everyone), strict=True)]
    print(json.dumps({"ranks": everyone, "losses": losses}), flush=True)


def run(seq_len: int, ranks: int, steps: int, threads: int) -> dict:
    """The worker in 1 process, or under torchrun, with `threads` threads a process."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    args = [str(Path(__file__)), "--worker", "--lengths", str(seq_len), "--steps", str(steps)]
    runner = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    result = subprocess.run([sys.executable, *runner, *args], capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,16384", help="comma-separated sequence lengths")
    parser.add_argument("--steps", type=int, default=4, help="steps per run, the first one warm-up")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--output", type=Path, help="also write the report here")
    parser.add_argument("--wait-idle", type=float, default=0.0, help="wait up to this many seconds for a quiet CPU")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.worker:
        worker(lengths[0], args.steps)
        return
    waited, busy = wait_for_idle(args.wait_idle) if args.wait_idle else (0.0, "not checked")
    lines = [f"context parallelism, {time.strftime('%Y-%m-%d')}, model {json.dumps(MODEL)}"]
    lines += [f"waited {waited:.0f} s for a quiet CPU; other busy processes: {busy}", load_report("before")]
    header = "| tokens | setup | wall s / step | CPU s / step, all ranks | peak MiB per rank (above start) | "
    header += "loss, step 1 |"
    lines += [header, "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    cores = os.cpu_count()
    for seq_len in lengths:
        setups = {
            f"1 process, {cores} threads": run(seq_len, 1, args.steps, cores),
            "1 process, 1 thread": run(seq_len, 1, args.steps, 1),
            f"{args.ranks} ranks, {max(1, cores // args.ranks)} thread each": run(
                seq_len, args.ranks, args.steps, max(1, cores // args.ranks)
            ),
        }
        single, ring = list(setups.values())[0], list(setups.values())[-1]
        gap = max(abs(a - b) / a for a, b in zip(single["losses"], ring["losses"], strict=True))
        for name, report in setups.items():
            seconds = max(r["seconds"] for r in report["ranks"])
            cpu_seconds = sum(r["cpu_seconds"] for r in report["ranks"])
            memory = " / ".join(f"{r['peak_mib']:.0f}" for r in report["ranks"])
            row = f"| {seq_len:,} | {name} | {seconds:.2f} | {cpu_seconds:.2f} | {memory} | {report['losses'][0]:.6f} |"
            lines.append(row)
            print(row, flush=True)
        lines.append(f"|  | largest relative loss difference over {args.steps} steps | {gap:.1e} | | | |")
        print(lines[-1], flush=True)
    lines.append(load_report("after"))
    print(lines[-1])
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
