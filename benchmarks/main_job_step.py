"""The main job's training step: tformer against Hugging Face's MarianMTModel on the same real batches, CPU.

`train_step.py --workload main-job` runs this. Both models have the shape of configs/en-de-10min.yaml's model
(read from the recipe: layers, d_model, heads, d_ff, dropout); Marian is post-norm whatever the recipe's
norm placement, which costs the same (one LayerNorm per sublayer either way). The batches are the recipe's:
the embedded EN-DE corpus, a 4,000-id joint BPE, the token-budget sampler; each timed round steps every
mode once on the same batch, in alternating order, and the table gives medians.

A step is what tformer's trainer does: forward (under bf16 autocast where named), the label-smoothed loss
(tformer.training.losses, outside both models) over target tokens, backward, fused Adam step, zero_grad.

Modes:
- tformer fp32, dropout 0.1 (before): the recipe's step until 2026-12-01 (fp32, post-norm, dropout 0.1 with
  torch's `bernoulli_` masks): the baseline of the 4x goal;
- tformer fp32 / bf16: the recipe's model today (dropout 0); bf16 also takes the math attention path;
- Marian fp32 sdpa / bf16 sdpa / bf16 eager: HF's model in each attention implementation; its best is the peer.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common import alternating_timing, busy_processes, load_report, machine_info, median, set_threads
from train_step import Report, source_state
from translation_vs_marian import BatchStream, build_data, marian_logits, tformer_logits

from tformer import ModelConfig, build_model
from tformer.layers import Dropout
from tformer.training import load_recipe
from tformer.training.losses import label_smoothed_cross_entropy

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "en-de-10min.yaml"
LABEL_SMOOTHING = 0.1
BEFORE = "tformer fp32, dropout 0.1 (before)"


def recipe_model(vocab_size: int, pad_id: int) -> ModelConfig:
    model, _ = load_recipe(RECIPE)
    return replace(model, vocab_size=vocab_size, tgt_vocab_size=None, pad_token_id=pad_id)  # as the trainer does


def with_torch_dropout(model: nn.Module) -> nn.Module:
    """The model with torch's own dropout in every Dropout layer, as the trainer ran before the cheap masks."""
    for module in model.modules():
        if isinstance(module, Dropout):
            module.forward = lambda x, m=module: F.dropout(x, m.p, m.training)
    return model


def build_marian_like(config: ModelConfig, pad_id: int, eos_id: int, bos_id: int, attention: str) -> nn.Module:
    from transformers import MarianConfig, MarianMTModel

    marian = MarianConfig(
        vocab_size=config.vocab_size, d_model=config.d_model, encoder_layers=config.n_encoder_layers,
        decoder_layers=config.n_decoder_layers, encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads, encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff,
        max_position_embeddings=config.max_seq_len, activation_function="relu", dropout=config.dropout,
        attention_dropout=config.attn_dropout, activation_dropout=0.0, scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True, pad_token_id=pad_id,
        eos_token_id=eos_id, decoder_start_token_id=bos_id, forced_eos_token_id=None,
    )
    model = MarianMTModel._from_config(marian, attn_implementation=attention)
    assert model.config._attn_implementation == attention, model.config._attn_implementation
    return model


def stepper(model: nn.Module, make_logits: Callable, batches: BatchStream, bf16: bool) -> Callable[[], None]:
    """A callable doing one training step on the next batch (its own counter: every mode sees batch k at round k).

    `make_logits(model)` gives the model's function from a batch to its logits (tformer's or Marian's call)."""
    logits = make_logits(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    count = [0]
    model.train()

    def step() -> None:
        batch = batches[count[0]]
        count[0] += 1
        with torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext():
            out = logits(batch.data)
        loss_sum, n_tokens = label_smoothed_cross_entropy(out, batch.labels, LABEL_SMOOTHING)
        (loss_sum / n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    out = Report(args.output)
    out("train_step --workload main-job: the main recipe's model, tformer vs HF MarianMTModel, one training step")
    out(f"machine: {machine_info()}")
    out(f"command: {' '.join(sys.argv)}")
    out(f"tformer source: {source_state()}")
    out(load_report("before"))
    out(f"other busy processes before: {busy_processes()}")

    data = build_data(seed=1, test_sentences=1)
    tok = data.tokenizer
    batches = BatchStream(data)
    config = recipe_model(tok.vocab_size, tok.pad_id)
    out(f"model ({RECIPE.name}): {config.n_encoder_layers}+{config.n_decoder_layers} layers, d_model {config.d_model}, "
        f"{config.n_heads} heads, d_ff {config.d_ff}, {config.norm_placement}-norm, dropout {config.dropout}, "
        f"vocab {config.vocab_size}; real batches of <= 2048 padded tokens")

    def tformer(before: bool = False) -> nn.Module:
        torch.manual_seed(0)
        if before:  # the recipe's model until 2026-12-01: post-norm, dropout 0.1, torch's dropout masks
            return with_torch_dropout(build_model(replace(config, norm_placement="post", dropout=0.1)))
        return build_model(config)

    def marian(attention: str) -> nn.Module:
        torch.manual_seed(0)
        return build_marian_like(config, tok.pad_id, tok.eos_id, tok.bos_id, attention)

    modes = {
        BEFORE: stepper(tformer(before=True), tformer_logits, batches, False),
        "tformer fp32": stepper(tformer(), tformer_logits, batches, False),
        "tformer bf16 (the recipe)": stepper(tformer(), tformer_logits, batches, True),
        "Marian fp32 sdpa": stepper(marian("sdpa"), marian_logits, batches, False),
        "Marian bf16 sdpa": stepper(marian("sdpa"), marian_logits, batches, True),
        "Marian bf16 eager": stepper(marian("eager"), marian_logits, batches, True),
    }
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
        out(f"{name:<38} {rate[name]:>12,.0f} {median(t):>16.3f} {rate[name] / before:>9.2f}x "
            f"{times.cpu_share(name, threads):>9.0%}")
    best_tformer = max((n for n in rate if n.startswith("tformer")), key=rate.get)
    best_marian = max((n for n in rate if n.startswith("Marian")), key=rate.get)
    out()
    out(f"tformer best ({best_tformer}) / Marian best ({best_marian}): "
        f"{rate[best_tformer]:,.0f} / {rate[best_marian]:,.0f} = {rate[best_tformer] / rate[best_marian]:.2f}x")
    out(f"tformer's recipe step against the step before: {rate['tformer bf16 (the recipe)'] / before:.2f}x")
    out(f"target tokens per timed round: {sum(tokens) / len(tokens):,.0f} (mean)")
    out(load_report("at end"))
    out.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
