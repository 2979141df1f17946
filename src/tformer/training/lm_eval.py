"""Held-out scores of language models, for `tformer eval`: a decoder's perplexity (causal LM) and an encoder's
masked-token accuracy and MLM loss.

Perplexity is exp(mean negative log-likelihood per target token). By default every line (a verse of the embedded
corpus) is scored on its own, as the trainer's dev perplexity is: input ``<s> x``, targets ``x </s>``. With a
`block_size` the lines are packed into one stream and scored in blocks of that many tokens (data/packing.py), so
that a model trained on packed blocks is also scored with the context of the lines before. The MLM scores mask
the held-out lines as training does (15%; 80/10/10) with a fixed seed, so two checkpoints see the same masks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tformer.checkpoints import resolve_checkpoint
from tformer.config import ConfigError, ModelConfig
from tformer.data import Tokenizer, Vocab, bible_text, causal_lm, masked_lm, read_text
from tformer.data.packing import pack_sequences, packed_causal_lm
from tformer.models import CONFIG_FILE, TransformerModel, load
from tformer.training.evaluate import forward_logits
from tformer.training.init_from import vocab_of

LM_OBJECTIVES = {"decoder": "clm", "encoder": "mlm"}  # the family of a checkpoint -> the score it gets


@dataclass
class LMScore:
    """A language model's score on held-out text: mean NLL per target token, and for MLM the masked accuracy."""

    objective: str  # "clm" or "mlm"
    lines: int  # lines scored
    skipped: int  # lines longer than the model's context, not scored (none when packed)
    tokens: int  # target tokens scored (MLM: masked tokens)
    loss: float  # mean negative log-likelihood per target token, in nats
    accuracy: float | None = None  # MLM: share of masked tokens whose argmax is the original token
    block_size: int = 0  # clm: packed blocks of this many tokens; 0: each line on its own
    seconds: float = 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def summary(self) -> str:
        """One line for the command line."""
        scope = f"{self.lines} lines" + (f" ({self.skipped} longer lines skipped)" if self.skipped else "")
        if self.objective == "mlm":
            return (
                f"masked-token accuracy {self.accuracy:.4f}, MLM loss {self.loss:.4f} (perplexity "
                f"{self.perplexity:.2f}) on {self.tokens} masked tokens of {scope}, in {self.seconds:.0f} s"
            )
        packing = f", packed in blocks of {self.block_size}" if self.block_size else ", each line on its own"
        return f"perplexity {self.perplexity:.2f} on {self.tokens} tokens of {scope}{packing}, in {self.seconds:.0f} s"


def _by_length(seqs: Sequence[Sequence[int]], batch_size: int) -> list[list[Sequence[int]]]:
    ordered = sorted(seqs, key=len)  # little padding per batch
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


@torch.no_grad()
def _nll_and_hits(model: TransformerModel, batches: Sequence) -> tuple[float, int, int]:
    """Summed NLL, argmax hits and target count over LM batches with -100 on ignored labels."""
    model.eval()
    total, hits, count = 0.0, 0, 0
    for batch in batches:
        logits = forward_logits(model, batch).float()
        labels = batch.labels
        kept = labels != -100
        total += torch.nn.functional.cross_entropy(logits[kept], labels[kept], reduction="sum").item()
        hits += int((logits[kept].argmax(-1) == labels[kept]).sum())
        count += int(kept.sum())
    return total, hits, count


def score_lm(
    model: TransformerModel,
    seqs: Sequence[Sequence[int]],
    vocab: Vocab,
    block_size: int = 0,
    batch_size: int = 32,
    seed: int = 0,
) -> LMScore:
    """Scores token id lines (without <s> and </s>) with a decoder (perplexity) or an MLM encoder (accuracy)."""
    objective = LM_OBJECTIVES.get(model.config.family)
    if objective is None or (objective == "mlm" and model.config.encoder_head != "mlm"):
        raise ConfigError(
            f"a '{model.config.family}' model has no LM score; pass a decoder or an encoder with the MLM head"
        )
    if block_size and objective != "clm":
        raise ConfigError("block_size packs lines for a decoder's perplexity; an MLM encoder scores each line")
    start = time.perf_counter()
    if block_size:
        if block_size > model.config.max_seq_len:
            raise ConfigError(f"block_size {block_size} exceeds the model's max_seq_len {model.config.max_seq_len}")
        kept = [s for s in seqs if s]
        blocks = pack_sequences(kept, block_size, vocab.bos_id, vocab.eos_id)
        batches = [packed_causal_lm(chunk, vocab) for chunk in _by_length(blocks, batch_size)]
    else:
        room = 1 if objective == "clm" else 2  # <s> (clm) or <s> and </s> (mlm) take a position each
        kept = [s for s in seqs if 0 < len(s) <= model.config.max_seq_len - room]
        if objective == "clm":
            batches = [causal_lm(chunk, vocab) for chunk in _by_length(kept, batch_size)]
        else:
            generator = torch.Generator().manual_seed(seed)
            batches = [masked_lm(chunk, vocab, generator) for chunk in _by_length(kept, batch_size)]
    device = next(model.parameters()).device
    total, hits, count = _nll_and_hits(model, [b.to(device) for b in batches])
    return LMScore(
        objective,
        lines=len(kept),
        skipped=len(seqs) - len(kept),
        tokens=count,
        loss=total / max(count, 1),
        accuracy=hits / max(count, 1) if objective == "mlm" else None,
        block_size=block_size,
        seconds=time.perf_counter() - start,
    )


def is_language_model(path: str | Path) -> bool:
    """Whether a checkpoint (or a run directory's best checkpoint) holds a decoder or an MLM encoder."""
    config = ModelConfig.from_file(resolve_checkpoint(path) / CONFIG_FILE)
    return config.family in LM_OBJECTIVES


def evaluate_lm_checkpoint(
    path: str | Path,
    data: str = "bible:en",
    split: str = "test",
    limit: int = 0,
    block_size: int = 0,
    device: str | torch.device = "cpu",
) -> LMScore:
    """Scores a checkpoint on the embedded corpus's English `split` (any `bible:` name) or on a text file, on
    `device`."""
    checkpoint = resolve_checkpoint(path)
    model, tokenizer = load(checkpoint, device), Tokenizer.from_file(checkpoint)
    lines = bible_text(split) if data.startswith("bible:") else read_text(data)
    lines = lines[:limit] if limit else lines
    seqs = tokenizer.encode_batch(lines, add_bos=False)
    return score_lm(model, seqs, vocab_of(tokenizer), block_size=block_size)
