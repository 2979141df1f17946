"""Where tformer's beam search spends its time: torch.profiler over a translation of dev verses on the main job's model.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/translation_profile.py --model runs/en-de-10min --sentences 100

Prints wall and CPU seconds of one untimed-warm pass at each thread count asked (--threads 2,1), then the profiler's
table of operators by self CPU time for one pass, with the machine's flags and load beside them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_report, machine_info  # noqa: E402

from tformer.data.corpora import bible_pairs  # noqa: E402
from tformer.decoding.translator import Translator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/en-de-10min")
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--threads", default="2", help="comma-separated thread counts to time (default 2)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default float32)")
    parser.add_argument("--quantize", default=None, help="a quantization mode (int8, w8a8)")
    parser.add_argument("--rows", type=int, default=30, help="operators in the table (default 30)")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    translator = Translator.load(args.model, dtype=args.dtype, quantize=args.quantize)
    sentences = [pair[0] for pair in bible_pairs("en-de", "dev")[: args.sentences]]
    print(f"machine: {machine_info()}")
    print(load_report("before"))
    translator.translate_batch(sentences[:8])
    for threads in [int(n) for n in args.threads.split(",")]:
        torch.set_num_threads(threads)
        wall, cpu = time.perf_counter(), time.process_time()
        translator.translate_batch(sentences)
        print(
            f"{args.sentences} sentences, {threads} threads: {time.perf_counter() - wall:.2f} s wall, "
            f"{time.process_time() - cpu:.2f} CPU s",
            flush=True,
        )
    if not args.no_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            translator.translate_batch(sentences)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=40))
    print(load_report("after"))


if __name__ == "__main__":
    main()
