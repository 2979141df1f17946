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
The recipe's mode also computes the gradient norm, as the trainer does every step (for its log and divergence
check); the other modes do not.

`--levers` times tformer's recipe step against the same step with one lever changed (Adam fused / foreach /
for-loop, the gradient norm as before, SDPA's CPU flash kernel instead of the math path, bf16 autocast with the
fused loss, and with `--compile` torch.compile of the bf16 model) and reports the padding share of the batches.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from common import alternating_timing, load_report, median, set_threads
from marian_side import (
    D_MODEL,
    LABEL_SMOOTHING,
    LR_SCALE,
    WARMUP,
    Batch,
    BatchStream,
    Side,
    build_data,
    build_marian,
    marian_logits,
    tformer_logits,
)
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from train_step import Report

from tformer import ModelConfig, build_model
from tformer.layers import Dropout
from tformer.layers import attention as attention_module
from tformer.training import load_recipe
from tformer.training.distributed import clip_gradients
from tformer.training.host_memory import keep_freed_memory
from tformer.training.losses import fused_label_smoothed_cross_entropy
from tformer.training.optim import noam_lr
from tformer.training.precision import BF16Weights
from tformer.training.seeds import seed_dropout

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "en-de-10min.yaml"
BEFORE = "tformer fp32, dropout 0.1 (before)"
RECIPE_MODE = "tformer bf16 weights (the recipe)"


def record_step(side: Side, start: float, cpu: float, batch: Batch, loss_sum: torch.Tensor) -> None:
    """One step of `side`: its wall and CPU time since `start` / `cpu`, its target tokens and its mean loss."""
    side.times.append(time.perf_counter() - start)
    side.cpu.append(time.process_time() - cpu)
    side.tokens.append(batch.tokens)
    side.losses.append(loss_sum.item() / batch.tokens)


class MasterWeightsSide(Side):
    """Side's step as the trainer takes it under `train.bf16_weights`: forward and backward on a bf16 copy of the
    model, the fused loss, the bf16 gradients into the fp32 masters, Adam on the masters, new weights back.

    The lever modes (--levers) change one thing each: `adam` (fused, foreach or for-loop), `grad_norm` (what runs
    between backward and the optimizer step; the trainer computes the norm every step), `math_max_keys` (the
    longest keys that take the math attention path; 0: SDPA's CPU flash kernel always) and `compile`."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        logits_of: object,
        adam: str = "fused",
        grad_norm: Callable[[list[nn.Parameter]], object] | None = None,
        math_max_keys: int | None = None,
        compile: bool = False,
    ) -> None:
        self.weights = BF16Weights(model)
        compute = torch.compile(self.weights.compute, dynamic=True) if compile else self.weights.compute
        super().__init__(name, model, logits_of(compute))
        if adam != "fused":
            self.optimizer, self.scheduler = paper_adam_as(model, adam)
        self.grad_norm, self.math_max_keys = grad_norm, math_max_keys

    def step(self, batch: Batch) -> None:
        self.weights.compute.train()
        seed_dropout(self.seed, len(self.times))
        cpu, start = time.process_time(), time.perf_counter()
        with math_attention_up_to(self.math_max_keys):
            logits = self.logits(batch.data)
        loss_sum, n_tokens = fused_label_smoothed_cross_entropy(logits, batch.labels, LABEL_SMOOTHING)
        with math_attention_up_to(self.math_max_keys):
            (loss_sum / n_tokens).backward()
        self.weights.grads_to_master()
        if self.grad_norm is not None:
            self.grad_norm(self.weights.master_params)
        self.optimizer.step()
        self.weights.weights_from_master()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        record_step(self, start, cpu, batch, loss_sum)


class AutocastSide(Side):
    """The trainer's step under `train.bf16` alone (the recipe until 2026-12-02): the fp32 model's forward under
    bf16 autocast, the fused loss, backward, the trainer's gradient norm, fused Adam."""

    def step(self, batch: Batch) -> None:
        self.model.train()
        seed_dropout(self.seed, len(self.times))
        cpu, start = time.process_time(), time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16):
            logits = self.logits(batch.data)
        loss_sum, n_tokens = fused_label_smoothed_cross_entropy(logits, batch.labels, LABEL_SMOOTHING)
        (loss_sum / n_tokens).backward()
        trainer_grad_norm(list(self.model.parameters()))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        record_step(self, start, cpu, batch, loss_sum)


def paper_adam_as(model: nn.Module, implementation: str) -> tuple:
    """training.optim.paper_adam's optimizer and schedule with torch's foreach or for-loop Adam instead of fused."""
    params = [p for p in model.parameters() if p.requires_grad]
    foreach = implementation == "foreach"
    optimizer = torch.optim.Adam(params, lr=1.0, betas=(0.9, 0.98), eps=1e-9, fused=False, foreach=foreach)
    return optimizer, LambdaLR(optimizer, lambda step: noam_lr(step + 1, D_MODEL, WARMUP, LR_SCALE))


@contextmanager
def math_attention_up_to(max_keys: int | None) -> Iterator[None]:
    """bf16 training attention takes the math path over at most `max_keys` keys (None: the library's setting)."""
    saved = attention_module.CPU_TRAINING_MATH_MAX_KEYS
    if max_keys is not None:
        attention_module.CPU_TRAINING_MATH_MAX_KEYS = max_keys
    try:
        yield
    finally:
        attention_module.CPU_TRAINING_MATH_MAX_KEYS = saved


def recipe_model(vocab_size: int, pad_id: int) -> ModelConfig:
    model, _ = load_recipe(RECIPE)
    return replace(model, vocab_size=vocab_size, tgt_vocab_size=None, pad_token_id=pad_id)  # as the trainer does


def with_torch_dropout(model: nn.Module) -> nn.Module:
    """The model with torch's own dropout in every Dropout layer, as the trainer ran before the cheap masks."""
    for module in model.modules():
        if isinstance(module, Dropout):
            module.forward = lambda x, m=module: F.dropout(x, m.p, m.training)
    return model


def trainer_grad_norm(params: list[nn.Parameter]) -> None:
    """What tformer's trainer runs between backward and the optimizer step with train.clip_grad 0 (the recipe's):
    the total gradient norm, for the log and the divergence check (training/distributed.clip_gradients)."""
    clip_gradients(params, math.inf)


def clip_grad_norm_at_inf(params: list[nn.Parameter]) -> None:
    """The trainer's gradient norm until 2026-12-02: torch's clip_grad_norm_ at an infinite limit, which also
    multiplies every gradient by 1.0."""
    torch.nn.utils.clip_grad_norm_(params, math.inf)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", type=Path, default=None, help="prepend the report to this file (newest first)")
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed blocks for reuse, as tformer's trainer sets on the CPU (training/host_memory.py); "
        "for every mode, Marian's too",
    )
    p.add_argument(
        "--levers",
        action="store_true",
        help="instead of the peer comparison: tformer's recipe step against one lever changed at a time (Adam's "
        "implementation, the gradient norm, SDPA's flash kernel for attention, autocast), and the padding share",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="with --levers: also torch.compile(dynamic=True) of the bf16 model; reports the compile seconds "
        "(the first steps, untimed) and the steady step",
    )
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    out = Report(args.output, prepend=True)
    out.header(
        "train_step --workload main-job: the main recipe's model, tformer vs HF MarianMTModel, one training step"
        if not args.levers
        else "main_job_step --levers: the main recipe's step, one lever changed at a time (tformer only)"
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
    if args.levers:
        lever_report(args, out, threads, config, batches)
    else:
        peer_report(args, out, threads, config, tok, batches)
    out(load_report("at end"))
    out.save()
    return 0


def peer_report(args: argparse.Namespace, out: Report, threads: int, config: ModelConfig, tok, batches) -> None:
    """Every tformer mode and every Marian mode on the same batches; the best of each side against the other's."""

    def tformer(before: bool = False) -> nn.Module:
        torch.manual_seed(0)
        if before:  # the recipe's model until 2026-12-01: post-norm, dropout 0.1, torch's dropout masks
            return with_torch_dropout(build_model(replace(config, norm_placement="post", dropout=0.1)))
        return build_model(config)

    def marian(attention: str) -> nn.Module:
        torch.manual_seed(0)
        return build_marian(tok, config, attention)

    sides = {
        BEFORE: Side(BEFORE, model := tformer(before=True), tformer_logits(model)),
        "tformer fp32": Side("tformer fp32", model := tformer(), tformer_logits(model)),
        "tformer bf16 autocast": Side("tformer bf16 autocast", model := tformer(), tformer_logits(model), bf16=True),
        RECIPE_MODE: MasterWeightsSide(RECIPE_MODE, tformer(), tformer_logits, grad_norm=trainer_grad_norm),
        "Marian fp32 sdpa": Side("Marian fp32 sdpa", model := marian("sdpa"), marian_logits(model)),
        "Marian bf16 sdpa": Side("Marian bf16 sdpa", model := marian("sdpa"), marian_logits(model), bf16=True),
        "Marian bf16 eager": Side("Marian bf16 eager", model := marian("eager"), marian_logits(model), bf16=True),
        "Marian bf16 weights eager": MasterWeightsSide("Marian bf16 weights eager", marian("eager"), marian_logits),
    }
    rate, times = time_sides(args, out, threads, sides, batches, baseline=BEFORE, baseline_label="vs before")
    best_tformer = max((n for n in rate if n.startswith("tformer")), key=rate.get)
    best_marian = max((n for n in rate if n.startswith("Marian")), key=rate.get)
    out()
    out(
        f"tformer best ({best_tformer}) / Marian best ({best_marian}): "
        f"{rate[best_tformer]:,.0f} / {rate[best_marian]:,.0f} = {rate[best_tformer] / rate[best_marian]:.2f}x"
    )
    out(f"tformer's recipe step against the step before: {rate[RECIPE_MODE] / rate[BEFORE]:.2f}x")
    same_mode = rate[RECIPE_MODE] / rate["Marian bf16 weights eager"]
    out(f"tformer bf16 weights / Marian bf16 weights eager (the same training loop): {same_mode:.2f}x")


def lever_report(args: argparse.Namespace, out: Report, threads: int, config: ModelConfig, batches) -> None:
    """The recipe's step (bf16 weights, fused Adam, the trainer's gradient norm, math attention at these lengths)
    against the same step with one lever changed, all on the same batches, alternating."""

    def side(name: str, **lever: object) -> MasterWeightsSide:
        torch.manual_seed(0)
        return MasterWeightsSide(name, build_model(config), tformer_logits, **{"grad_norm": trainer_grad_norm, **lever})

    sides = {
        RECIPE_MODE: side(RECIPE_MODE),
        "Adam foreach (not fused)": side("Adam foreach", adam="foreach"),
        "Adam for-loop": side("Adam for-loop", adam="for-loop"),
        "grad norm by clip_grad_norm_ (before)": side("clip_grad_norm_", grad_norm=clip_grad_norm_at_inf),
        "attention: SDPA's CPU flash kernel": side("flash", math_max_keys=0),
    }
    torch.manual_seed(0)
    autocast_model = build_model(config)
    autocast = AutocastSide("autocast", autocast_model, tformer_logits(autocast_model))
    sides["bf16 autocast (the recipe before)"] = autocast
    if args.compile:
        compiled = side("torch.compile", compile=True)
        start = time.perf_counter()
        for k in range(3):  # untimed: the first shape compiles, a second with source != target length recompiles
            compiled.step(batches[k])
        out(f"torch.compile(dynamic=True): the first 3 steps took {time.perf_counter() - start:.1f} s (compiling)")
        compiled.times.clear()
        sides["torch.compile(dynamic=True) of the bf16 model"] = compiled
    time_sides(args, out, threads, sides, batches, baseline=RECIPE_MODE, baseline_label="vs recipe")
    out()
    out(padding_line([batches[args.warmup + i].data for i in range(args.steps)]))


def padding_line(batches: list) -> str:
    """The share of each side's padded positions that are padding, over the timed batches."""
    src_real = sum(int(b.src_mask.sum()) for b in batches)
    src_all = sum(b.src.numel() for b in batches)
    tgt_real = sum(int((b.labels != -100).sum()) for b in batches)
    tgt_all = sum(b.labels.numel() for b in batches)
    return (
        f"padding in the timed batches: source {1 - src_real / src_all:.1%} of {src_all / len(batches):,.0f} "
        f"positions a batch, target {1 - tgt_real / tgt_all:.1%} of {tgt_all / len(batches):,.0f}"
    )


def time_sides(args, out: Report, threads: int, sides: dict, batches, baseline: str, baseline_label: str) -> tuple:
    """Steps every side once per round on the round's batch (step k of every side trains on batch k, in
    alternating order), prints the table and returns ({name: target tok/s}, timings)."""
    modes = {name: (lambda side=side: side.step(batches[len(side.times)])) for name, side in sides.items()}
    times = alternating_timing(modes, rounds=args.steps, warmup=args.warmup)
    # alternating_timing calls each mode once per round on the round's batch: tokens of rounds warmup..
    tokens = [batches[args.warmup + i].tokens for i in range(args.steps)]
    rate = {name: sum(tokens) / sum(t) for name, t in times.items()}
    out()
    header = f"{'mode':<46} {'target tok/s':>12} {'s/step (median)':>16} {baseline_label:>10} {'CPU share':>10}"
    out(header)
    out("-" * len(header))
    for name, t in times.items():
        out(
            f"{name:<46} {rate[name]:>12,.0f} {median(t):>16.3f} {rate[name] / rate[baseline]:>9.2f}x "
            f"{times.cpu_share(name, threads):>9.0%}"
        )
    out(f"target tokens per timed round: {sum(tokens) / len(tokens):,.0f} (mean)")
    return rate, times


if __name__ == "__main__":
    sys.exit(main())
