"""The prefix cache's bookkeeping cost per sequence per decode step, at several sequence lengths.

After every step the scheduler publishes a sequence's newly full blocks to the prefix cache
(`Scheduler.update_from_output`; `Scheduler.computed` before 2026-12-01). This times that call alone, on the
CPU, for one sequence that decodes `--steps` tokens after a prompt of each length (blocks of `--block-size`);
the first call, which hashes the whole prompt, is not counted. No model runs: the cost is pure bookkeeping.

    python benchmarks/prefix_cache_cost.py --lengths 512 2048 8192
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tformer.engine.blocks import BlockAllocator
from tformer.engine.sampling import SamplingParams
from tformer.engine.scheduler import Scheduler, SequenceState


def cost_per_step(length: int, steps: int, block_size: int) -> float:
    """Mean seconds of `Scheduler.computed` per decode step of one sequence of `length` prompt tokens."""
    rng = random.Random(length)
    allocator = BlockAllocator(num_blocks=(length + steps) // block_size + 2, block_size=block_size)
    scheduler = Scheduler(allocator, prefix_caching=True)
    seq = SequenceState("bench", [rng.randrange(49152) for _ in range(length)], SamplingParams(max_tokens=steps))
    allocator.grow(seq.table, length + steps)
    scheduler.record_computed(seq, length)  # the prompt's blocks: hashed once, not counted
    times = []
    for _ in range(steps):
        seq.output.append(rng.randrange(49152))
        start = time.perf_counter()
        scheduler.record_computed(seq, 1)
        times.append(time.perf_counter() - start)
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    print("| tokens | ms per sequence per step |")
    print("|---:|---:|")
    for length in args.lengths:
        print(f"| {length:,} | {cost_per_step(length, args.steps, args.block_size) * 1e3:.4f} |")


if __name__ == "__main__":
    main()
