"""Length extrapolation of small decoder LMs: sliding-window perplexity and passkey retrieval at 1-32 x L.

    .venv/bin/python benchmarks/extrapolation.py prepare      # packed text + the shared tokenizer (seconds)
    OMP_NUM_THREADS=1 tformer train configs/extrapolation-<scheme>.yaml     # sinusoidal, learned, rope, alibi
    OMP_NUM_THREADS=1 tformer train configs/extrapolation-rope-finetune.yaml [...]  # PI / NTK / YaRN at 4 x L
    .venv/bin/python benchmarks/extrapolation.py evaluate     # the tables (about 15 minutes on a loaded 2-core CPU)

`prepare` trains one byte-level BPE on the training books and packs consecutive verses into lines of at most
L - 1 tokens (and 4L - 1 for the fine-tune), so each training example is bos + a line: the models see positions
0..L-1. It puts the tokenizer into each scheme's run directory, where `tformer train` reuses it, so all four
models share one vocabulary and the same packed text.

`evaluate` reads the test books (Proverbs, then John) as one token stream and scores the same COUNT tokens
(stream positions 32L .. 32L + COUNT) at every context length N with `sliding_window_nll`: windows of N
positions (bos + N - 1 tokens), stride N / 8, only the last stride predictions of each window scored, so every
scored token has at least 7N/8 tokens of left context. RoPE rows with PI (linear) and YaRN set rope_factor =
N / L at each N; NTK (dynamic-ntk, factor 1) scales its base from the input length by itself. Fine-tuned rows
keep the scaling they were fine-tuned with (factor 4). Passkey: PASSKEY_TRIALS random keys per (length, depth).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from common import load_report, machine_info, set_threads

from tformer import ModelConfig, build_model
from tformer.data import Tokenizer, bible_text
from tformer.errors import RequestError
from tformer.models import CONFIG_FILE, TransformerModel, assign_weights, load
from tformer.training.extrapolation import (
    pack_lines,
    passkey_example,
    passkey_scores,
    sliding_window_nll,
)

SCHEMES = ("sinusoidal", "learned", "rope", "alibi")
ROPE_SCALINGS = {"PI": "linear", "NTK": "dynamic-ntk", "YaRN": "yarn"}
FINETUNED = {"PI": "rope-linear-ft", "NTK": "rope-ntk-ft", "YaRN": "rope-yarn-ft"}
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
PASSKEY_TRIALS = 10


class SkipPerplexity(Exception):
    """--no-perplexity: only the passkey is measured."""


def prepare(args: argparse.Namespace) -> None:
    """Writes the packed training/dev text and puts one shared tokenizer into every scheme's run directory."""
    data = args.runs / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, dev = bible_text("train"), bible_text("dev")
    tokenizer = Tokenizer.train(train, args.vocab_size)
    tokenizer.save(data)
    for length in (args.length, args.finetune_factor * args.length):
        for split, verses in (("train", train), ("dev", dev)):
            lines = pack_lines(tokenizer, verses, length - 1)
            (data / f"{split}-{length - 1}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
            tokens = sum(map(len, tokenizer.encode_batch(lines, add_bos=False)))
            print(f"{split}-{length - 1}.txt: {len(lines)} lines, {tokens} tokens ({tokens / len(lines):.0f} per line)")
    for scheme in SCHEMES:
        tokenizer.save(args.runs / scheme)
    print(f"tokenizer ({tokenizer.vocab_size} tokens) in {data} and runs {', '.join(SCHEMES)}")


def latest_checkpoint(run: Path) -> Path | None:
    """The run's last checkpoint, or None (with a note) when it has none yet."""
    checkpoints = sorted((run / "checkpoints").glob("step-*"))
    if not checkpoints:
        print(f"{run} has no checkpoint yet (see this file's docstring): its rows are left out", file=sys.stderr)
    return checkpoints[-1] if checkpoints else None


def with_config(checkpoint: Path, **changes) -> TransformerModel:
    """The checkpoint's weights in a model built with config changes that add no weights (RoPE scaling)."""
    config = replace(ModelConfig.from_file(checkpoint / CONFIG_FILE), attention_backend="sdpa", **changes)
    model = build_model(config, initialize=False)
    missing, unexpected, mismatched = assign_weights(model, load(checkpoint).state_dict())
    if missing or unexpected or mismatched:
        raise SystemExit(f"{checkpoint}: missing {missing}, unexpected {unexpected}, wrong shapes {mismatched}")
    return model.eval()


def rows(runs: Path, factor: int) -> dict[str, TransformerModel]:
    """Row name -> the model to evaluate at `factor` x L (built afresh: RoPE scaling depends on the length)."""
    checkpoints = {run: latest_checkpoint(runs / run) for run in (*SCHEMES, *FINETUNED.values())}
    models = {scheme: with_config(checkpoints[scheme]) for scheme in SCHEMES if checkpoints[scheme]}
    for name, scaling in ROPE_SCALINGS.items():
        rope_factor = 1.0 if scaling == "dynamic-ntk" else float(factor)
        if checkpoints["rope"]:
            rope = with_config(checkpoints["rope"], rope_scaling=scaling, rope_factor=rope_factor)
            models[f"rope + {name}, zero-shot"] = rope
    for name, run in FINETUNED.items():
        if checkpoints[run]:
            models[f"rope + {name}, fine-tuned at 4L"] = with_config(checkpoints[run])
    return models


def evaluate(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    tokenizer = Tokenizer.from_file(args.runs / "data" / "tokenizer.json")
    stream = [t for ids in tokenizer.encode_batch(bible_text("test"), add_bos=False) for t in ids]
    start, L = max(args.factors) * args.length, args.length
    print(f"test stream: {len(stream)} tokens; scoring tokens {start}..{start + args.count}", file=sys.stderr)
    ppl: dict[str, dict[int, float | str]] = {}
    passkey: dict[str, dict[int, tuple[float, float]]] = {}
    errors: dict[str, str] = {}
    began = time.perf_counter()
    for factor in args.factors:
        n = factor * L
        for name, model in rows(args.runs, factor).items():
            t0 = time.perf_counter()
            try:
                if not args.perplexity:
                    raise SkipPerplexity
                total, scored = sliding_window_nll(
                    model, stream, window=n, stride=max(1, n // 8), bos_id=tokenizer.bos_id, start=start,
                    count=args.count, batch_size=max(1, 1024 // n),
                )  # fmt: skip
                ppl.setdefault(name, {})[factor] = float(torch.tensor(total / scored).exp())
            except RequestError as error:  # learned positions past max_seq_len
                ppl.setdefault(name, {})[factor] = "error"
                errors[name] = str(error)
            except SkipPerplexity:
                ppl.setdefault(name, {})[factor] = "not run"
            if args.passkey and (name in SCHEMES or "fine-tuned" in name):
                passkey.setdefault(name, {})[factor] = passkey_accuracy(model, tokenizer, n, seed=factor)
            print(f"{name} at {n}: {ppl[name][factor]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    seconds = time.perf_counter() - began
    report(args, ppl, passkey, errors, seconds)


def passkey_accuracy(model: TransformerModel, tokenizer: Tokenizer, n_tokens: int, seed: int) -> tuple[float, ...]:
    """(greedy exact match, digit accuracy, accuracy of the likeliest of the ten digits) over depths x trials;
    nan when the model refuses the length."""
    rng = random.Random(seed)
    exact = digits = among = total = 0
    try:
        for depth in PASSKEY_DEPTHS:
            for _ in range(PASSKEY_TRIALS):
                example = passkey_example(tokenizer, n_tokens, depth, rng)
                greedy, correct, correct_among = passkey_scores(model, example)
                exact, digits, among = exact + greedy, digits + correct, among + correct_among
                total += sum(example.digits)
    except RequestError:
        return (float("nan"),) * 3
    return (exact / (len(PASSKEY_DEPTHS) * PASSKEY_TRIALS), digits / total, among / total)


def report(args: argparse.Namespace, ppl: dict, passkey: dict, errors: dict, seconds: float) -> None:
    L = args.length
    header = "| | " + " | ".join(f"{f} x L ({f * L})" for f in args.factors) + " |"
    rule = "|---|" + "---:|" * len(args.factors)
    print(f"# Length extrapolation, {datetime.date.today()}\n")
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {machine_info()}")
    print(load_report("after"))
    print(f"evaluation time: {seconds:.0f} s\n")
    if args.perplexity:
        print("Held-out perplexity (test books, sliding window, stride N/8)\n")
        print(header + "\n" + rule)
        for name, values in ppl.items():
            cells = [v if isinstance(v, str) else f"{v:.2f}" for v in (values[f] for f in args.factors)]
            print(f"| {name} | " + " | ".join(cells) + " |")
    for name, message in errors.items():
        print(f"\n{name}: error = RequestError: {message}")
    if passkey:
        depths = ", ".join(map(str, PASSKEY_DEPTHS))
        print(f"\nPasskey: greedy exact match / digit accuracy / likeliest-of-ten-digits accuracy ({PASSKEY_TRIALS} "
              f"trials x depths {depths}; chance: 1e-5 / at most 0.10 / 0.10)\n")  # fmt: skip
        print(header + "\n" + rule)
        for name, values in passkey.items():
            cells = [
                "error" if v[0] != v[0] else " / ".join(f"{x:.2f}" for x in v)
                for v in (values[f] for f in args.factors)
            ]
            print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"length": L, "factors": args.factors, "ppl": ppl, "passkey": passkey, "errors": errors}, indent=1
            )
        )
    if args.plot and args.perplexity:
        plot(ppl, L, args.factors, args.plot)


def plot(ppl: dict, length: int, factors: list[int], out: Path) -> None:
    from tformer.viz.plots import plot_extrapolation

    curves = {
        name: {f * length: v for f, v in values.items() if not isinstance(v, str)} for name, values in ppl.items()
    }
    print(f"\nplot: {plot_extrapolation(curves, length, out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "evaluate"))
    parser.add_argument("--runs", type=Path, default=Path("runs/extrapolation"))
    parser.add_argument("--length", type=int, default=128, help="L, the training length in positions")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--finetune-factor", type=int, default=4)
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--count", type=int, default=4096, help="test tokens scored at every length")
    parser.add_argument("--perplexity", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--passkey", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=1, help="1 is faster than 2 on the shared 2-core machine")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    prepare(args) if args.command == "prepare" else evaluate(args)


if __name__ == "__main__":
    main()
