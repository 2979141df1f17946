"""Training throughput and MFU (model FLOPs utilisation) of tformer's step on one CUDA GPU.

Two recipes, each in bf16 autocast with fused AdamW:
- gpt2: the GPT-2 small preset (124M), causal LM, 16 sequences x 1024 tokens a step, gradient clipping at 1.0;
- transformer-base: the 2017 base preset (encoder-decoder, vocabulary 37000), 192 pairs x 128 source and
  128 target tokens a step, label smoothing 0.1.

A step is tformer's training step as `Trainer.train_step` does it, on one batch: zero_grad, forward through
`tformer.training.evaluate.forward_logits` under `torch.autocast(dtype=bfloat16)`, tformer's
`label_smoothed_cross_entropy` (outside autocast, as the trainer) divided by the target tokens, backward, the
gradient norm (`clip_gradients`, computed every step to catch NaN), `loss.item()`, fused AdamW step
(`adamw_cosine`) and scheduler step. Batches are tformer's `LMBatch` / `Seq2SeqBatch` of random token ids of
a fixed shape, made once and kept on the device: no data loading is timed. By default they carry all-ones
padding masks, as the trainer's collated batches do (SDPA then takes an explicit mask);
`--masks none` passes no masks (packed sequences), which lets SDPA use its causal flash kernel.

Timing: `--warmup` untimed steps (these also compile, with `--compile`), then `--steps` timed steps, each
bracketed by `torch.cuda.synchronize()`; the table uses the median step time.

MFU = model FLOPs per step / step time / peak dense bf16 FLOP/s of the GPU. Model FLOPs per step =
3 x forward FLOPs (backward costs twice the forward) x tokens, forward FLOPs per token from
`tformer.info.model_info` at the sequence length: 2 x the weights of every matmul (output head included)
+ 4 x layers x d_model x context for attention, over the full T x T (not halved for the causal mask), the
PaLM appendix-B convention that `tformer info` prints. For transformer-base, source and target are equally
long, so encoder + decoder FLOPs per token is exact; its tokens/s counts target tokens (the trainer's
convention; as many source tokens are processed). The peak comes from a table by GPU name (`PEAK_TFLOPS`),
or `--peak-tflops`; an unknown GPU, or the CPU without `--peak-tflops`, gets no MFU.

    .venv/bin/python benchmarks/gpu_train_mfu.py                          # both recipes on cuda:0
    .venv/bin/python benchmarks/gpu_train_mfu.py --compile --masks none   # torch.compile, no padding masks
    nice -n 19 .venv/bin/python benchmarks/gpu_train_mfu.py --device cpu --tiny --steps 3 --warmup 1   # smoke test
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from common import machine_info
from torch import nn
from train_step import Report  # benchmarks run as scripts: `python benchmarks/gpu_train_mfu.py`

from tformer import ModelConfig, build_model
from tformer.data import LMBatch, Seq2SeqBatch
from tformer.info import model_info
from tformer.training.distributed import clip_gradients
from tformer.training.evaluate import forward_logits
from tformer.training.losses import label_smoothed_cross_entropy
from tformer.training.optim import adamw_cosine

# peak dense (no sparsity) bf16 tensor FLOP/s in TFLOP/s, found by a substring of torch.cuda.get_device_name();
# the first match wins, so the more specific names come first
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),  # SXM (and GH200)
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
    ("A10", 125.0),
)


@dataclass(frozen=True)
class Recipe:
    name: str
    preset: str
    tiny_preset: str  # same family, for --tiny smoke runs
    batch: int  # sequences (pairs) per step
    seq: int  # tokens per sequence (source and target alike for encoder-decoder)
    label_smoothing: float
    clip_grad: float  # inf: the norm is computed but nothing is clipped
    lr: float


RECIPES = {
    r.name: r
    for r in (
        Recipe("gpt2", "gpt2", "tiny-gpt2", batch=16, seq=1024, label_smoothing=0.0, clip_grad=1.0, lr=6e-4),
        Recipe(
            "transformer-base",
            "transformer-base",
            "tiny-transformer",
            batch=192,
            seq=128,
            label_smoothing=0.1,
            clip_grad=math.inf,
            lr=7e-4,
        ),
    )
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(RECIPES), help=f"comma-separated, from: {', '.join(RECIPES)}")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--steps", type=int, default=20, help="timed steps per model (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5; more with --compile)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step for every model (default: per recipe)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence for every model (default: per recipe)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16 autocast (default) or plain fp32")
    p.add_argument(
        "--masks",
        choices=["ones", "none"],
        default="ones",
        help="ones: all-ones padding masks as the trainer's batches (default); none: no masks",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--dropout", type=float, default=None, help="dropout for every model (default: the preset's)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak dense bf16 TFLOP/s for MFU (default: looked up by GPU name; none on CPU)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="tiny presets of the same families, batch 4 x 32 tokens: a smoke test, not a measurement",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in args.models:
        if name not in RECIPES:
            p.error(f"unknown model '{name}'; choose from {', '.join(RECIPES)}")
    if args.steps < 1 or args.warmup < 0:
        p.error("need --steps >= 1 and --warmup >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device here; use --device cpu (with --tiny for a smoke test)")
    return args


# ---- model, batch, step -------------------------------------------------------------------------------
def model_config(recipe: Recipe, args: argparse.Namespace) -> ModelConfig:
    overrides = {} if args.dropout is None else {"dropout": args.dropout, "attn_dropout": args.dropout}
    config = ModelConfig.from_preset(recipe.tiny_preset if args.tiny else recipe.preset, **overrides)
    if batch_shape(recipe, args)[1] > config.max_seq_len:
        raise SystemExit(
            f"{recipe.name}: sequences of {batch_shape(recipe, args)[1]} tokens exceed max_seq_len {config.max_seq_len}"
        )
    return config


def batch_shape(recipe: Recipe, args: argparse.Namespace) -> tuple[int, int]:
    batch, seq = (4, 32) if args.tiny else (recipe.batch, recipe.seq)
    return args.batch or batch, args.seq or seq


def random_batch(
    config: ModelConfig, batch: int, seq: int, device: torch.device, generator: torch.Generator
) -> tuple[LMBatch | Seq2SeqBatch, torch.Tensor]:
    """A fixed-shape batch of random ids with no padding, and its labels (computed once)."""

    def ids(length: int) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (batch, length), generator=generator)

    def shifted(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (inputs, what each one predicts)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    ones = torch.ones(batch, seq, dtype=torch.long)
    if config.family == "encoder-decoder":
        tgt_in, tgt_out = shifted(ids(seq + 1))
        made = Seq2SeqBatch(src=ids(seq), src_mask=ones, tgt_in=tgt_in, tgt_out=tgt_out, tgt_mask=ones)
    else:
        input_ids, labels = shifted(ids(seq + 1))
        made = LMBatch(input_ids=input_ids, attention_mask=ones, labels=labels)
    made = made.to(device)
    return made, made.labels.clone()


def without_masks(batch: LMBatch | Seq2SeqBatch) -> LMBatch | Seq2SeqBatch:
    if isinstance(batch, Seq2SeqBatch):
        return replace(batch, src_mask=None, tgt_mask=None)
    return replace(batch, attention_mask=None)


class TrainStep:
    """tformer's Trainer.train_step on one fixed batch (no gradient accumulation, one process)."""

    def __init__(
        self,
        model: nn.Module,
        batch: LMBatch | Seq2SeqBatch,
        labels: torch.Tensor,
        recipe: Recipe,
        autocast_dtype: torch.dtype | None,
        compiled: bool,
    ) -> None:
        self.model = model
        self.forward_model = torch.compile(model) if compiled else model
        self.batch, self.labels = batch, labels
        self.n_tokens = int((labels != -100).sum())
        self.recipe = recipe
        self.optimizer, self.scheduler = adamw_cosine(model, recipe.lr, warmup=100, total=10_000, fused=True)
        self.autocast_dtype = autocast_dtype
        self.device_type = labels.device.type

    def __call__(self) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device_type, self.autocast_dtype, enabled=self.autocast_dtype is not None):
            logits = forward_logits(self.forward_model, self.batch)
        loss_sum, _ = label_smoothed_cross_entropy(logits, self.labels, self.recipe.label_smoothing)
        (loss_sum / self.n_tokens).backward()
        loss = loss_sum.item()
        grad_norm = clip_gradients(self.model.parameters(), self.recipe.clip_grad)
        if not (math.isfinite(loss) and torch.isfinite(grad_norm)):
            raise RuntimeError(f"loss {loss} / gradient norm {grad_norm.item()} is not finite")
        self.optimizer.step()
        self.scheduler.step()
        return loss / self.n_tokens


# ---- timing ---------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: TrainStep, device: torch.device, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each timed step and the losses of all steps."""
    losses = [step() for _ in range(warmup)]
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        losses.append(step())
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times, losses


@dataclass
class Measurement:
    name: str
    config: ModelConfig
    batch: int
    seq: int
    tokens_per_step: int
    flops_per_step: float
    step_times: list[float]
    losses: list[float]
    peak_memory: int | None  # bytes, CUDA only

    @property
    def step_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def flops_per_s(self) -> float:
        return self.flops_per_step / self.step_s


def train_flops_per_step(config: ModelConfig, batch: int, seq: int) -> float:
    """3 x forward FLOPs (tformer.info, at context `seq`) x the tokens of a step: source and target tokens
    of an encoder-decoder are equally many, so encoder + decoder FLOPs per token covers both."""
    return 3 * model_info(config, context=seq).forward_flops_per_token * batch * seq


def measure(recipe: Recipe, args: argparse.Namespace, device: torch.device) -> Measurement:
    config = model_config(recipe, args)
    batch, seq = batch_shape(recipe, args)
    torch.manual_seed(args.seed)
    model = build_model(config).to(device)
    made, labels = random_batch(config, batch, seq, device, torch.Generator().manual_seed(args.seed))
    if args.masks == "none":
        made = without_masks(made)
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    step = TrainStep(model, made, labels, recipe, autocast_dtype, args.compile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = time_steps(step, device, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    result = Measurement(
        recipe.name, config, batch, seq, step.n_tokens, train_flops_per_step(config, batch, seq), times, losses, peak
    )
    del step, model, made, labels
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---- the report -----------------------------------------------------------------------------------------
def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
            f"capability {props.major}.{props.minor}; CUDA {torch.version.cuda}"
        )
    return f"CPU: {machine_info()}"


def peak_flops(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """Peak dense bf16 FLOP/s and where it came from."""
    if override is not None:
        return override * 1e12, f"{override:g} TFLOP/s (--peak-tflops)"
    if device.type != "cuda":
        return None, "none on CPU (pass --peak-tflops for an MFU)"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12, f"{tflops:g} TFLOP/s dense bf16 ('{key}' in '{name}')"
    return None, f"unknown for '{name}' (pass --peak-tflops)"


def count(n: float) -> str:
    """124.4M, 58.8k, 1.2G: three significant digits or so."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def format_table(results: list[Measurement], peak: float | None) -> list[str]:
    header = (
        f"{'model':<17} {'params':>8} {'batch x seq':>12} {'tokens/step':>11} {'step ms':>8} {'tokens/s':>10} "
        f"{'TFLOP/s':>8} {'MFU':>6} {'peak mem GiB':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        mfu = f"{100 * r.flops_per_s / peak:.1f}%" if peak else "-"
        memory = f"{r.peak_memory / 2**30:.2f}" if r.peak_memory is not None else "-"
        params = count(model_info(r.config).n_params)
        lines.append(
            f"{r.name:<17} {params:>8} {f'{r.batch} x {r.seq}':>12} {r.tokens_per_step:>11,} "
            f"{1e3 * r.step_s:>8.1f} {r.tokens_per_s:>10,.0f} {r.flops_per_s / 1e12:>8.2f} {mfu:>6} "
            f"{memory:>12}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    out = Report(args.output)
    peak, peak_note = peak_flops(device, args.peak_tflops)
    out("gpu_train_mfu: tformer training step throughput and MFU" + (" (--tiny: a smoke test)" if args.tiny else ""))
    out(f"device: {device_description(device)}")
    out(f"torch {torch.__version__}; command: {' '.join(sys.argv)}")
    out(
        f"step: forward_logits under {'bf16 autocast' if args.dtype == 'bf16' else 'fp32'}, "
        f"label_smoothed_cross_entropy / tokens, backward, grad norm, loss.item(), fused AdamW + scheduler; "
        f"masks {args.masks}; torch.compile {'on' if args.compile else 'off'}; {args.warmup} warmup + "
        f"{args.steps} timed steps, median step time"
    )
    out(
        f"FLOPs: 3 x forward (tformer.info.model_info at the sequence length; attention over full T x T); "
        f"peak {peak_note}"
    )
    results = []
    for name in args.models:
        result = measure(RECIPES[name], args, device)
        results.append(result)
        out(
            f"{name}: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}; step ms min "
            f"{1e3 * min(result.step_times):.1f} / median {1e3 * result.step_s:.1f} / max "
            f"{1e3 * max(result.step_times):.1f}; {count(result.flops_per_step / result.tokens_per_step)} FLOP "
            f"per trained token"
        )
    out()
    for line in format_table(results, peak):
        out(line)
    out("tokens/s: trained (target) tokens; transformer-base also reads as many source tokens")
    out.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
