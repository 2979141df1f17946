"""Evaluation during and after training: sacreBLEU for translation, perplexity for language models, accuracy and
macro-F1 for classifiers."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import sacrebleu
import torch

from tformer.data import LMBatch, Seq2SeqBatch, Tokenizer, Vocab, causal_lm
from tformer.data.genre import encode_labelled
from tformer.data.objectives import sequence_classification
from tformer.models import EncoderDecoder, TransformerModel


@dataclass
class TranslationResult:
    """Corpus BLEU (sacreBLEU, 13a tokenization, on detokenized text) with the sentences behind it."""

    bleu: float
    signature: str
    sources: list[str]
    hypotheses: list[str]
    references: list[str]
    seconds: float = 0.0  # wall time of the decoding

    def bleu_of_first(self, n: int) -> float:
        """Corpus BLEU of the first `n` sentences alone (all of them when n is 0 or at least their number)."""
        if not n or n >= len(self.hypotheses):
            return self.bleu
        return sacrebleu.metrics.BLEU().corpus_score(self.hypotheses[:n], [self.references[:n]]).score

    def samples(self, n: int) -> list[dict[str, str]]:
        return [
            {"source": s, "hypothesis": h, "reference": r}
            for s, h, r in zip(self.sources[:n], self.hypotheses[:n], self.references[:n], strict=True)
        ]


def evaluate_translation(
    model: EncoderDecoder,
    tokenizer: Tokenizer,
    pairs: Sequence[tuple[str, str]],
    beam_size: int = 4,
    alpha: float = 0.6,
    patience: float | None = None,
    workers: int | None = None,
) -> TranslationResult:
    """Translates the sources of `pairs` (`workers` batches at once, `Translator.translate_batch`) and scores them
    against the references with sacreBLEU."""
    sources = [s for s, _ in pairs]
    references = [r for _, r in pairs]
    start = time.perf_counter()
    # imported on use: a training run that never translates does not load the decoding package
    from tformer.decoding.translator import Translator

    hypotheses = Translator(model, tokenizer).translate_batch(
        sources, beam_size, alpha, patience=patience, workers=workers
    )
    seconds = time.perf_counter() - start
    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(hypotheses, [references])
    return TranslationResult(score.score, str(bleu.get_signature()), sources, hypotheses, references, seconds)


def forward_logits(model: TransformerModel, batch: Seq2SeqBatch | LMBatch) -> torch.Tensor:
    """Logits aligned with `batch.labels`, for either kind of batch (a prefix LM's with its bidirectional prefix)."""
    if isinstance(batch, Seq2SeqBatch):
        return model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    if batch.prefix_len is not None:
        return model(batch.input_ids, batch.attention_mask, prefix_lengths=batch.prefix_len)
    return model(batch.input_ids, batch.attention_mask)


@torch.no_grad()
def perplexity(model: TransformerModel, batches: Sequence) -> float:
    """exp(mean negative log-likelihood per target token) over LM batches with -100 on ignored labels."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        logits = forward_logits(model, batch).float()
        loss = torch.nn.functional.cross_entropy(
            logits.view(-1, logits.shape[-1]), batch.labels.view(-1), ignore_index=-100, reduction="sum"
        )
        total, count = total + loss.item(), count + int((batch.labels != -100).sum())
    return math.exp(total / max(count, 1))


def classification_scores(predicted: torch.Tensor, labels: torch.Tensor, num_labels: int) -> dict[str, float]:
    """Accuracy and macro-F1 (the unweighted mean over classes of 2 TP / (2 TP + FP + FN), as scikit-learn's
    f1_score(average='macro'); a class with no examples and no predictions counts 0) of class ids (N,)."""
    f1 = []
    for c in range(num_labels):
        tp = int(((predicted == c) & (labels == c)).sum())
        wrong = int(((predicted == c) != (labels == c)).sum())  # false positives and false negatives
        f1.append(2 * tp / (2 * tp + wrong) if tp + wrong else 0.0)
    return {"accuracy": (predicted == labels).float().mean().item(), "macro_f1": sum(f1) / num_labels}


@torch.no_grad()
def evaluate_classification(
    model: TransformerModel,
    tokenizer: Tokenizer,
    vocab: Vocab,
    examples: Sequence[tuple[str, int]],
    max_len: int,
    batch_size: int = 64,
) -> dict[str, float]:
    """Accuracy and macro-F1 of a sequence classifier on (text, class id) examples, cut to max_len tokens."""
    model.eval()
    device = next(model.parameters()).device
    encoded = [(ids[:max_len], label) for ids, label in encode_labelled(tokenizer, list(examples))]
    predicted = []
    for i in range(0, len(encoded), batch_size):
        batch = sequence_classification(encoded[i : i + batch_size], vocab).to(device)
        predicted.append(model(batch.input_ids, batch.attention_mask).argmax(-1).cpu())
    labels = torch.tensor([label for _, label in encoded])
    return {**classification_scores(torch.cat(predicted), labels, model.config.num_labels), "examples": len(encoded)}


def dev_scores(
    objective: str, model: TransformerModel, tokenizer: Tokenizer, vocab: Vocab, examples: list, max_len: int,
    device: torch.device,
) -> tuple[dict, str]:  # fmt: skip
    """The trainer's dev scores for objective 'clm' (perplexity) or 'classification' (accuracy, macro-F1), with
    the line it prints."""
    if objective == "clm":
        encoded = [ids for ids in tokenizer.encode_batch(examples, add_bos=False) if 0 < len(ids) <= max_len]
        batches = [causal_lm(encoded[i : i + 32], vocab).to(device) for i in range(0, len(encoded), 32)]
        ppl = perplexity(model, batches)
        return {"dev_ppl": ppl, "dev_sentences": len(encoded)}, f"dev perplexity {ppl:.2f} on {len(encoded)} lines"
    scores = evaluate_classification(model, tokenizer, vocab, examples, max_len)
    scores = {f"dev_{key}": value for key, value in scores.items()}
    return scores, f"dev accuracy {scores['dev_accuracy']:.4f} on {len(examples)} examples"
