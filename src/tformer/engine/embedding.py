"""Text embeddings: one vector per input from a model's last hidden states, pooled as sentence-transformers and
vLLM pool them, for retrieval and similarity (OpenAI's /v1/embeddings, `tformer embed`).

An encoder (BERT family) reads each input both ways and its vectors are averaged over the real tokens ("mean", the
sentence-transformers default) or taken at the first ([CLS], "cls"); a decoder-only model's last real token has
seen the whole input ("last", vLLM's default for decoders); an encoder-decoder's encoder is pooled like an encoder.
The vectors are scaled to unit length unless `normalize` is off, so that a dot product is the cosine similarity.
A sentence-transformers directory (modules.json, 1_Pooling/config.json, sentence_bert_config.json) gives its own
pooling, normalization and longest input. `EmbeddingEngine` lets `tformer serve` serve an encoder, for embeddings
only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from tformer.errors import ConfigError, RequestError
from tformer.models import TransformerModel
from tformer.models.families import DecoderLM, EncoderDecoder, EncoderMLM
from tformer.models.stack import StackInputs

POOLINGS = ("mean", "cls", "last")
# sentence-transformers' pooling flags in 1_Pooling/config.json -> tformer's pooling
ST_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True)
class Pooling:
    """How token vectors become one: `mode` (mean, cls or last), `normalize` to unit length, and the longest input
    in tokens (0: the model's context)."""

    mode: str
    normalize: bool = True
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in POOLINGS:
            raise ConfigError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.mode!r}")

    @classmethod
    def default_for(cls, model: TransformerModel, directory: str | os.PathLike[str] | None = None) -> Pooling:
        """A sentence-transformers directory's own pooling, else the family's: mean for encoders, last for decoders
        (a path that is no such directory, a .gguf file say, gives the family's)."""
        found = _sentence_transformers_pooling(Path(directory)) if directory is not None else None
        return found or cls("last" if isinstance(model, DecoderLM) else "mean")


def _sentence_transformers_pooling(directory: Path) -> Pooling | None:
    modules, config = directory / "modules.json", directory / "1_Pooling" / "config.json"
    if not (modules.is_file() and config.is_file()):
        return None
    flags = json.loads(config.read_text())
    modes = [mode for flag, mode in ST_POOLING_FLAGS.items() if flags.get(flag)]
    if len(modes) != 1:
        raise ConfigError(f"{config}: one of {', '.join(ST_POOLING_FLAGS)} must be set; tformer pools no other way")
    normalize = any(m.get("type", "").endswith("Normalize") for m in json.loads(modules.read_text()))
    settings = directory / "sentence_bert_config.json"
    longest = json.loads(settings.read_text()).get("max_seq_length", 0) if settings.is_file() else 0
    return Pooling(modes[0], normalize, int(longest or 0))


def hidden_states(model: TransformerModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The last hidden states (B, T, d) of right-padded inputs (B, T) whose real tokens `mask` marks."""
    if isinstance(model, EncoderMLM | EncoderDecoder):
        return model.encode(ids, mask)
    if isinstance(model, DecoderLM):
        return model.decoder(ids, StackInputs.from_prefix(ids, mask))
    raise RequestError(f"{type(model).__name__} models have no hidden states tformer can pool into embeddings")


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """(B, T, d) hidden states and (B, T) real-token mask -> (B, d) float32 vectors."""
    hidden, weights = hidden.float(), mask.to(torch.float32)
    if pooling.mode == "mean":
        vectors = (hidden * weights[..., None]).sum(1) / weights.sum(1, keepdim=True).clamp(min=1e-9)
    elif pooling.mode == "cls":
        vectors = hidden[:, 0]
    else:
        last = mask.sum(1).long() - 1
        vectors = hidden[torch.arange(hidden.shape[0]), last]
    return F.normalize(vectors, dim=-1) if pooling.normalize else vectors


class Embedder:
    """Embeds batches of inputs (texts, or token-id lists) with one model: `embed(inputs)` -> (N, d) float32.

    Inputs are sorted by length and run in batches of at most `max_batch_tokens` padded tokens, so that padding
    stays short; the vectors come back in input order, each independent of its batch (tested)."""

    def __init__(
        self, model: TransformerModel, tokenizer=None, pooling: Pooling | None = None, max_batch_tokens: int = 8192
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.pooling = pooling or Pooling.default_for(model)
        self.max_batch_tokens = max_batch_tokens
        limit = model.config.max_seq_len
        self.max_tokens = min(self.pooling.max_tokens, limit) if self.pooling.max_tokens else limit
        self.dimensions = model.config.d_model

    def encode(self, text: str) -> list[int]:
        """A text's token ids as the model read them in pretraining: an encoder's with the tokenizer's own special
        tokens around them (BERT's [CLS] ... [SEP], as sentence-transformers encodes), a decoder's as it prompts."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: give the inputs as lists of token ids")
        if isinstance(self.model, EncoderMLM) and hasattr(self.tokenizer, "encode_with_special_tokens"):
            return self.tokenizer.encode_with_special_tokens(text)
        return self.tokenizer.encode(text)

    def token_ids(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Each input's token ids, checked (RequestError for an empty or too long input, or an unknown id)."""
        vocab, rows = self.model.config.vocab_size, []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                item = self.encode(item)
            ids = [int(t) for t in item]
            if not ids:
                raise RequestError(f"input {i} is empty; give at least one token")
            if len(ids) > self.max_tokens:
                raise RequestError(f"input {i} has {len(ids)} tokens; this model embeds at most {self.max_tokens}")
            if min(ids) < 0 or max(ids) >= vocab:
                raise RequestError(f"input {i}: token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
            rows.append(ids)
        return rows

    def embed(self, inputs: Sequence[str | Sequence[int]]) -> torch.Tensor:
        return self.embed_ids(self.token_ids(inputs))

    @torch.inference_mode()
    def embed_ids(self, rows: list[list[int]]) -> torch.Tensor:
        """The vectors (N, d) of inputs already checked by `token_ids`."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        device = next(self.model.parameters()).device
        out = torch.empty(len(rows), self.dimensions)
        start = 0
        while start < len(order):
            budget, end = max(self.max_batch_tokens, len(rows[order[start]])), start  # a long row runs alone
            while end < len(order) and len(rows[order[end]]) * (end - start + 1) <= budget:
                end += 1  # sorted by length: the last row added is the widest
            batch = order[start:end]
            width = len(rows[batch[-1]])
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, i in enumerate(batch):
                ids[j, : len(rows[i])] = torch.tensor(rows[i])
                mask[j, : len(rows[i])] = 1
            ids, mask = ids.to(device), mask.to(device)
            out[batch] = pool(hidden_states(self.model, ids, mask), mask, self.pooling).cpu()
            start = end
        return out


class EmbeddingEngine:
    """What serves a model that only embeds (an encoder, which has no next-token distribution): the `Engine`'s
    surface that `AsyncEngine` and the server read, with no requests ever queued. Generation requests are refused;
    `embedder` embeds on the engine thread (`AsyncEngine.call`)."""

    generates = False

    def __init__(self, model: TransformerModel, tokenizer=None, pooling: Pooling | None = None) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.embedder = Embedder(model, tokenizer, pooling)
        self.max_model_len = self.embedder.max_tokens

    def add_request(self, *_: object, **__: object) -> str:
        raise RequestError(
            f"this model is an encoder ({type(self.model).__name__}): it embeds text and generates none; "
            "use /v1/embeddings"
        )

    def has_unfinished(self) -> bool:
        return False

    def step(self) -> list:
        return []

    def abort(self, request_id: str) -> None:
        """Nothing is ever queued, so nothing is aborted."""
