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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import sacrebleu
import torch
from common import busy_processes, load_report, machine_info, median, set_threads, wait_for_idle
from torch import nn
from train_step import Report, n_params, source_state  # the report writer and checkout state of train_step

from tformer import ModelConfig, build_model
from tformer.data import (
    Seq2SeqBatch,
    TokenBatchSampler,
    Tokenizer,
    bible_pairs,
    collate_seq2seq,
    encode_pairs,
    seq2seq_lengths,
)
from tformer.inference import translate_ids
from tformer.training.losses import label_smoothed_cross_entropy
from tformer.training.optim import paper_adam
from tformer.training.seeds import seed_dropout

# configs/en-de-10min.yaml
D_MODEL, N_HEADS, D_FF, N_LAYERS, MAX_POSITIONS = 256, 4, 1024, 3, 256
DROPOUT, ATTN_DROPOUT, LABEL_SMOOTHING = 0.1, 0.0, 0.1
VOCAB_SIZE, MAX_LEN, MAX_TOKENS = 4000, 100, 2048
LR_SCALE, WARMUP = 0.5, 200
TFORMER_INITS = {"xavier": "xavier (embeddings N(0, d^-0.5))", "normal": "normal (N(0, 0.02))"}
EXTRA_LEN, DECODE_BATCH = 50, 32  # translate_ids' defaults: at most len(source) + 50 tokens, 32 sentences a batch


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


# ---- data -----------------------------------------------------------------------------------------------
@dataclass
class Data:
    tokenizer: Tokenizer
    examples: list[tuple[list[int], list[int]]]
    sampler: TokenBatchSampler
    n_train_pairs: int
    test: list[tuple[str, str]]


def build_data(seed: int, test_sentences: int) -> Data:
    """As tformer.training.corpus.prepare_data does for configs/en-de-10min.yaml, without a run directory."""
    pairs = bible_pairs("en-de", "train")
    tokenizer = Tokenizer.train([t for pair in pairs for t in pair], VOCAB_SIZE)
    examples = [ex for ex in encode_pairs(tokenizer, pairs) if max(len(ex[0]), len(ex[1])) <= MAX_LEN]
    sampler = TokenBatchSampler(seq2seq_lengths(examples), MAX_TOKENS, seed=seed)
    test = bible_pairs("en-de", "test")
    return Data(tokenizer, examples, sampler, len(pairs), test[:test_sentences] if test_sentences else test)


@dataclass
class Batch:
    data: Seq2SeqBatch
    labels: torch.Tensor
    tokens: int  # target tokens that take a loss


class BatchStream:
    """The sampler's batches, collated once and shared: both sides' step k trains on batch k."""

    def __init__(self, data: Data) -> None:
        self.examples, self.stream, self.cache = data.examples, data.sampler.iterate(), []

    def __getitem__(self, k: int) -> Batch:
        while len(self.cache) <= k:
            indices, _ = next(self.stream)
            b = collate_seq2seq([self.examples[i] for i in indices])
            self.cache.append(Batch(b, b.labels, b.num_tokens))
        return self.cache[k]


# ---- models ---------------------------------------------------------------------------------------------
def tformer_config(vocab_size: int, init: str = "xavier") -> ModelConfig:
    """The shape of configs/en-de-10min.yaml as it was when this benchmark was written (post-norm, dropout 0.1)."""
    return ModelConfig.from_preset(
        "transformer-base",
        d_model=D_MODEL,
        n_heads=N_HEADS,
        d_ff=D_FF,
        n_encoder_layers=N_LAYERS,
        n_decoder_layers=N_LAYERS,
        max_seq_len=MAX_POSITIONS,
        vocab_size=vocab_size,
        dropout=DROPOUT,
        attn_dropout=ATTN_DROPOUT,
        init=init,
    )


def build_tformer(vocab_size: int, init: str = "xavier") -> nn.Module:
    return build_model(tformer_config(vocab_size, init))


def build_marian(tokenizer: Tokenizer, shape: ModelConfig | None = None, attention: str = "sdpa") -> nn.Module:
    """HF's MarianMTModel with tformer's `shape` (default: `tformer_config`'s): layers, widths, heads, positions,
    dropout; ReLU, scaled, shared and tied embeddings; post-norm, Marian's only placement."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    shape = shape or tformer_config(tokenizer.vocab_size)
    config = MarianConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=shape.d_model,
        encoder_layers=shape.n_encoder_layers,
        decoder_layers=shape.n_decoder_layers,
        encoder_attention_heads=shape.n_heads,
        decoder_attention_heads=shape.n_heads,
        encoder_ffn_dim=shape.d_ff,
        decoder_ffn_dim=shape.d_ff,
        max_position_embeddings=shape.max_seq_len,
        activation_function="relu",
        dropout=shape.dropout,
        attention_dropout=shape.attn_dropout,
        activation_dropout=0.0,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_id,
        eos_token_id=tokenizer.eos_id,
        decoder_start_token_id=tokenizer.bos_id,
        forced_eos_token_id=None,  # Marian's default (0) would force <pad> at the length limit
    )
    model = MarianMTModel._from_config(config, attn_implementation=attention)
    assert model.config._attn_implementation == attention, model.config._attn_implementation
    shared = model.model.shared.weight
    assert model.lm_head.weight is shared and model.model.decoder.embed_tokens.weight is shared, "not tied"
    model.generation_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        decoder_start_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    return model


def tformer_logits(model: nn.Module) -> Callable[[Seq2SeqBatch], torch.Tensor]:
    return lambda b: model(b.src, b.tgt_in, b.src_mask, b.tgt_mask)  # as Trainer's forward_logits


def marian_logits(model: nn.Module) -> Callable[[Seq2SeqBatch], torch.Tensor]:
    return lambda b: (
        model(
            input_ids=b.src,
            attention_mask=b.src_mask,
            decoder_input_ids=b.tgt_in,
            decoder_attention_mask=b.tgt_mask,
            use_cache=False,
        ).logits
    )


# ---- training -------------------------------------------------------------------------------------------
@dataclass
class Side:
    name: str
    model: nn.Module
    logits: Callable[[Seq2SeqBatch], torch.Tensor]
    optimizer: torch.optim.Optimizer = field(init=False)
    scheduler: torch.optim.lr_scheduler.LRScheduler = field(init=False)
    bf16: bool = False  # forward and loss under torch.autocast(bfloat16)
    seed: int = 1  # dropout of step k: seed_dropout(seed, k), as tformer's trainer draws it
    times: list[float] = field(default_factory=list)  # wall seconds of each step
    cpu: list[float] = field(default_factory=list)  # this process's CPU seconds of each step
    tokens: list[int] = field(default_factory=list)  # target tokens of each step
    losses: list[float] = field(default_factory=list)  # label-smoothed loss per target token of each step
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # BPE tokens of the hypotheses, </s> not counted
    hypotheses: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.optimizer, self.scheduler = paper_adam(self.model, D_MODEL, WARMUP, scale=LR_SCALE)

    @property
    def elapsed(self) -> float:
        return sum(self.times)

    def step(self, batch: Batch) -> None:
        """One optimizer step on `batch`: the same code for both models."""
        self.model.train()
        seed_dropout(self.seed, len(self.times))
        cpu, start = time.process_time(), time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=self.bf16):
            loss_sum, n_tokens = label_smoothed_cross_entropy(self.logits(batch.data), batch.labels, LABEL_SMOOTHING)
        (loss_sum / n_tokens).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_sum.item() / batch.tokens
        self.times.append(time.perf_counter() - start)
        self.cpu.append(time.process_time() - cpu)
        self.tokens.append(batch.tokens)
        self.losses.append(loss)


class Pauser:
    """Waits (outside every timed step) while other processes use a CPU, up to `allowance` seconds in all.

    On 2 cores, a competitor that takes one core stalls each of torch's parallel regions, and steps get up to
    10x slower; pausing keeps such stretches out of the numbers instead of hoping they hit both sides alike.
    """

    def __init__(self, allowance: float) -> None:
        self.allowance, self.left, self.paused, self.count, self.seen = allowance, allowance, 0.0, 0, set()

    def __call__(self) -> None:
        if self.left <= 0:
            return
        busy = busy_processes(0.3, 0.5)
        if busy == "none":
            return
        self.seen.add(busy.split(" (pid")[0])
        waited, _ = wait_for_idle(self.left)
        self.left -= waited
        self.paused += waited
        self.count += 1

    def summary(self) -> str:
        return f"paused {self.count} times, {self.paused:.0f}s in all, for: {', '.join(sorted(self.seen)) or '-'}" + (
            "; pause allowance used up" if self.left <= 0 < self.allowance else ""
        )


def train(sides: Sequence[Side], batches: BatchStream, budget: float, log_every: int, pause: Pauser) -> int:
    """Alternates the sides step by step on the same batches until each has spent `budget` seconds.

    Returns the number of rounds in which every side stepped (the paired steps).
    """
    paired, r = 0, 0
    while True:
        active = [s for s in sides if s.elapsed < budget]
        if not active:
            return paired
        if r % 10 == 0:
            pause()
        batch = batches[r]
        for side in active if r % 2 == 0 else active[::-1]:
            side.step(batch)
        paired += len(active) == len(sides)
        r += 1
        if r % log_every == 0:
            window = slice(-log_every, None)
            progress = (
                f"{s.name} {len(s.times)} steps {s.elapsed:.0f}s loss {mean_loss(s, window):.3f}" for s in sides
            )
            print(f"  round {r}: " + "; ".join(progress), flush=True)


# ---- decoding -------------------------------------------------------------------------------------------
@torch.no_grad()
def marian_translate_ids(model: nn.Module, sources: Sequence[Sequence[int]], tokenizer: Tokenizer) -> list[list[int]]:
    """Greedy decoding of one batch with generate(), with translate_ids' source format and length limit."""
    model.eval()
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    rows = [[*s, eos] for s in sources]
    width = max(len(r) for r in rows)
    src = torch.full((len(rows), width), pad, dtype=torch.long)
    for j, row in enumerate(rows):
        src[j, : len(row)] = torch.tensor(row)
    max_len = min(width + EXTRA_LEN, MAX_POSITIONS)
    out = model.generate(
        input_ids=src, attention_mask=(src != pad).long(), max_new_tokens=max_len, do_sample=False, num_beams=1
    )
    ids = out[:, 1:].tolist()  # without the decoder start token <s>
    return [row[: row.index(eos)] if eos in row else row for row in ids]


def tformer_translate_ids(model: nn.Module, sources: Sequence[Sequence[int]], tokenizer: Tokenizer) -> list[list[int]]:
    return translate_ids(
        model,
        sources,
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.pad_id,
        beam_size=1,
        batch_size=DECODE_BATCH,
        extra_len=EXTRA_LEN,
    )


def decode(
    sides: Sequence[Side],
    translators: dict[str, Callable],
    tokenizer: Tokenizer,
    sources: list[str],
    pause: Callable[[], None],
) -> None:
    """Greedy translations of `sources` by every side, batch by batch (sorted by length), in alternation."""
    encoded = tokenizer.encode_batch(sources)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    outputs: dict[str, list[list[int]]] = {s.name: [[] for _ in encoded] for s in sides}
    for k, start in enumerate(range(0, len(order), DECODE_BATCH)):
        chunk = order[start : start + DECODE_BATCH]
        pause()
        for side in sides if k % 2 == 0 else sides[::-1]:
            began = time.perf_counter()
            ids = translators[side.name](side.model, [encoded[i] for i in chunk], tokenizer)
            side.decode_seconds += time.perf_counter() - began
            side.decode_tokens += sum(len(row) for row in ids)
            for i, row in zip(chunk, ids, strict=True):
                outputs[side.name][i] = row
    for side in sides:
        side.hypotheses = tokenizer.decode_batch(outputs[side.name])


# ---- report ---------------------------------------------------------------------------------------------
def spread(values: list[float]) -> str:
    return f"median {median(values):.3f} [min {min(values):.3f}, max {max(values):.3f}]"


def mean_loss(side: Side, window: slice) -> float:
    tokens, losses = side.tokens[window], side.losses[window]
    return sum(t * x for t, x in zip(tokens, losses, strict=True)) / sum(tokens)


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
