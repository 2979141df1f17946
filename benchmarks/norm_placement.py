"""The norm-placement experiment (seed 001 §2.4): post, pre, sandwich and DeepNorm at depth 6, 12 and 24.

    .venv/bin/python benchmarks/norm_placement.py prepare          # tokenizer + packed lines (seconds)
    .venv/bin/python benchmarks/norm_placement.py run --depth 6    # 16 runs: 4 placements x warmup or not x 2 seeds
    .venv/bin/python benchmarks/norm_placement.py run --depth 12
    .venv/bin/python benchmarks/norm_placement.py run --depth 24
    .venv/bin/python benchmarks/norm_placement.py report           # the table and the plot (docs/norm-placement.md)

Every run trains the same small decoder LM (d_model 64, 4 heads, d_ff 256, LayerNorm, GELU, RoPE, tied
embeddings, no dropout) on the World English Bible's training books packed into lines of 64 positions, for
the same token budget (STEPS steps of BATCH lines), with AdamW (betas 0.9/0.98, no weight decay, no gradient
clipping, fp32) at one peak learning rate. "warmup" rises linearly over the first WARMUP steps; "none" starts
at the peak. Both then decay by cosine to a tenth of the peak. The order of the lines depends on the seed, and so
does the initialization; a pair of runs differing only in placement sees the same batches.

Each run records, every LOG_EVERY steps, the training loss, the gradient norm of the first and of the last block,
and at step 0 the gradient norm of every block (Xiong et al. 2020's picture of post-LN's gradients at init).
A run *diverges* at the first step whose loss is not finite or is more than DIVERGE_MARGIN nats above the lowest
loss seen so far and stays there until the end. The dev loss is the mean token loss on DEV_LINES lines of Judges.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import load_report, machine_info, set_threads

from tformer import ModelConfig, build_model
from tformer.data import Tokenizer, bible_text
from tformer.training.extrapolation import pack_lines
from tformer.training.optim import adamw_cosine

PLACEMENTS = ("post", "pre", "sandwich", "deepnorm")
DEPTHS = (6, 12, 24)
WARMUPS = {"warmup": 60, "none": 0}
SEEDS = (1, 2)
LENGTH = 64  # positions per line: bos + 63 tokens
BATCH = 16  # lines per step
STEPS = 300  # 300 x 16 x 64 = 307k positions per run
PEAK_LR = 5e-3
VOCAB = 2048
LOG_EVERY = 10
DEV_LINES = 128
DIVERGE_MARGIN = 1.0
STUCK_MARGIN = 0.05  # a run whose dev loss is within this of the unigram model's learned no context


def prepare(runs: Path) -> None:
    data = runs / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, dev = bible_text("train"), bible_text("dev")
    tokenizer = Tokenizer.train(train, VOCAB)
    tokenizer.save(data)
    for split, verses in (("train", train), ("dev", dev)):
        lines = pack_lines(tokenizer, verses, LENGTH - 1)
        ids = tokenizer.encode_batch(lines, add_bos=True)
        torch.save([torch.tensor(x) for x in ids], data / f"{split}.pt")
        print(f"{split}: {len(ids)} lines, {sum(map(len, ids))} positions")


def load_lines(runs: Path, split: str) -> list[torch.Tensor]:
    return torch.load(runs / "data" / f"{split}.pt", weights_only=True)


def model_config(placement: str, depth: int) -> ModelConfig:
    return ModelConfig(
        family="decoder", n_encoder_layers=0, n_decoder_layers=depth, d_model=64, n_heads=4, d_ff=256,
        max_seq_len=LENGTH, vocab_size=VOCAB, position="rope", norm="layernorm", ffn="gelu",
        norm_placement=placement, scale_embeddings=False, tie_embeddings=True, dropout=0.0, attn_dropout=0.0,
        attention_backend="sdpa",
    )  # fmt: skip


def batch_of(lines: list[torch.Tensor], order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs and labels (-100 on padding) for the lines `order` names."""
    seqs = [lines[i] for i in order]
    width = max(len(s) for s in seqs)
    inputs = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for row, s in enumerate(seqs):
        inputs[row, : len(s)] = s
        labels[row, : len(s) - 1] = s[1:]
    return inputs, labels


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    mask = (labels != -100) | (torch.arange(labels.shape[1]) == 0)  # real tokens (the last one has no label)
    logits = model(inputs, attention_mask=mask.long())
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def block_grad_norms(model: torch.nn.Module) -> list[float]:
    norms = []
    for block in model.decoder.layers:
        grads = [p.grad.norm() ** 2 for p in block.parameters() if p.grad is not None]
        norms.append(float(torch.stack(grads).sum().sqrt()) if grads else 0.0)
    return norms


def divergence_step(losses: list[float]) -> int | None:
    """The first step with a non-finite loss, or from which every loss stays DIVERGE_MARGIN above the lowest
    loss seen up to that step; None when the run never diverges."""
    lowest = math.inf
    for step, value in enumerate(losses):
        if not math.isfinite(value):
            return step
        lowest = min(lowest, value)
        if all(later > lowest + DIVERGE_MARGIN for later in losses[step + 1 :]) and step < len(losses) - 1:
            return step + 1
    return None


def spikes(losses: list[float]) -> int:
    """How many steps' losses rose more than DIVERGE_MARGIN above the lowest loss before them."""
    lowest, count = math.inf, 0
    for value in losses:
        count += value > lowest + DIVERGE_MARGIN
        lowest = min(lowest, value)
    return count


def train_one(runs: Path, placement: str, depth: int, warmup_name: str, seed: int, lr: float = PEAK_LR) -> dict:
    train, dev = load_lines(runs, "train"), load_lines(runs, "dev")
    torch.manual_seed(seed)
    model = build_model(model_config(placement, depth))
    optimizer, scheduler = adamw_cosine(model, lr, WARMUPS[warmup_name], STEPS, weight_decay=0.0, betas=(0.9, 0.98))
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    log: list[dict] = []
    losses: list[float] = []
    began = time.perf_counter()
    for step in range(STEPS):
        rows = [order[(step * BATCH + i) % len(order)] for i in range(BATCH)]
        loss = lm_loss(model, *batch_of(train, rows))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        norms = block_grad_norms(model)
        if step % LOG_EVERY == 0 or step == STEPS - 1 or not math.isfinite(losses[-1]):
            entry = {"step": step, "loss": losses[-1], "grad_first": norms[0], "grad_last": norms[-1]}
            log.append(entry | ({"grad_blocks": norms} if step == 0 else {}))
        if not math.isfinite(losses[-1]):
            break
        optimizer.step()
        scheduler.step()
    seconds = time.perf_counter() - began
    with torch.no_grad():
        dev_rows = list(range(min(DEV_LINES, len(dev))))
        dev_loss = float(lm_loss(model.eval(), *batch_of(dev, dev_rows)))
    final = losses[-LOG_EVERY:]
    return {
        "placement": placement, "depth": depth, "warmup": warmup_name, "seed": seed, "lr": lr,
        "final_loss": sum(final) / len(final), "dev_loss": dev_loss,
        "diverged_at": divergence_step(losses), "spikes": spikes(losses),
        "seconds": seconds, "load": os.getloadavg(), "log": log,
        "parameters": sum(p.numel() for p in model.parameters()),
    }  # fmt: skip


def run(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    out = args.runs / ("results" if args.lr == PEAK_LR else f"results-lr{args.lr:g}")
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for warmup_name in args.warmups:
            for placement in args.placements:
                path = out / f"{placement}-{args.depth}-{warmup_name}-{seed}.json"
                if path.exists():
                    continue
                result = train_one(args.runs, placement, args.depth, warmup_name, seed, args.lr)
                path.write_text(json.dumps(result))
                print(
                    f"{placement:9s} depth {args.depth:2d} {warmup_name:6s} seed {seed}: "
                    f"final {result['final_loss']:.3f} "
                    f"dev {result['dev_loss']:.3f} diverged at {result['diverged_at']} ({result['seconds']:.0f} s)",
                    flush=True,
                )


def unigram_dev_loss(runs: Path) -> float:
    """The dev loss of the best context-free model: next-token frequencies of the training lines."""
    labels = lambda split: torch.cat([line[1:] for line in load_lines(runs, split)])  # noqa: E731
    counts = torch.bincount(labels("train"), minlength=VOCAB).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[labels("dev")].mean())


def _status(result: dict, unigram: float) -> str:
    if result["diverged_at"] is not None:
        return f"diverged at step {result['diverged_at']}"
    if result["dev_loss"] > unigram - STUCK_MARGIN:
        return "stuck at the unigram level"
    return "trained"


def _cell(results: list[dict], unigram: float) -> str:
    """Mean final training loss +- half the seeds' spread, the dev loss, and what happened to each seed."""
    if not results:
        return "not run"
    finals = [r["final_loss"] for r in results]
    devs = [r["dev_loss"] for r in results]
    statuses = sorted({_status(r, unigram) for r in results})
    spike_count = sum(r["spikes"] for r in results)
    text = f"{sum(finals) / len(finals):.2f} ± {(max(finals) - min(finals)) / 2:.2f} (dev {sum(devs) / len(devs):.2f})"
    return f"{text}, {' / '.join(statuses)}" + (f", {spike_count} spike steps" if spike_count else "")


def report(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(p.read_text()) for p in sorted((args.runs / "results").glob("*.json"))]
    by_key: dict[tuple, list[dict]] = {}
    for r in results:
        by_key.setdefault((r["placement"], r["depth"], r["warmup"]), []).append(r)
    unigram = unigram_dev_loss(args.runs)
    written = load_report("when this table was written")
    lines = [f"# norm placement, {len(results)} runs; {machine_info()}; {written}", ""]
    lines.append(f"unigram dev loss (training-set token frequencies): {unigram:.3f}")
    lines.append("")
    lines.append("| placement | depth | " + " | ".join(f"{w}: final train loss (dev)" for w in WARMUPS) + " |")
    lines.append("|---|---|" + "---|" * len(WARMUPS))
    for depth in DEPTHS:
        for placement in PLACEMENTS:
            cells = [_cell(by_key.get((placement, depth, w), []), unigram) for w in WARMUPS]
            lines.append(f"| {placement} | {depth} | " + " | ".join(cells) + " |")
    lines += ["", "| placement | depth | grad norm of the first / last block at step 0 | first block's at steps"
              " 100, 200, 299 (warmup, seed 1) | seconds per run |"]  # fmt: skip
    lines.append("|---|---|---|---|---|")
    for depth in DEPTHS:
        for placement in PLACEMENTS:
            runs = by_key.get((placement, depth, "warmup"), [])
            if runs:
                blocks = runs[0]["log"][0]["grad_blocks"]
                seconds = sum(r["seconds"] for r in runs) / len(runs)
                later = {e["step"]: e["grad_first"] for e in runs[0]["log"]}
                over = ", ".join(f"{later[s]:.2g}" if s in later else "-" for s in (100, 200, STEPS - 1))
                lines.append(f"| {placement} | {depth} | {blocks[0]:.3f} / {blocks[-1]:.3f} | {over} | {seconds:.0f} |")
    for control in sorted(args.runs.glob("results-lr*")):
        runs = [json.loads(p.read_text()) for p in sorted(control.glob("*.json"))]
        lines += ["", f"control at peak lr {runs[0]['lr']:g}:", "", "| placement | depth | warmup | seed | final"
                  " train loss | dev loss | outcome |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in sorted(runs, key=lambda r: (r["depth"], PLACEMENTS.index(r["placement"]), r["warmup"], r["seed"])):
            lines.append(
                f"| {r['placement']} | {r['depth']} | {r['warmup']} | {r['seed']} | {r['final_loss']:.2f} | "
                f"{r['dev_loss']:.2f} | {_status(r, unigram)} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    args.output.write_text(text)
    figure, axes = plt.subplots(2, len(DEPTHS), figsize=(5 * len(DEPTHS), 8), squeeze=False)
    for column, depth in enumerate(DEPTHS):
        for placement in PLACEMENTS:
            for w, style in zip(WARMUPS, ("-", "--"), strict=True):
                for r in by_key.get((placement, depth, w), [])[:1]:
                    steps = [e["step"] for e in r["log"]]
                    axes[0][column].plot(steps, [e["loss"] for e in r["log"]], style, label=f"{placement}, {w}")
                    axes[1][column].semilogy(
                        steps, [e["grad_first"] for e in r["log"]], style, label=f"{placement}, {w}"
                    )
        axes[0][column].set(title=f"depth {depth}: training loss (seed 1)", xlabel="step", ylim=(2, 9))
        axes[1][column].set(title=f"depth {depth}: gradient norm of the first block", xlabel="step")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.plot, dpi=80)
    print(f"wrote {args.output} and {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "run", "report"))
    parser.add_argument("--depth", type=int, choices=DEPTHS, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS))
    parser.add_argument("--warmups", nargs="+", choices=tuple(WARMUPS), default=list(WARMUPS))
    parser.add_argument("--lr", type=float, default=PEAK_LR, help="a control run at another peak learning rate")
    parser.add_argument("--runs", type=Path, default=Path("runs/norm-placement"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/norm_placement.txt"))
    parser.add_argument("--plot", type=Path, default=Path("docs/norm-placement.png"))
    args = parser.parse_args()
    {"prepare": lambda: prepare(args.runs), "run": lambda: run(args), "report": lambda: report(args)}[args.command]()


if __name__ == "__main__":
    main()
