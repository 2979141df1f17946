"""Held-out scores of the prefix-LM and denoising recipes against trivial baselines, with a few samples.

    .venv/bin/python benchmarks/objective_eval.py prefix_lm runs/llama-small-prefixlm
    .venv/bin/python benchmarks/objective_eval.py denoising runs/bart-small-denoising
    .venv/bin/python benchmarks/objective_eval.py curves runs/llama-small-prefixlm runs/bart-small-denoising \
        --output docs/pretraining-objectives.png      # training loss against step and training seconds

The dev book (Judges), its verses of at most 128 tokens, corrupted or split with a fixed seed so that every
checkpoint sees the same inputs:
- prefix_lm: nats per suffix token (the tokens the objective scores, </s> included) with the prefix bidirectional,
  as trained; baselines: uniform over the vocabulary, and the training books' unigram distribution (add-one).
- denoising: nats and accuracy per target token of the reconstruction, split into the tokens the infilling hid and
  those the encoder could copy (told apart by aligning the noisy source with the target, difflib); baselines on the
  hidden tokens: uniform, the training books' unigram distribution and its most frequent token.
Samples: greedy continuations of dev prefixes (prefix LM) and greedy reconstructions of corrupted dev verses.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tformer.checkpoints import load_pretrained, resolve_checkpoint
from tformer.data import Tokenizer, bible_text
from tformer.data.objectives import IGNORE_INDEX, Vocab, denoising, prefix_lm
from tformer.decoding.search import greedy_search

BATCH = 64


def unigram(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """The training books' token distribution, </s> counted once a verse, add-one smoothed."""
    counts = torch.ones(vocab_size)
    for ids in tokenizer.encode_batch(bible_text("train"), add_bos=False):
        counts += torch.bincount(torch.tensor([*ids, tokenizer.eos_id]), minlength=vocab_size).float()
    return counts / counts.sum()


def eval_prefix_lm(model, tokenizer, lines, generator) -> dict:
    vocab = Vocab.of(tokenizer)
    probs = unigram(tokenizer, vocab.size)
    loss = unigram_loss = 0.0
    count = 0
    with torch.no_grad():
        for i in range(0, len(lines), BATCH):
            batch = prefix_lm(lines[i : i + BATCH], vocab, generator)
            logits = model(batch.input_ids, batch.attention_mask, prefix_lengths=batch.prefix_len).float()
            scored = batch.labels != IGNORE_INDEX
            loss += F.cross_entropy(logits[scored], batch.labels[scored], reduction="sum").item()
            unigram_loss += -probs[batch.labels[scored]].log().sum().item()
            count += int(scored.sum())
    samples = []
    for ids in lines[:4]:
        k = len(ids) // 2
        out = list(ids[:k])
        with torch.no_grad():
            for _ in range(len(ids) - k + 4):
                x = torch.tensor([[vocab.bos_id, *out]])
                nxt = int(model(x, prefix_lengths=torch.tensor([1 + k]))[0, -1].argmax())
                if nxt == vocab.eos_id:
                    break
                out.append(nxt)
        samples.append(
            {
                "prefix": tokenizer.decode(ids[:k]),
                "model": tokenizer.decode(out[k:]),
                "reference": tokenizer.decode(ids[k:]),
            }
        )
    return {
        "suffix_tokens": count,
        "loss": loss / count,
        "perplexity": math.exp(loss / count),
        "uniform_loss": math.log(vocab.size),
        "unigram_loss": unigram_loss / count,
        "unigram_perplexity": math.exp(unigram_loss / count),
        "samples": samples,
    }


def hidden_positions(src: list[int], tgt: list[int], mask_id: int) -> list[bool]:
    """For each target token, whether the noisy source lacks it (it was inside a masked span): the target tokens
    outside the longest matching blocks of source (masks dropped) and target."""
    visible = [t for t in src if t != mask_id]
    hidden = [True] * len(tgt)
    for block in difflib.SequenceMatcher(a=visible, b=tgt, autojunk=False).get_matching_blocks():
        for j in range(block.b, block.b + block.size):
            hidden[j] = False
    return hidden


def eval_denoising(model, tokenizer, lines, generator) -> dict:
    vocab = Vocab.of(tokenizer)
    probs = unigram(tokenizer, vocab.size)
    top = int(probs.argmax())
    sums = {name: [0.0, 0, 0] for name in ("all", "hidden", "copied")}  # loss, correct, count
    base = [0.0, 0]  # unigram loss and most-frequent-token hits on the hidden tokens
    corrupted = []
    with torch.no_grad():
        for i in range(0, len(lines), BATCH):
            chunk = lines[i : i + BATCH]
            batch = denoising(chunk, vocab, generator)
            logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask).float()
            labels = batch.labels
            real = labels != IGNORE_INDEX
            hidden = torch.zeros_like(real)
            for row, ids in enumerate(chunk):
                src = batch.src[row][batch.src_mask[row].bool()].tolist()
                corrupted.append(src)
                flags = hidden_positions(src, ids, vocab.mask_id)
                hidden[row, : len(ids)] = torch.tensor(flags, dtype=torch.bool)  # labels: ids then </s>
            correct = logits.argmax(-1) == labels
            for name, where in (("all", real), ("hidden", hidden), ("copied", real & ~hidden)):
                sums[name][0] += F.cross_entropy(logits[where], labels[where], reduction="sum").item()
                sums[name][1] += int(correct[where].sum())
                sums[name][2] += int(where.sum())
            base[0] += -probs[labels[hidden]].log().sum().item()
            base[1] += int((labels[hidden] == top).sum())
    n_hidden = sums["hidden"][2]
    result = {name: {"tokens": n, "loss": loss / n, "accuracy": hits / n} for name, (loss, hits, n) in sums.items()}
    result["baselines_on_hidden"] = {
        "uniform_loss": math.log(vocab.size),
        "unigram_loss": base[0] / n_hidden,
        "most_frequent_token_accuracy": base[1] / n_hidden,
    }
    samples = []
    for ids, src in list(zip(lines, corrupted, strict=True))[:4]:
        src_t = torch.tensor([src])
        out = greedy_search(model, src_t, torch.ones_like(src_t), len(ids) + 8, vocab.bos_id, vocab.eos_id)[0]
        noisy = tokenizer.decode(src[:-1], skip_special_tokens=False)
        samples.append({"input": noisy, "model": tokenizer.decode(out), "reference": tokenizer.decode(ids)})
    result["samples"] = samples
    return result


def curves(runs: list[str], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in runs:
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r and "step" in r]
        for ax, x in zip(axes, ("step", "elapsed"), strict=True):
            ax.plot([r[x] for r in rows], [r["loss"] for r in rows], marker=".", label=Path(run).name)
    axes[0].set(xlabel="step", ylabel="training loss (nats per target token)")
    axes[1].set(xlabel="training seconds", ylabel="training loss")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("objective", choices=["prefix_lm", "denoising", "curves"])
    parser.add_argument("run", nargs="+", help="a run directory or checkpoint (curves: several runs)")
    parser.add_argument("--output", type=Path, default=None, help="also write the scores as JSON here (curves: PNG)")
    args = parser.parse_args()
    if args.objective == "curves":
        curves(args.run, args.output)
        return
    args.run = args.run[0]
    checkpoint = resolve_checkpoint(args.run)
    model, tokenizer = load_pretrained(checkpoint)
    model.eval()
    lines = [ids for ids in tokenizer.encode_batch(bible_text("dev"), add_bos=False) if 1 < len(ids) <= 128]
    generator = torch.Generator().manual_seed(0)
    evaluate = eval_prefix_lm if args.objective == "prefix_lm" else eval_denoising
    result = {"checkpoint": str(checkpoint), "dev_verses": len(lines), **evaluate(model, tokenizer, lines, generator)}
    text = json.dumps(result, indent=1, ensure_ascii=False)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
