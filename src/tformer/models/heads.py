"""Task heads an encoder (BERT) puts on its hidden states for fine-tuning: one label per sequence or per token, or
an answer span.

They follow transformers' `BertForSequenceClassification`, `BertForTokenClassification` and
`BertForQuestionAnswering` layer for layer, so their weights map one to one (tformer.interop.hf_encoders):

    sequence-classification   h[:, 0] -> dense -> tanh -> dropout -> classifier    (B, T, d) -> (B, num_labels)
    token-classification      h -> dropout -> classifier                            (B, T, d) -> (B, T, num_labels)
    question-answering        h -> span                                             (B, T, d) -> (B, T, 2)

The first is BERT's pooler (dense and tanh on the first token, [CLS]) followed by a linear classifier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.errors import RequestError


class SequenceClassificationHead(nn.Module):
    """Logits for the whole sequence from its first token's hidden state, through BERT's pooler."""

    def __init__(self, config: ModelConfig, tokens: nn.Embedding | None = None) -> None:
        super().__init__()
        self.pooler = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pooled = torch.tanh(self.pooler(hidden[:, 0]))  # (B, d): the first token ([CLS]) stands for the sequence
        return self.classifier(self.dropout(pooled))  # (B, num_labels)


class TokenClassificationHead(nn.Module):
    """Logits for every token (named entities, parts of speech) from its own hidden state."""

    def __init__(self, config: ModelConfig, tokens: nn.Embedding | None = None) -> None:
        super().__init__()
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(hidden))  # (B, T, num_labels)


class QuestionAnsweringHead(nn.Module):
    """Extractive QA (SQuAD): at every token, the logits of the answer starting there and of it ending there.

    One linear layer on the last hidden states, as `BertForQuestionAnswering`'s qa_outputs; `best_span` picks
    the answer from the two rows.
    """

    def __init__(self, config: ModelConfig, tokens: nn.Embedding | None = None) -> None:
        super().__init__()
        self.span = nn.Linear(config.d_model, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.span(hidden)  # (B, T, 2): [..., 0] start logits, [..., 1] end logits


@dataclass(frozen=True)
class Span:
    """An answer span: token indices `start` .. `end` (both included) and its score, start logit + end logit."""

    start: int
    end: int
    score: float


def best_span(
    start_logits: torch.Tensor, end_logits: torch.Tensor, allowed: torch.Tensor, max_answer_len: int = 15
) -> Span:
    """The span with the highest start_logit + end_logit among those with start <= end, end - start <
    max_answer_len and both ends on `allowed` tokens (the context's, not the question's or special tokens), as
    transformers' question-answering pipeline picks it (its product of softmax probabilities orders spans as this
    sum does). start_logits, end_logits and allowed are (T,); ties go to the earliest start, then end."""
    if max_answer_len < 1:
        raise RequestError(f"max_answer_len must be at least 1 token, got {max_answer_len}")
    if not bool(allowed.any()):
        raise RequestError("no token may hold the answer: the context is empty; give a non-empty context")
    n = start_logits.shape[0]
    index = torch.arange(n, device=start_logits.device)
    length = index[None, :] - index[:, None]  # (T, T): end - start
    valid = (length >= 0) & (length < max_answer_len) & allowed[:, None] & allowed[None, :]
    scores = (start_logits.float()[:, None] + end_logits.float()[None, :]).masked_fill(~valid, float("-inf"))
    best = int(scores.flatten().argmax())  # the first maximum in row-major order: earliest start, then end
    start, end = divmod(best, n)
    return Span(start, end, float(scores[start, end]))


# encoder_head name -> task head; the encoder keeps these under `task_head`, apart from the MLM head
TASK_HEADS: dict[str, type[nn.Module]] = {
    "sequence-classification": SequenceClassificationHead,
    "token-classification": TokenClassificationHead,
    "question-answering": QuestionAnsweringHead,
}
