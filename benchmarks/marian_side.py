"""The shared ground of benchmarks/translation_vs_marian.py and benchmarks/main_job_step.py: the shape and
training settings of configs/en-de-10min.yaml, the EN-DE data and the batches both models train on (build_data,
BatchStream), the two models (build_tformer, build_marian) and their forward calls (tformer_logits, marian_logits),
and Side, one model's training step as tformer's trainer takes it, with the times and losses it records."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

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
from tformer.training.losses import label_smoothed_cross_entropy
from tformer.training.optim import paper_adam
from tformer.training.seeds import seed_dropout

# configs/en-de-10min.yaml
D_MODEL, N_HEADS, D_FF, N_LAYERS, MAX_POSITIONS = 256, 4, 1024, 3, 256
DROPOUT, ATTN_DROPOUT, LABEL_SMOOTHING = 0.1, 0.0, 0.1
VOCAB_SIZE, MAX_LEN, MAX_TOKENS = 4000, 100, 2048
LR_SCALE, WARMUP = 0.5, 200


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


def mean_loss(side: Side, window: slice) -> float:
    tokens, losses = side.tokens[window], side.losses[window]
    return sum(t * x for t, x in zip(tokens, losses, strict=True)) / sum(tokens)
