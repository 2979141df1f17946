"""The Transformer against the LSTM baseline, trained by `tformer train` on the same data, batches and budget.

    .venv/bin/python benchmarks/lstm_vs_transformer.py \
        --transformer runs/lstm-vs-transformer-seed1 runs/lstm-vs-transformer-seed2 \
        --lstm runs/lstm-en-de-seed1 runs/lstm-en-de-seed2

Prints, for docs/lstm-vs-transformer.md:
- per run: parameters, steps in the budget, the median training target tokens/s (metrics.jsonl), the final dev
  BLEU on all 618 Judges verses (the train log) and the test BLEU (`tformer eval --split test`, the test log in
  runs/lstm-logs/), then the mean and spread over seeds;
- decode latency per sentence at batch 1, greedy and beam 4, for dev sentences binned by source length; the two
  first runs' models decode each sentence one after the other (alternating, in one process), medians per bin;
- dev BLEU by source-length bin (all 618 verses, beam 4) and the time of a training step over 2,048 tokens as
  64 x 32 or 20 x 100 (the recurrence's sequential steps against attention's parallel ones);
- memory: the live-tensor peak (tformer.training.memory.LiveTensorTracker) and the RSS growth of one bf16-autocast
  training step at 2,048 tokens (64 x 32 and 20 x 100), and of a beam-4 decode of the longest sentence of a bin.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import time
from pathlib import Path

import sacrebleu
import torch
from common import cpu_flags, load_report, median, median_seconds, set_threads

from tformer.checkpoints import resolve_checkpoint
from tformer.data import Seq2SeqBatch, Tokenizer, bible_pairs
from tformer.decoding import translate_ids
from tformer.models import load
from tformer.training.evaluate import evaluate_translation
from tformer.training.losses import label_smoothed_cross_entropy
from tformer.training.memory import (
    LiveTensorTracker,
    measure_training_step,
    peak_rss_bytes,
    reset_peak_rss,
    synthetic_batch,
)

SHAPES = ((64, 32), (20, 100))  # (rows, tokens per row): 2,048 tokens, the recipe's batch budget
BINS = ((1, 16), (17, 32), (33, 48), (49, 64), (65, 100))  # source tokens (with </s>)
LOGS = Path("runs/lstm-logs")
MIB = 2**20


def run_summary(run: Path) -> dict:
    """Steps, median tokens/s, final dev BLEU, test BLEU and peak RSS of one run, from the files it left."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    train_log = (LOGS / f"{run.name}.train.log").read_text()
    dev = re.search(r"dev BLEU \(all (\d+) sentences.*?: ([\d.]+)", train_log)
    test = re.search(r"test BLEU ([\d.]+) on (\d+) sentences", (LOGS / f"{run.name}.test.log").read_text())
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", (LOGS / f"{run.name}.train.err").read_text())
    return {
        "run": run.name,
        "params": load(resolve_checkpoint(run)).num_parameters(),
        "steps": max(r["step"] for r in records),
        "tok_s": median(rates),
        "dev": float(dev.group(2)) if dev else float("nan"),
        "test": float(test.group(1)) if test else float("nan"),
        "rss_mib": int(rss.group(1)) / 1024 if rss else float("nan"),
    }


def print_runs(name: str, runs: list[Path]) -> None:
    rows = [run_summary(run) for run in runs if (LOGS / f"{run.name}.test.log").is_file()]
    print(f"\n{name}: run, parameters, steps, median target tok/s, dev BLEU (618), test BLEU (1,794), peak RSS MiB")
    for r in rows:
        print(
            f"  {r['run']:28s} {r['params']:>10,} {r['steps']:>6} {r['tok_s']:>8,.0f} {r['dev']:>6.2f} "
            f"{r['test']:>6.2f} {r['rss_mib']:>7.0f}"
        )
    for key in ("tok_s", "dev", "test"):
        values = [r[key] for r in rows]
        spread = max(values) - min(values)
        print(f"  {key}: mean {statistics.mean(values):.2f}, spread (max - min) {spread:.2f}, values {values}")


def binned_sources(tokenizer: Tokenizer, per_bin: int) -> dict[tuple[int, int], list[list[int]]]:
    """The first `per_bin` dev sources of each length bin, as token ids (without </s>; translate_ids adds it)."""
    sources = tokenizer.encode_batch([src for src, _ in bible_pairs("en-de", "dev")])
    bins: dict[tuple[int, int], list[list[int]]] = {b: [] for b in BINS}
    for ids in sources:
        for low, high in BINS:
            if low <= len(ids) + 1 <= high and len(bins[(low, high)]) < per_bin:
                bins[(low, high)].append(ids)
    return bins


def decode_latency(models: dict, tokenizer: Tokenizer, per_bin: int) -> None:
    """Median ms per sentence (batch 1) per length bin, each sentence decoded by both models in turn."""
    ids = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    bins = binned_sources(tokenizer, per_bin)
    warm = bins[BINS[1]][:2]
    for model in models.values():
        translate_ids(model, warm, *ids, beam_size=4, batch_size=1)
    print("\ndecode latency at batch 1 (median ms per sentence; ms per output token in brackets)")
    for beam in (1, 4):
        print(f"  {'greedy' if beam == 1 else 'beam 4'}: bin (source tokens), n, " + ", ".join(models) + ", ratio")
        for (low, high), sentences in bins.items():
            seconds = {name: [] for name in models}
            per_token = {name: [] for name in models}
            for sentence in sentences:
                for name, model in models.items():
                    start = time.perf_counter()
                    out = translate_ids(model, [sentence], *ids, beam_size=beam, batch_size=1)
                    elapsed = time.perf_counter() - start
                    seconds[name].append(elapsed)
                    per_token[name].append(elapsed / (len(out[0]) + 1))
            cells = [f"{1e3 * median(seconds[n]):7.1f} ({1e3 * median(per_token[n]):4.1f})" for n in models]
            a, b = (median(seconds[n]) for n in models)
            print(f"    {low:>3}-{high:<3} {len(sentences):>3}  " + "  ".join(cells) + f"  {a / b:5.2f}")


def bleu_by_length(models: dict, tokenizer: Tokenizer) -> None:
    """Corpus BLEU of all dev sentences (beam 4, batched as in evaluation) within each source-length bin."""
    pairs = bible_pairs("en-de", "dev")
    lengths = [len(ids) + 1 for ids in tokenizer.encode_batch([src for src, _ in pairs])]
    hypotheses = {}
    for name, model in models.items():
        result = evaluate_translation(model, tokenizer, pairs, beam_size=4)
        hypotheses[name] = result.hypotheses
        print(f"\n{name}: dev BLEU {result.bleu:.2f} on {len(pairs)} sentences, decoded in {result.seconds:.1f} s")
    print("dev BLEU by source length (beam 4): bin, sentences, " + ", ".join(models))
    for low, high in BINS:
        rows = [i for i, n in enumerate(lengths) if low <= n <= high]
        references = [[pairs[i][1] for i in rows]]
        scores = [sacrebleu.corpus_bleu([hypotheses[n][i] for i in rows], references).score for n in models]
        print(f"    {low:>3}-{high:<3} {len(rows):>4}  " + "  ".join(f"{score:6.2f}" for score in scores))


def decode_memory(models: dict, tokenizer: Tokenizer) -> None:
    ids = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    bins = binned_sources(tokenizer, 50)
    print("\nbeam-4 decode of the longest dev sentence of each bin: live-tensor peak MiB (weights included)")
    for low, high in BINS:
        sentence = max(bins[(low, high)], key=len)
        cells = []
        for name, model in models.items():
            with LiveTensorTracker() as tracker:
                tracker.track([*model.parameters()])
                translate_ids(model, [sentence], *ids, beam_size=4, batch_size=1)
            cells.append(f"{name} {tracker.peak / MIB:6.1f}")
        print(f"    {len(sentence) + 1:>3} tokens: " + "  ".join(cells))


def training_memory(models: dict) -> None:
    print("\none training step, bf16 autocast, paper Adam: live-tensor peak MiB / RSS growth MiB")
    for batch, length in SHAPES:
        cells = []
        for name, model in models.items():
            reset_peak_rss()
            step = measure_training_step(model.config, batch, length, dtype="bf16-autocast")
            cells.append(f"{name} {step.peak_bytes / MIB:6.1f} / {step.rss_growth / MIB:6.1f}")
        print(f"    {batch} x {length}: " + "  ".join(cells) + f"  (process VmHWM {peak_rss_bytes() / MIB:.0f})")


def step_time(models: dict, repeats: int = 5) -> None:
    """Median seconds of a bf16-autocast forward + backward over the same 2,048 tokens cut into short or long
    rows: a recurrence walks every position of a row in turn, attention takes them all at once."""
    print("\ntraining forward + backward, bf16 autocast, 2,048 tokens: median ms (target tok/s)")
    for batch, length in SHAPES:
        cells = []
        for name, model in models.items():
            training = copy.deepcopy(model).train()
            data = synthetic_batch(training.config, batch, length)

            def step(training: torch.nn.Module = training, data: Seq2SeqBatch = data) -> None:
                with torch.autocast("cpu", torch.bfloat16):
                    logits = training(data.src, data.tgt_in, data.src_mask, data.tgt_mask)
                label_smoothed_cross_entropy(logits, data.labels, 0.1)[0].backward()

            step()
            seconds = median_seconds(step, repeats)
            cells.append(f"{name} {1e3 * seconds:6.0f} ({batch * length / seconds:6,.0f})")
        print(f"    {batch} x {length}: " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformer", nargs="+", type=Path, required=True, help="run directories")
    parser.add_argument("--lstm", nargs="+", type=Path, required=True, help="run directories")
    parser.add_argument("--per-bin", type=int, default=10, help="sentences timed per length bin")
    parser.add_argument("--summary-only", action="store_true", help="only the runs' table (no decoding, no steps)")
    args = parser.parse_args()
    threads = set_threads()
    print(f"lstm_vs_transformer, {time.strftime('%Y-%m-%d %H:%M')} UTC; {threads} threads; {cpu_flags()}")
    print(load_report("before"))
    print_runs("Transformer", args.transformer)
    print_runs("LSTM", args.lstm)
    if args.summary_only:
        return
    checkpoints = {"transformer": args.transformer[0], "lstm": args.lstm[0]}
    models = {name: load(resolve_checkpoint(run)) for name, run in checkpoints.items()}
    tokenizer = Tokenizer.from_file(resolve_checkpoint(args.transformer[0]))
    lstm_tokenizer = Tokenizer.from_file(resolve_checkpoint(args.lstm[0]))
    dev = [src for src, _ in bible_pairs("en-de", "dev")]
    same = tokenizer.encode_batch(dev) == lstm_tokenizer.encode_batch(dev)
    print(f"\nthe two runs' tokenizers encode the dev set alike: {same}")
    with torch.inference_mode():
        decode_latency(models, tokenizer, args.per_bin)
        bleu_by_length(models, tokenizer)
        decode_memory(models, tokenizer)
    step_time(models)
    training_memory(models)
    print(load_report("after"))


if __name__ == "__main__":
    main()
