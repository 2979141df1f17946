"""The Transformer against the ConvS2S baseline, trained by `tformer train` on the same data, batches and budget.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/cnn_vs_transformer.py --part runs \\
        --transformer runs/cnn-vs-transformer-seed1 runs/cnn-vs-transformer-seed2 \\
        --cnn runs/convs2s-en-de-seed1 runs/convs2s-en-de-seed2
    (then --part decode, --part steps: each part is one short invocation under the exclusive CPU lock)

Parts, for docs/cnn-vs-transformer.md (the first run of each model is the one measured in decode and steps):
- runs: per run, parameters, steps in the budget, the median training target tokens/s (metrics.jsonl), the final
  dev BLEU on all 618 Judges verses (the train log) and the peak RSS of `tformer train`; the mean and spread;
- decode: the whole dev set decoded as evaluation decodes it (beam 4, batches of 32): BLEU, seconds and output
  tokens/s, and BLEU by source-length bin (long-range dependency); greedy batch-1 latency per bin (the two
  models alternating sentence by sentence);
- steps: the receptive field, measured: which source tokens an encoder output depends on and which earlier
  target tokens a decoder output depends on (non-zero gradients of one output with respect to the token
  embeddings), against the formula 1 + L (k - 1); and the time of a training step over 2,048 tokens cut as 64 x 32
  or 20 x 100 (parallelism: neither model walks the positions in turn).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import sacrebleu
import torch
from common import cpu_flags, load_report, median, set_threads
from lstm_vs_transformer import BINS, binned_sources, step_time

from tformer.checkpoints import resolve_checkpoint
from tformer.data import Tokenizer, bible_pairs
from tformer.decoding import translate_ids
from tformer.models import load
from tformer.training.evaluate import evaluate_translation

LOGS = Path("runs/cnn-logs")


def run_summary(run: Path) -> dict:
    """Steps, median tokens/s, final dev BLEU and peak RSS of one run, from the files it left."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    train_log = (LOGS / f"{run.name}.train.log").read_text()
    dev = re.search(r"dev BLEU \(all (\d+) sentences.*?: ([\d.]+)", train_log)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", (LOGS / f"{run.name}.train.err").read_text())
    return {
        "run": run.name,
        "params": load(resolve_checkpoint(run)).num_parameters(),
        "steps": max(r["step"] for r in records),
        "tok_s": median(rates),
        "tok_s_range": (min(rates), max(rates)),
        "final_loss": losses[-1],
        "dev": float(dev.group(2)) if dev else float("nan"),
        "rss_mib": int(rss.group(1)) / 1024 if rss else float("nan"),
    }


def print_runs(name: str, runs: list[Path]) -> None:
    rows = [run_summary(run) for run in runs]
    print(f"\n{name}: run, parameters, steps, median target tok/s (min-max), last loss, dev BLEU (618), peak RSS MiB")
    for r in rows:
        low, high = r["tok_s_range"]
        print(
            f"  {r['run']:28s} {r['params']:>10,} {r['steps']:>6} {r['tok_s']:>8,.0f} ({low:,.0f}-{high:,.0f}) "
            f"{r['final_loss']:6.3f} {r['dev']:>6.2f} {r['rss_mib']:>7.0f}"
        )
    for key in ("tok_s", "dev", "steps"):
        values = [r[key] for r in rows]
        spread = max(values) - min(values)
        print(f"  {key}: mean {statistics.mean(values):.2f}, spread (max - min) {spread:.2f}, values {values}")


def decode_and_bleu_by_length(models: dict, tokenizer: Tokenizer) -> None:
    """The dev set decoded as in evaluation (beam 4, batches of 32): BLEU, time and output tokens/s, then corpus
    BLEU within each source-length bin."""
    pairs = bible_pairs("en-de", "dev")
    lengths = [len(ids) + 1 for ids in tokenizer.encode_batch([src for src, _ in pairs])]
    hypotheses = {}
    print("\ndev set, beam 4, batches of 32 (as evaluation decodes): BLEU, seconds, output tokens, output tok/s")
    for name, model in models.items():
        result = evaluate_translation(model, tokenizer, pairs, beam_size=4)
        hypotheses[name] = result.hypotheses
        n_out = sum(len(ids) + 1 for ids in tokenizer.encode_batch(result.hypotheses))  # with </s>
        print(f"  {name:12s} {result.bleu:6.2f} {result.seconds:7.1f} {n_out:>7,} {n_out / result.seconds:8,.0f}")
    print("dev BLEU by source length (beam 4): bin, sentences, " + ", ".join(models))
    for low, high in BINS:
        rows = [i for i, n in enumerate(lengths) if low <= n <= high]
        references = [[pairs[i][1] for i in rows]]
        scores = [sacrebleu.corpus_bleu([hypotheses[n][i] for i in rows], references).score for n in models]
        print(f"    {low:>3}-{high:<3} {len(rows):>4}  " + "  ".join(f"{score:6.2f}" for score in scores))


def greedy_latency(models: dict, tokenizer: Tokenizer, per_bin: int) -> None:
    """Median ms per sentence and output tok/s of greedy decoding at batch 1, per source-length bin, the models
    alternating sentence by sentence."""
    ids = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    bins = binned_sources(tokenizer, per_bin)
    for model in models.values():
        translate_ids(model, bins[BINS[1]][:2], *ids, beam_size=1, batch_size=1)  # warm-up
    print("\ngreedy, batch 1: bin (source tokens), n, per model median ms per sentence (output tok/s over the bin)")
    for (low, high), sentences in bins.items():
        seconds = {name: [] for name in models}
        produced = dict.fromkeys(models, 0)
        for sentence in sentences:
            for name, model in models.items():
                start = time.perf_counter()
                out = translate_ids(model, [sentence], *ids, beam_size=1, batch_size=1)
                seconds[name].append(time.perf_counter() - start)
                produced[name] += len(out[0]) + 1
        cells = [f"{1e3 * median(seconds[n]):7.1f} ({produced[n] / sum(seconds[n]):6,.0f})" for n in models]
        print(f"    {low:>3}-{high:<3} {len(sentences):>3}  " + "  ".join(cells))


def dependency_span(model: torch.nn.Module, side: str, length: int, position: int) -> list[int]:
    """Positions whose token embedding the output at `position` depends on (a non-zero gradient): of the source
    for an encoder output, of the target for a decoder output (with the encoder's output held fixed)."""
    model, vocab = model.float().eval(), model.config.vocab_size
    tokens = torch.randint(4, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    table = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.num_embeddings == vocab)
    embeddings = {}

    def keep(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        output.retain_grad()
        embeddings.setdefault(side, output)
        return output

    if side == "source":
        handle = table.register_forward_hook(keep)
        out = model.encode(tokens, mask)
        handle.remove()
    else:
        with torch.no_grad():
            memory = model.encode(tokens, mask)
        handle = table.register_forward_hook(keep)
        out = model.decode(tokens, memory, mask)
        handle.remove()
    out[0, position].square().sum().backward()
    grad = embeddings[side].grad[0].abs().sum(-1)  # (length,)
    return [i for i, g in enumerate(grad.tolist()) if g > 0]


def receptive_fields(models: dict) -> None:
    print("\nreceptive field, measured: the positions one output depends on (non-zero gradient), 100 tokens")
    for name, model in models.items():
        config = model.config
        for side, position in (("source", 50), ("target", 99)):
            span = dependency_span(model, side, 100, position)
            layers = config.n_encoder_layers if side == "source" else config.n_decoder_layers
            kernel = config.conv_kernel
            formula = f"1 + {layers} x ({kernel} - 1) = {1 + layers * (kernel - 1)}" if kernel else "every position"
            print(
                f"  {name:12s} {side} output {position}: {len(span)} positions, {span[0]}..{span[-1]} "
                f"(formula: {formula})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformer", nargs="+", type=Path, required=True, help="run directories")
    parser.add_argument("--cnn", nargs="+", type=Path, required=True, help="run directories")
    parser.add_argument("--part", choices=("runs", "decode", "steps"), required=True)
    parser.add_argument("--per-bin", type=int, default=10, help="sentences timed per length bin")
    args = parser.parse_args()
    threads = set_threads()
    print(f"cnn_vs_transformer --part {args.part}, {time.strftime('%Y-%m-%d %H:%M')} UTC; {threads} threads")
    print(cpu_flags())
    print(load_report("before"))
    if args.part == "runs":
        print_runs("Transformer", args.transformer)
        print_runs("ConvS2S", args.cnn)
        return
    checkpoints = {"transformer": args.transformer[0], "convs2s": args.cnn[0]}
    models = {name: load(resolve_checkpoint(run)) for name, run in checkpoints.items()}
    tokenizer = Tokenizer.from_file(resolve_checkpoint(args.transformer[0]))
    dev = [src for src, _ in bible_pairs("en-de", "dev")]
    same = tokenizer.encode_batch(dev) == Tokenizer.from_file(resolve_checkpoint(args.cnn[0])).encode_batch(dev)
    print(f"the two runs' tokenizers encode the dev set alike: {same}")
    if args.part == "decode":
        with torch.inference_mode():
            decode_and_bleu_by_length(models, tokenizer)
            greedy_latency(models, tokenizer, args.per_bin)
    else:
        receptive_fields(models)
        step_time(models)
    print(load_report("after"))


if __name__ == "__main__":
    main()
