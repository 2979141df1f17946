"""Today's beam search against the reordering-free one, alternated in one process on the main job's model.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/beam_ab.py --model runs/en-de-10min [--sentences 618] [--rounds 3]

"old" is the search as it was (tests/reference_search.py: memory repeated per beam, every cache row copied every
step, the memory mask rebuilt every step, and the fused attention kernel for one fp32 query); "new" is
`translate_ids` (decoding/search.py), the path of `tformer eval` and `Translator.translate_batch`; "new, patience 1"
stops a sentence at beam_size finished hypotheses, as CTranslate2 does by default. Each round runs every mode once
over the same dev verses (batches of 32 sorted by length, beam 4, alpha 0.6), the order reversed every other round;
printed are median wall seconds, target tokens per second (generated tokens, </s> not counted), CPU seconds, BLEU
and how many outputs equal the old search's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import alternating_timing, machine_info, median, uptime  # noqa: E402
from reference_search import legacy_attention, reference_translate_ids  # noqa: E402

from tformer.data.corpora import bible_pairs  # noqa: E402
from tformer.decoding.search import translate_ids  # noqa: E402
from tformer.decoding.translator import Translator  # noqa: E402


def timed(name: str, fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, printing its wall time as it ends (a long run shows its progress)."""

    def run() -> None:
        start = time.perf_counter()
        fn()
        print(f"  {name}: {time.perf_counter() - start:.2f} s", flush=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/en-de-10min")
    parser.add_argument("--sentences", type=int, default=618, help="the first N dev verses (618: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    translator = Translator.load(args.model)
    model, tokenizer = translator.model, translator.tokenizer
    pairs = bible_pairs("en-de", "dev")[: args.sentences]
    sources = tokenizer.encode_batch([source for source, _ in pairs])
    references = [reference for _, reference in pairs]
    special = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    outputs: dict[str, list[list[int]]] = {}

    def old() -> None:
        with legacy_attention(model):
            outputs["old"] = reference_translate_ids(model, sources, *special, args.beam, 0.6, args.batch_size)

    def new() -> None:
        outputs["new"] = translate_ids(model, sources, *special, args.beam, 0.6, args.batch_size)

    def new_patience() -> None:
        outputs["new, patience 1"] = translate_ids(model, sources, *special, args.beam, 0.6, args.batch_size, 50, 1.0)

    print(machine_info())
    print(f"before: {uptime()}")
    steps = {name: timed(name, fn) for name, fn in {"old": old, "new": new, "new, patience 1": new_patience}.items()}
    times = alternating_timing(steps, rounds=args.rounds, warmup=0)
    print(f"after:  {uptime()}")
    print(f"{len(sources)} dev verses, beam {args.beam}, alpha 0.6, batches of {args.batch_size}, {args.rounds} rounds")
    print(f"{'search':<18} {'wall s':>8} {'tok/s':>8} {'CPU s':>7} {'BLEU':>6} {'same as old':>12} {'speed-up':>9}")
    base = median(times["old"])
    for name in steps:
        ids = outputs[name]
        n_tokens = sum(len(row) for row in ids)
        wall, cpu = median(times[name]), median(times.cpu[name])
        bleu = sacrebleu.metrics.BLEU().corpus_score(tokenizer.decode_batch(ids), [references]).score
        same = sum(a == b for a, b in zip(ids, outputs["old"], strict=True))
        print(
            f"{name:<18} {wall:>8.2f} {n_tokens / wall:>8.0f} {cpu:>7.2f} {bleu:>6.2f} {same:>6}/{len(ids):<5} "
            f"{base / wall:>8.2f}x"
        )
        print(f"  rounds: {', '.join(f'{t:.2f}' for t in times[name])}")


if __name__ == "__main__":
    main()
