"""The OpenAI wire format's answers: whole completions and stream chunks of /v1/completions and
/v1/chat/completions, with their log-probabilities; request bodies are in protocol.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tformer.inference.sampling import TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Sample:
    """One finished sample of a request: its text, why it ended, and its tokens' log-probabilities when asked."""

    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


class CompletionFormat:
    """Shapes /v1/completions answers: `text_completion` objects, whole or as stream chunks. `token_text` gives a
    token id's text, for log-probabilities."""

    id_prefix = "cmpl"
    endpoint = "/v1/completions"

    def __init__(self, request_id: str, model: str, token_text: Callable[[int], str] = str) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.token_text = token_text
        self._offsets: dict[int, int] = {}  # each sample's text length so far in its streamed log-probabilities

    def logprobs(self, items: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any] | None:
        """The legacy completions object: tokens, their log-probabilities, the top ones (the sampled token always
        among them), and each token's offset in the sample's text."""
        if items is None:
            return None
        tokens = [self.token_text(item.token_id) for item in items]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        top = [{self.token_text(t): lp for t, lp in [*item.top, (item.token_id, item.logprob)]} for item in items]
        return {
            "tokens": tokens,
            "token_logprobs": [item.logprob for item in items],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def response(self, samples: list[Sample], use: dict[str, int]) -> dict[str, Any]:
        """The whole answer: one choice per sample, in index order."""
        choices = [
            {"index": i, "text": s.text, "logprobs": self.logprobs(s.logprobs, i), "finish_reason": s.finish_reason}
            for i, s in enumerate(samples)
        ]
        return self._wrap(choices, usage=use)

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        return []

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": self.logprobs(logprobs, index)}
        return self._wrap([{**choice, "finish_reason": finish_reason}])

    def last_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        return self.chunk("", finish_reason, index)

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return self._wrap([], usage=use)


class ChatFormat(CompletionFormat):
    """Shapes /v1/chat/completions answers: `chat.completion` objects and `chat.completion.chunk` deltas."""

    id_prefix = "chatcmpl"
    endpoint = "/v1/chat/completions"

    def _wrap(self, choices: list[dict[str, Any]], chunk: bool = True, **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def logprobs(self, items: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any] | None:
        """The chat object: per token its text, log-probability, UTF-8 bytes and the top alternatives'."""
        if items is None:
            return None

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [{**entry(i.token_id, i.logprob), "top_logprobs": [entry(*pair) for pair in i.top]} for i in items]
        return {"content": content, "refusal": None}

    def response(self, samples: list[Sample], use: dict[str, int]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": s.text},
                "logprobs": self.logprobs(s.logprobs),
                "finish_reason": s.finish_reason,
            }
            for i, s in enumerate(samples)
        ]
        return self._wrap(choices, chunk=False, usage=use)

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None, i) for i in range(n)]

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        return self._delta({"content": text}, finish_reason, index, logprobs)

    def last_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        return self._delta({}, finish_reason, index)

    def _delta(
        self, delta: dict[str, str], finish_reason: str | None, index: int, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs)}
        return self._wrap([{**choice, "finish_reason": finish_reason}])
