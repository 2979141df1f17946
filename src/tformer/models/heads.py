"""Task heads an encoder (BERT) puts on its hidden states for fine-tuning: one label per sequence or per token.

Both follow transformers' `BertForSequenceClassification` and `BertForTokenClassification` layer for layer, so
their weights map one to one (tformer.interop.hf_encoders):

    sequence-classification   h[:, 0] -> dense -> tanh -> dropout -> classifier    (B, T, d) -> (B, num_labels)
    token-classification      h -> dropout -> classifier                            (B, T, d) -> (B, T, num_labels)

The first is BERT's pooler (dense and tanh on the first token, [CLS]) followed by a linear classifier.
"""

from __future__ import annotations

import torch
from torch import nn

from tformer.config import ModelConfig


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


# encoder_head name -> task head; the encoder keeps these under `task_head`, apart from the MLM head
TASK_HEADS: dict[str, type[nn.Module]] = {
    "sequence-classification": SequenceClassificationHead,
    "token-classification": TokenClassificationHead,
}
