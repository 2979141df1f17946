"""One training step of tformer's GPT-2 small against Hugging Face's GPT2LMHeadModel, on CPU.

A step is: forward, cross-entropy loss, backward, AdamW step, zero_grad. Both models have the GPT-2 small
shape (12 layers, d_model 768, 12 heads, vocabulary 50257), no dropout, random weights (the HF model gets a
copy of tformer's weights, so the two compute the same function; the first losses are checked to agree).
The loss is computed outside both models by the same code, so the comparison is the models' own cost.

The two steps alternate in one process (one tformer step, one HF step, order swapped every other round)
after untimed warmup rounds; the table reports medians and the load average is recorded beside it.
Throughput is also given as a share of the measured matmul peak of this machine (see --help for the FLOP
count used).

    .venv/bin/python benchmarks/train_step.py                     # defaults: ~3.5 min on 2 quiet cores
    .venv/bin/python benchmarks/train_step.py --workload main-job  # the main recipe vs Marian (main_job_step.py)
    .venv/bin/python benchmarks/train_step.py --steps 4 --warmup 1 --dtypes fp32
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (  # benchmarks run as scripts: `python benchmarks/train_step.py`
    alternating_timing,
    busy_processes,
    fmt_rate,
    load_report,
    machine_info,
    matmul_peak,
    matmul_probe,
    median,
    set_threads,
    wait_for_idle,
)
from torch import nn

from tformer import ModelConfig, build_model

DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # name -> autocast dtype (None: plain fp32)
PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

FLOP_NOTE = (
    "FLOPs per trained token = 3 x forward, forward = 2 x (matmul weights, LM head included) "
    "+ 4 x n_layers x T x d_model (attention scores and values, full T x T, not halved for causality)"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=FLOP_NOTE)
    p.add_argument("--steps", type=int, default=8, help="timed steps per model and dtype (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model and dtype first (default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32 (plain), bf16 (CPU autocast)")
    p.add_argument(
        "--optimizer",
        choices=["auto", "fused", "foreach", "for-loop"],
        default="auto",
        help="AdamW implementation for both models; auto: fused if it works here, else foreach",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: os.cpu_count())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before timing, wait up to this long for other busy processes to finish (default 0)",
    )
    p.add_argument("--output", type=Path, default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype '{d}'; choose from {', '.join(DTYPES)}")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 2:
        p.error("need --steps >= 1, --warmup >= 0, --batch >= 1, --seq >= 2")
    return args


# ---- models ---------------------------------------------------------------------------------------------
def build_tformer(seq: int) -> nn.Module:
    cfg = ModelConfig.from_preset("gpt2", dropout=0.0, attn_dropout=0.0)
    if seq > cfg.max_seq_len:
        raise SystemExit(f"--seq {seq} exceeds GPT-2's {cfg.max_seq_len} positions")
    return build_model(cfg).train()


def build_hf() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_positions=1024,
        vocab_size=50257,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
    )
    model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model.train()


@torch.no_grad()
def copy_weights(tf: nn.Module, hf: nn.Module) -> None:
    """tformer -> HF. HF's Conv1D stores (in, out), so linear weights are transposed; q, k, v are fused."""
    dec, tr = tf.decoder, hf.transformer
    tr.wte.weight.copy_(dec.tokens.weight)
    tr.wpe.weight.copy_(dec.positions.embedding.weight)
    for src, dst in zip(dec.layers, tr.h, strict=True):
        a = src.self_attn
        dst.attn.c_attn.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).T)
        dst.attn.c_attn.bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        dst.attn.c_proj.weight.copy_(a.out_proj.weight.T)
        dst.attn.c_proj.bias.copy_(a.out_proj.bias)
        dst.mlp.c_fc.weight.copy_(src.ffn.up_proj.weight.T)
        dst.mlp.c_fc.bias.copy_(src.ffn.up_proj.bias)
        dst.mlp.c_proj.weight.copy_(src.ffn.down_proj.weight.T)
        dst.mlp.c_proj.bias.copy_(src.ffn.down_proj.bias)
        for s, d in ((src.norm_attn.norm, dst.ln_1), (src.norm_ffn.norm, dst.ln_2)):
            d.weight.copy_(s.weight)
            d.bias.copy_(s.bias)
    tr.ln_f.weight.copy_(dec.final_norm.weight)
    tr.ln_f.bias.copy_(dec.final_norm.bias)
    assert hf.lm_head.weight.data_ptr() == tr.wte.weight.data_ptr(), "HF LM head is not tied"


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def train_flops_per_token(model: nn.Module, n_layers: int, d_model: int, seq: int) -> tuple[int, int]:
    """(matmul weight count, training FLOPs per token) for tformer's model, per FLOP_NOTE."""
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    forward = 2 * matmul_weights + 4 * n_layers * seq * d_model
    try:  # the same convention as `tformer info`; check that the two counts agree where it exists
        from tformer.info import model_info
    except ImportError:
        return matmul_weights, 3 * forward
    expected = model_info(model.config, context=seq).training_flops_per_token
    assert expected == 3 * forward, f"FLOP count {3 * forward} disagrees with tformer.info's {expected}"
    return matmul_weights, 3 * forward


# ---- the step -------------------------------------------------------------------------------------------
def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; labels are input_ids shifted left with -100 in the last position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def make_adamw(model: nn.Module, impl: str) -> torch.optim.AdamW:
    kwargs = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **kwargs)


def pick_optimizer(requested: str) -> tuple[str, str]:
    """The AdamW implementation to use and a note on why."""
    if requested != "auto":
        return requested, "requested"
    try:
        p = nn.Parameter(torch.randn(8, 8))
        p.grad = torch.randn(8, 8)
        torch.optim.AdamW([p], lr=1e-4, fused=True).step()
        return "fused", f"fused=True works on CPU in torch {torch.__version__}"
    except (RuntimeError, TypeError) as err:
        return "foreach", f"fused=True failed on CPU ({err}); using foreach"


def make_step(
    forward: Callable[[torch.Tensor], torch.Tensor],
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    labels: torch.Tensor,
    autocast_dtype: torch.dtype | None,
    losses: list[float],
) -> Callable[[], None]:
    def step() -> None:
        ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with ctx:
            loss = lm_loss(forward(ids), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return step


# ---- report ---------------------------------------------------------------------------------------------
class Report:
    """Lines printed and kept for `path`; `prepend` puts them above the reports already in the file (newest
    first), otherwise the file is replaced."""

    def __init__(self, path: Path | None, prepend: bool = False) -> None:
        self.lines: list[str] = []
        self.path = path
        self.prepend = prepend

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def header(self, title: str) -> None:
        """The report's first lines: what runs, on which machine and checkout, and the load before it starts."""
        self(title)
        self(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        self(f"machine: {machine_info()}")
        self(f"command: {' '.join(sys.argv)}")
        self(f"tformer source: {source_state()}")
        self(load_report("before"))
        self(f"other busy processes before: {busy_processes()}")

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            older = self.path.read_text(encoding="utf-8") if self.prepend and self.path.is_file() else ""
            self.path.write_text("\n".join(self.lines) + "\n" + ("\n" + older if older else ""), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--workload" in argv:  # --workload main-job: the translation recipe's model against Marian
        i = argv.index("--workload")
        workload, rest = argv[i + 1 : i + 2], argv[:i] + argv[i + 2 :]
        if workload == ["main-job"]:
            from main_job_step import main as main_job

            return main_job(rest)
        if workload != ["gpt2"]:
            raise SystemExit(f"unknown --workload {' '.join(workload) or '(missing)'}; choose gpt2 or main-job")
        argv = rest
    args = parse_args(argv)
    threads = set_threads(args.threads)
    out = Report(args.output)
    out.header("train_step: tformer GPT-2 small vs HF GPT2LMHeadModel (sdpa), one training step, CPU")
    if args.wait_idle > 0:
        waited, busy = wait_for_idle(args.wait_idle)
        out(
            f"waited {waited:.0f}s for other processes to go quiet (--wait-idle {args.wait_idle:g}); still busy: {busy}"
        )

    for name in args.dtypes:
        out(
            f"matmul peak {name} before: {fmt_rate(matmul_peak(PEAK_DTYPES[name]))} "
            f"(2048x2048 @ 2048x2048, median of 10)"
        )

    torch.manual_seed(args.seed)
    tf, hf = build_tformer(args.seq), build_hf()
    copy_weights(tf, hf)
    cfg = tf.config
    weights, flops_tok = train_flops_per_token(tf, cfg.n_decoder_layers, cfg.d_model, args.seq)
    impl, impl_note = pick_optimizer(args.optimizer)
    B, T = args.batch, args.seq
    tokens = B * T

    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(args.seed))
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)

    def tf_forward(x: torch.Tensor) -> torch.Tensor:
        return tf(x)

    def hf_forward(x: torch.Tensor) -> torch.Tensor:
        return hf(input_ids=x, use_cache=False).logits

    with torch.no_grad():
        l_tf, l_hf = lm_loss(tf_forward(ids), labels).item(), lm_loss(hf_forward(ids), labels).item()
    if abs(l_tf - l_hf) > 1e-3 * max(1.0, abs(l_hf)):
        raise SystemExit(f"the two models disagree after the weight copy: loss {l_tf:.5f} vs {l_hf:.5f}")

    out(
        f"params: tformer {n_params(tf):,}, HF {n_params(hf):,} (tied LM head); same weights, "
        f"fp32 loss {l_tf:.4f} vs {l_hf:.4f}"
    )
    out(f"batch {B} x {T} = {tokens} tokens/step; AdamW(lr=1e-4, {impl}) for both ({impl_note})")
    out(
        "step = forward + cross-entropy (shifted labels, same code both sides) + backward + AdamW step "
        "+ zero_grad(set_to_none=True)"
    )
    out(
        f"FLOPs: {FLOP_NOTE} (as `tformer info`); matmul weights {weights:,} -> {flops_tok / 1e6:.1f} "
        f"MFLOP/token at T={T}"
    )
    out(
        f"timing: {args.warmup} warmup + {args.steps} timed steps per model and dtype, tformer and HF "
        f"alternating step by step (order swapped every other round); medians. Each round also times two "
        f"2048^3 matmuls: their median is the peak for '% of peak', measured under the same load as the steps"
    )
    out()

    results, peaks = [], {}
    for name in args.dtypes:
        opt_tf, opt_hf = make_adamw(tf, impl), make_adamw(hf, impl)
        losses: dict[str, list[float]] = {"tformer": [], "HF": []}
        probe, probe_flops = matmul_probe(PEAK_DTYPES[name])
        steps = {
            "tformer": make_step(tf_forward, tf, opt_tf, ids, labels, DTYPES[name], losses["tformer"]),
            "HF": make_step(hf_forward, hf, opt_hf, ids, labels, DTYPES[name], losses["HF"]),
            "matmul": probe,  # the peak, measured in the same rounds as the steps
        }
        times = alternating_timing(steps, rounds=args.steps, warmup=args.warmup)
        load = load_report(f"after {name}")
        peaks[name] = probe_flops / median(times.pop("matmul"))
        med = {k: median(v) for k, v in times.items()}
        tps = {k: tokens / v for k, v in med.items()}
        pct = {k: 100 * tps[k] * flops_tok / peaks[name] for k in tps}
        results.append((name, med, tps, pct, times, losses))
        out(
            f"{name}: step seconds tformer {_spread(times['tformer'])}, HF {_spread(times['HF'])}; "
            f"last loss tformer {losses['tformer'][-1]:.4f}, HF {losses['HF'][-1]:.4f}"
        )
        out(
            f"{name}: CPU share (process CPU time / (wall x {threads} threads), median) tformer "
            f"{times.cpu_share('tformer', threads):.0%}, HF {times.cpu_share('HF', threads):.0%}"
        )
        out(load)
        out(f"other busy processes after {name}: {busy_processes()}")
        del steps, opt_tf, opt_hf  # free the optimizer state before the next dtype

    out()
    header = (
        f"{'dtype':<6} {'tformer tok/s':>13} {'HF tok/s':>9} {'tformer/HF':>10} "
        f"{'tformer %peak':>13} {'HF %peak':>9} {'tformer s/step':>14} {'HF s/step':>9}  peak used"
    )
    out(header)
    out("-" * len(header))
    for name, med, tps, pct, _, _ in results:
        label = name if name == "fp32" else f"{name}*"
        out(
            f"{label:<6} {tps['tformer']:>13.1f} {tps['HF']:>9.1f} {tps['tformer'] / tps['HF']:>10.3f} "
            f"{pct['tformer']:>12.1f}% {pct['HF']:>8.1f}% {med['tformer']:>14.3f} {med['HF']:>9.3f}  "
            f"{name} matmul {fmt_rate(peaks[name])} (in-run)"
        )
    if "bf16" in args.dtypes:
        out("* bf16 = torch.autocast('cpu', dtype=torch.bfloat16) around forward and loss; fp32 weights and AdamW")
    out(load_report("at end"))
    out("(the load average counts this benchmark's own threads too: about the thread count when nothing else runs)")
    out.save()
    return 0


def source_state() -> str:
    """The git commit of the tformer checkout and whether src/ has uncommitted changes (results depend on it)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = [line[3:] for line in git("status", "--porcelain", "--", "src").splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"commit {commit}" + (f", src/ modified: {', '.join(dirty)}" if dirty else ", src/ clean")


def _spread(times: list[float]) -> str:
    return f"median {median(times):.3f} [min {min(times):.3f}, max {max(times):.3f}]"


if __name__ == "__main__":
    sys.exit(main())
