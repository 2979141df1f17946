"""`tformer qa`: extractive question answering with an encoder whose head is `question-answering`."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tformer.errors import ConfigError, RequestError

if TYPE_CHECKING:  # torch and the models load when a command runs, not when the CLI starts
    from tformer.data.tokenizer import Tokenizer
    from tformer.models import TransformerModel
    from tformer.models.heads import Span


@dataclass(frozen=True)
class Answer:
    """The answer's text, its characters start..end in the context, and its span of tokens with their score."""

    text: str
    start: int
    end: int
    span: Span


def answer_question(
    model: TransformerModel, tokenizer: Tokenizer, question: str, context: str, max_answer_len: int = 15
) -> Answer:
    """The best span of `context` answering `question`: the pair is encoded as the tokenizer's post-processor
    builds it ([CLS] question [SEP] context [SEP] for BERT, with token types), and the span is chosen among the
    context's tokens (`best_span`)."""
    import torch

    from tformer.models.heads import best_span

    if model.config.encoder_head != "question-answering":
        raise ConfigError(
            f"this model's encoder_head is '{model.config.encoder_head}', not 'question-answering': it gives no "
            "answer spans; use a *ForQuestionAnswering checkpoint"
        )
    encoding = tokenizer.backend.encode(question, context, add_special_tokens=True)
    if len(encoding.ids) > model.config.max_seq_len:
        raise RequestError(
            f"question and context take {len(encoding.ids)} tokens, more than this model's {model.config.max_seq_len}; "
            "shorten the context to the passage that holds the answer"
        )
    device = next(model.parameters()).device
    ids = torch.tensor([encoding.ids], device=device)
    types = torch.tensor([encoding.type_ids], device=device) if model.config.type_vocab_size > 1 else None
    with torch.no_grad():
        logits = model(ids, torch.ones_like(ids), types)[0].float()  # (T, 2)
    allowed = torch.tensor([sequence == 1 for sequence in encoding.sequence_ids], device=device)
    span = best_span(logits[:, 0], logits[:, 1], allowed, max_answer_len)
    start, end = encoding.offsets[span.start][0], encoding.offsets[span.end][1]
    return Answer(context[start:end], start, end, span)


def qa(*, model: str, question: str, context: str, max_answer_len: int = 15, device: str = "cpu") -> None:
    """Print the answer to a question found in a context, with its score, as one JSON line.

    model: a Hugging Face *ForQuestionAnswering directory (BERT, RoBERTa) or a tformer checkpoint with
      encoder_head question-answering, with its tokenizer.json
    question: the question
    context: the text that holds the answer
    max_answer_len: the longest answer, in tokens
    device: where the model runs: cpu, cuda, cuda:N, mps, ... (docs/devices.md)
    """
    from tformer.checkpoints import load_pretrained
    from tformer.kernels.dispatch import resolve_device

    where = resolve_device(device)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weights a QA head does not use (a pooler) are dropped
        net, tokenizer = load_pretrained(model)
    net.to(where)
    if tokenizer is None:
        raise ConfigError(f"{model} has no tokenizer.json; tformer qa needs it to split the question and context")
    found = answer_question(net, tokenizer, question, context, max_answer_len)
    print(
        json.dumps({"answer": found.text, "score": round(found.span.score, 6), "start": found.start, "end": found.end})
    )
