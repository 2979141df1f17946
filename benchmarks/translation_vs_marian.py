"""EN-DE translation at an equal wall-clock budget: tformer against Hugging Face's MarianMTModel, on CPU.

One process, one data pipeline: the embedded EN-DE corpus, one joint byte-level BPE (tformer's Tokenizer, 4000
ids), examples of at most 100 tokens, one TokenBatchSampler (2048 tokens a batch). Both models have the shape
of configs/en-de-10min.yaml (d_model 256, 4 heads, d_ff 1024, 3 + 3 layers, post-norm, ReLU, sinusoidal
positions, scaled, shared and tied embeddings, dropout 0.1, attention dropout 0) and random weights, each with
its own library's initialisation; nothing is downloaded. Both train on the same batches in the same order, with
the same step code: forward, label-smoothed cross-entropy (tformer.training.losses, epsilon 0.1, computed
outside both models) / target tokens, backward, paper_adam (Adam 0.9/0.98/1e-9, noam schedule, scale 0.5,
warmup 200) step, scheduler step, zero_grad. Before step k each side seeds the dropout draws as tformer's
trainer does (seed_dropout(seed, k)), so tformer's side trains exactly as `tformer train` does with the same
recipe: drawing from one shared generator instead, the steps of one model shift the other's masks, and with
seed 1 that kept tformer on the unigram plateau past step 1,000 where `tformer train` leaves it by step 250.

The two steps alternate on the same batch (order swapped every other round) until each side has spent
--budget seconds in its own steps; the side that gets there first stops and the other trains on alone. Then
the first --test-sentences sentences of the test split are decoded greedily by both (tformer's
translate_ids(beam_size=1); Marian's generate(num_beams=1, do_sample=False)), batch by batch in alternation,
with at most len(source) + 50 tokens, and scored with sacreBLEU.

    .venv/bin/python benchmarks/translation_vs_marian.py                 # defaults: ~11 minutes on 2 quiet cores
    .venv/bin/python benchmarks/translation_vs_marian.py --budget 20 --test-sentences 32 --wait-idle 0

`--bf16 tformer` trains tformer's side under bf16 autocast (what `train.bf16: true` does in tformer's trainer)
against Marian's plain fp32 loop; `--bf16 both` puts both sides under it, the like-for-like comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import sacrebleu
import torch
from common import busy_processes, load_report, machine_info, median, set_threads, wait_for_idle
from marian_side import (
    ATTN_DROPOUT,
    D_FF,
    D_MODEL,
    DROPOUT,
    LABEL_SMOOTHING,
    LR_SCALE,
    MAX_LEN,
    MAX_POSITIONS,
    MAX_TOKENS,
    N_HEADS,
    N_LAYERS,
    WARMUP,
    BatchStream,
    Side,
    build_data,
    build_marian,
    build_tformer,
    marian_logits,
    mean_loss,
    tformer_logits,
)
from train_step import Report, n_params, source_state  # the report writer and checkout state of train_step
from translation_rounds import (
    DECODE_BATCH,
    EXTRA_LEN,
    Pauser,
    decode,
    marian_translate_ids,
    tformer_translate_ids,
    train,
)

TFORMER_INITS = {"xavier": "xavier (embeddings N(0, d^-0.5))", "normal": "normal (N(0, 0.02))"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=240.0, help="seconds of training step time per model (default 240)")
    p.add_argument(
        "--test-sentences",
        type=int,
        default=300,
        help="decode the first N sentences of the test split (default 300; 0: all 1794)",
    )
    p.add_argument(
        "--tformer-init",
        choices=["xavier", "normal"],
        default="xavier",
        help="tformer's ModelConfig.init: xavier (the recipe's, default) or normal (N(0, 0.02), as HF "
        "initialises Marian)",
    )
    p.add_argument(
        "--bf16",
        choices=["none", "tformer", "both"],
        default="none",
        help="which sides train under bf16 autocast (default: none, both in fp32)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: os.cpu_count())")
    p.add_argument("--seed", type=int, default=1, help="model init, dropout and batch order (default 1)")
    p.add_argument("--log-every", type=int, default=50, help="print a progress line every N rounds (default 50)")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="before training, wait up to this long for other busy processes to finish (default 600)",
    )
    p.add_argument(
        "--max-pause",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="pause while other processes are busy (checked every 10 training rounds and before each "
        "decoding batch), up to this many seconds in all (default 300; 0: never)",
    )
    p.add_argument("--output", type=Path, default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    if args.budget <= 0 or args.test_sentences < 0 or args.log_every < 1:
        p.error("need --budget > 0, --test-sentences >= 0, --log-every >= 1")
    return args


# ---- report ---------------------------------------------------------------------------------------------
def spread(values: list[float]) -> str:
    return f"median {median(values):.3f} [min {min(values):.3f}, max {max(values):.3f}]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    out = Report(args.output)
    out(
        "translation_vs_marian: tformer vs HF MarianMTModel (sdpa, random init, plain PyTorch loop), "
        "EN-DE, equal training time, CPU"
    )
    out(f"machine: {machine_info()}")
    import transformers

    out(f"transformers {transformers.__version__}, sacrebleu {sacrebleu.__version__}")
    out(f"command: {' '.join(sys.argv)}")
    out(f"tformer source: {source_state()}")
    out(load_report("before"))
    out(f"other busy processes before: {busy_processes()}")

    began = time.perf_counter()
    data = build_data(args.seed, args.test_sentences)
    tok = data.tokenizer
    out(
        f"data: {data.n_train_pairs} EN-DE train pairs, {len(data.examples)} with <= {MAX_LEN} tokens a side; "
        f"joint BPE vocabulary {tok.vocab_size} (tformer Tokenizer.train); TokenBatchSampler(max_tokens="
        f"{MAX_TOKENS}, seed={args.seed}), {len(data.sampler)} batches an epoch; test: first {len(data.test)} "
        f"sentences of the test split; prepared in {time.perf_counter() - began:.0f}s"
    )

    torch.manual_seed(args.seed)
    tf = build_tformer(tok.vocab_size, args.tformer_init)
    torch.manual_seed(args.seed)
    hf = build_marian(tok)
    sides = [
        Side("tformer", tf, tformer_logits(tf), bf16=args.bf16 != "none", seed=args.seed),
        Side("Marian", hf, marian_logits(hf), bf16=args.bf16 == "both", seed=args.seed),
    ]
    translators = {"tformer": tformer_translate_ids, "Marian": marian_translate_ids}
    out(
        f"params: tformer {n_params(tf):,}, Marian {n_params(hf):,} (unique: shared + tied embeddings; Marian's "
        f"frozen sinusoid tables {2 * MAX_POSITIONS * D_MODEL:,} included, plus a final_logits_bias buffer)"
    )
    out(
        f"model: d_model {D_MODEL}, {N_HEADS} heads, d_ff {D_FF}, {N_LAYERS}+{N_LAYERS} layers, post-norm, ReLU, "
        f"sinusoidal, scaled shared tied embeddings, dropout {DROPOUT}, attention dropout {ATTN_DROPOUT}; "
        f"init: tformer {TFORMER_INITS[args.tformer_init]}, Marian HF default (N(0, 0.02))"
    )
    out(
        f"step (same code both sides): forward on the shared batch, label_smoothed_cross_entropy(eps="
        f"{LABEL_SMOOTHING}) / target tokens, backward, paper_adam (Adam 0.9/0.98/1e-9, noam scale {LR_SCALE}, "
        f"warmup {WARMUP}) step + scheduler step, zero_grad(set_to_none=True), loss.item(); batch collation "
        f"is shared and not timed; dropout of step k seeded by seed_dropout({args.seed}, k) on both sides, as in "
        f"tformer's trainer; bf16 autocast over forward and loss: "
        f"{', '.join(s.name for s in sides if s.bf16) or 'neither side'}"
    )
    out(
        f"budget: {args.budget:g}s of step time per side, steps alternating on the same batch (order swapped "
        f"every other round); the side done first stops, the other goes on alone"
    )

    if args.wait_idle > 0:
        waited, busy = wait_for_idle(args.wait_idle)
        out(
            f"waited {waited:.0f}s for other processes to go quiet (--wait-idle {args.wait_idle:g}); still busy: {busy}"
        )
    out(load_report("before training"))
    batches = BatchStream(data)
    pause = Pauser(args.max_pause)
    began = time.perf_counter()
    paired = train(sides, batches, args.budget, args.log_every, pause)
    out(
        f"training took {time.perf_counter() - began:.0f}s of wall time; {paired} paired rounds; {pause.summary()} "
        f"(checked every 10 rounds, --max-pause {args.max_pause:g})"
    )
    out(load_report("after training"))
    out(f"other busy processes after training: {busy_processes()}")

    for s in sides:
        n = len(s.times)
        cpu_share = median([c / (w * threads) for c, w in zip(s.cpu, s.times, strict=True)])
        out(
            f"{s.name}: {n} steps, {sum(s.tokens):,} target tokens in {s.elapsed:.1f}s; step seconds "
            f"{spread(s.times)}; CPU share {cpu_share:.0%}; "
            f"train loss (label-smoothed, per token) first 20 steps {mean_loss(s, slice(0, 20)):.3f}, "
            f"last 20 {mean_loss(s, slice(n - 20, n)):.3f}, over the paired steps' last 20 "
            f"{mean_loss(s, slice(max(paired - 20, 0), paired)):.3f}"
        )
    ratios = [m / t for t, m in zip(sides[0].times[:paired], sides[1].times[:paired], strict=True)]
    out(f"paired steps (same batch, same round): Marian time / tformer time {spread(ratios)}")

    sources = [s for s, _ in data.test]
    references = [r for _, r in data.test]
    began = time.perf_counter()
    decode(sides, translators, tok, sources, pause)
    out(
        f"decoding took {time.perf_counter() - began:.0f}s ({pause.summary()}); greedy, at most len(source) + "
        f"{EXTRA_LEN} tokens, batches of {DECODE_BATCH} sorted by length, in alternation; tformer "
        f"translate_ids(beam_size=1), Marian generate(num_beams=1, do_sample=False, use_cache=True)"
    )
    bleu = {}
    for s in sides:
        metric = sacrebleu.metrics.BLEU()
        score = metric.corpus_score(s.hypotheses, [references])
        bleu[s.name] = score.score
        out(
            f"{s.name}: test BLEU {score.score:.2f} ({score}; {metric.get_signature()}); decoding "
            f"{s.decode_seconds:.1f}s, {s.decode_tokens:,} tokens, {s.decode_tokens / s.decode_seconds:.0f} tok/s"
        )
        out(f"  e.g. {sources[0]!r} -> {s.hypotheses[0]!r}")
    out(f"  reference: {references[0]!r}")
    out(load_report("after decoding"))

    out()
    overall = {s.name: sum(s.tokens) / s.elapsed for s in sides}
    step_rate = {s.name: median([t / w for t, w in zip(s.tokens, s.times, strict=True)]) for s in sides}
    header = (
        f"{'side':<8} {'steps':>5} {'trained tok':>11} {'step s':>6} {'tok/s (median step)':>19} "
        f"{'tok/s (overall)':>15} {'ratio':>6} {'test BLEU':>9} {'decode sent/s':>13}"
    )
    out(header)
    out("-" * len(header))
    for s in sides:
        ratio = overall[s.name] / overall["Marian"]
        out(
            f"{s.name:<8} {len(s.times):>5} {sum(s.tokens):>11,} {s.elapsed:>6.1f} {step_rate[s.name]:>19.0f} "
            f"{overall[s.name]:>15.0f} {ratio:>6.3f} {bleu[s.name]:>9.2f} "
            f"{len(sources) / s.decode_seconds:>13.1f}"
        )
    out(
        f"ratio = overall tok/s / Marian's; median-step tok/s ratio {step_rate['tformer'] / step_rate['Marian']:.3f}, "
        f"median paired step-time ratio {median(ratios):.3f}"
    )
    speed_ok = overall["tformer"] / overall["Marian"] >= 1.2
    bleu_ok = bleu["tformer"] >= bleu["Marian"]
    out(
        f"targets: tokens/s >= 1.2x Marian: {'met' if speed_ok else 'NOT met'} "
        f"({overall['tformer'] / overall['Marian']:.3f}x); test BLEU >= Marian's: {'met' if bleu_ok else 'NOT met'} "
        f"({bleu['tformer']:.2f} vs {bleu['Marian']:.2f}, greedy, {len(sources)} sentences)"
    )
    out(load_report("at end"))
    out("(the load average counts this benchmark's own threads too: about the thread count when nothing else runs)")
    out.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
