"""The main job's training step: tformer against Hugging Face's MarianMTModel on the same real batches, CPU.

`train_step.py --workload main-job` runs this. Both models have the shape of configs/en-de-10min.yaml's model
(read from the recipe: layers, d_model, heads, d_ff, dropout); Marian is post-norm whatever the recipe's
norm placement, which costs the same (one LayerNorm per sublayer either way). The batches are the recipe's:
the embedded EN-DE corpus, a 4,000-id joint BPE, the token-budget sampler; each timed round steps every
mode once on the same batch, in alternating order, and the table gives medians.

A step is what tformer's trainer does (marian_side.Side): dropout seeded per step, forward (under bf16
autocast where named), the label-smoothed loss (tformer.training.losses, outside both models) over target
tokens, backward, the paper's Adam and schedule, zero_grad.

Modes:
- tformer fp32, dropout 0.1 (before): the recipe's step until 2026-12-01 (fp32, post-norm, dropout 0.1 with
  torch's `bernoulli_` masks): the baseline of the 4x goal;
- tformer fp32 / bf16 autocast: the recipe's model today (dropout 0); bf16 also takes the math attention path;
- tformer bf16 weights (the recipe since 2026-12-02, `train.bf16_weights`): a bf16 copy of the model trains
  with fp32 master weights in the optimizer (training/precision.py), and the loss is the fused one
  (losses.fused_label_smoothed_cross_entropy, the trainer's);
- Marian fp32 sdpa / bf16 sdpa / bf16 eager: HF's model in each attention implementation;
- Marian bf16 weights eager: the same two training-loop levers on HF's model, so that the peer gets them too;
  the best Marian mode is the peer.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from common import alternating_timing, load_report, median, set_threads
from marian_side import (
    LABEL_SMOOTHING,
    Batch,
    BatchStream,
    Side,
    build_data,
    build_marian,
    marian_logits,
    tformer_logits,
)
from torch import nn
from train_step import Report

from tformer import ModelConfig, build_model
from tformer.layers import Dropout
from tformer.training import load_recipe
from tformer.training.host_memory import keep_freed_memory
from tformer.training.losses import fused_label_smoothed_cross_entropy
from tformer.training.precision import BF16Weights
from tformer.training.seeds import seed_dropout

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "en-de-10min.yaml"
BEFORE = "tformer fp32, dropout 0.1 (before)"
RECIPE_MODE = "tformer bf16 weights (the recipe)"


class MasterWeightsSide(Side):
    """Side's step as the trainer takes it under `train.bf16_weights`: forward and backward on a bf16 copy of the
    model, the fused loss, the bf16 gradients into the fp32 masters, Adam on the masters, new weights back."""

    def __init__(self, name: str, model: nn.Module, logits_of: object) -> None:
        self.weights = BF16Weights(model)
        super().__init__(name, model, logits_of(self.weights.compute))

    def step(self, batch: Batch) -> None:
        self.weights.compute.train()
        seed_dropout(self.seed, len(self.times))
        cpu, start = time.process_time(), time.perf_counter()
        loss_sum, n_tokens = fused_label_smoothed_cross_entropy(self.logits(batch.data), batch.labels, LABEL_SMOOTHING)
        (loss_sum / n_tokens).backward()
        self.weights.grads_to_master()
        self.optimizer.step()
        self.weights.weights_from_master()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - start)
        self.cpu.append(time.process_time() - cpu)
        self.tokens.append(batch.tokens)
        self.losses.append(loss_sum.item() / batch.tokens)


def recipe_model(vocab_size: int, pad_id: int) -> ModelConfig:
    model, _ = load_recipe(RECIPE)
    return replace(model, vocab_size=vocab_size, tgt_vocab_size=None, pad_token_id=pad_id)  # as the trainer does


def with_torch_dropout(model: nn.Module) -> nn.Module:
    """The model with torch's own dropout in every Dropout layer, as the trainer ran before the cheap masks."""
    for module in model.modules():
        if isinstance(module, Dropout):
            module.forward = lambda x, m=module: F.dropout(x, m.p, m.training)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", type=Path, default=None)
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed blocks for reuse, as tformer's trainer sets on the CPU (training/host_memory.py); "
        "for every mode, Marian's too",
    )
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    out = Report(args.output)
    out.header(
        "train_step --workload main-job: the main recipe's model, tformer vs HF MarianMTModel, one training step"
    )

    if args.keep_freed_memory:
        kept = keep_freed_memory(torch.device("cpu"))
        out(f"host memory: freed blocks kept for reuse (training/host_memory.py): {kept}")
    data = build_data(seed=1, test_sentences=1)
    tok = data.tokenizer
    batches = BatchStream(data)
    config = recipe_model(tok.vocab_size, tok.pad_id)
    out(
        f"model ({RECIPE.name}): {config.n_encoder_layers}+{config.n_decoder_layers} layers, d_model {config.d_model}, "
        f"{config.n_heads} heads, d_ff {config.d_ff}, {config.norm_placement}-norm, dropout {config.dropout}, "
        f"vocab {config.vocab_size}; real batches of <= 2048 padded tokens"
    )

    def tformer(before: bool = False) -> nn.Module:
        torch.manual_seed(0)
        if before:  # the recipe's model until 2026-12-01: post-norm, dropout 0.1, torch's dropout masks
            return with_torch_dropout(build_model(replace(config, norm_placement="post", dropout=0.1)))
        return build_model(config)

    def marian(attention: str) -> nn.Module:
        torch.manual_seed(0)
        return build_marian(tok, config, attention)

    models = {
        BEFORE: (tformer(before=True), tformer_logits, False),
        "tformer fp32": (tformer(), tformer_logits, False),
        "tformer bf16 autocast": (tformer(), tformer_logits, True),
        RECIPE_MODE: (tformer(), tformer_logits, "weights"),
        "Marian fp32 sdpa": (marian("sdpa"), marian_logits, False),
        "Marian bf16 sdpa": (marian("sdpa"), marian_logits, True),
        "Marian bf16 eager": (marian("eager"), marian_logits, True),
        "Marian bf16 weights eager": (marian("eager"), marian_logits, "weights"),
    }
    # each Side steps as tformer's trainer does; step k of every mode trains on batch k
    sides = {
        name: MasterWeightsSide(name, model, logits)
        if bf16 == "weights"
        else Side(name, model, logits(model), bf16=bf16)
        for name, (model, logits, bf16) in models.items()
    }
    modes = {name: (lambda side=side: side.step(batches[len(side.times)])) for name, side in sides.items()}
    times = alternating_timing(modes, rounds=args.steps, warmup=args.warmup)
    # alternating_timing calls each mode once per round on the round's batch: tokens of rounds warmup..
    tokens = [batches[args.warmup + i].tokens for i in range(args.steps)]
    rate = {name: sum(tokens) / sum(t) for name, t in times.items()}
    before = rate[BEFORE]
    out()
    header = f"{'mode':<38} {'target tok/s':>12} {'s/step (median)':>16} {'vs before':>10} {'CPU share':>10}"
    out(header)
    out("-" * len(header))
    for name, t in times.items():
        out(
            f"{name:<38} {rate[name]:>12,.0f} {median(t):>16.3f} {rate[name] / before:>9.2f}x "
            f"{times.cpu_share(name, threads):>9.0%}"
        )
    best_tformer = max((n for n in rate if n.startswith("tformer")), key=rate.get)
    best_marian = max((n for n in rate if n.startswith("Marian")), key=rate.get)
    out()
    out(
        f"tformer best ({best_tformer}) / Marian best ({best_marian}): "
        f"{rate[best_tformer]:,.0f} / {rate[best_marian]:,.0f} = {rate[best_tformer] / rate[best_marian]:.2f}x"
    )
    out(f"tformer's recipe step against the step before: {rate[RECIPE_MODE] / before:.2f}x")
    same_mode = rate[RECIPE_MODE] / rate["Marian bf16 weights eager"]
    out(f"tformer bf16 weights / Marian bf16 weights eager (the same training loop): {same_mode:.2f}x")
    out(f"target tokens per timed round: {sum(tokens) / len(tokens):,.0f} (mean)")
    out(load_report("at end"))
    out.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
