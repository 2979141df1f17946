"""The OpenAI wire format's answers: whole completions and stream chunks of /v1/completions and
/v1/chat/completions, with their log-probabilities; request bodies are in protocol.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tformer.engine.sampling import TokenLogprob
from tformer.serve.tools import ToolCalls


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
    """One finished sample of a request: its text, why it ended, and its tokens' log-probabilities when asked (and
    on each prompt's first sample, its prompt's)."""

    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Echo:
    """What completions' `echo` puts before each choice: prompt i's text and token ids (choices i * n + j)."""

    texts: list[str]
    ids: list[list[int]]
    n: int
    prompt_only: bool = False  # max_tokens 0: the generated token is left out


Entries = list[tuple[int, TokenLogprob | None]]  # (token id, its log-probabilities or None: a first prompt token)


class CompletionFormat:
    """Shapes /v1/completions answers: `text_completion` objects, whole or as stream chunks. `token_text` gives a
    token id's text, for log-probabilities; with `echo` each choice starts with its prompt (and its prompt's
    log-probabilities, when asked)."""

    id_prefix = "cmpl"
    endpoint = "/v1/completions"

    def __init__(
        self, request_id: str, model: str, token_text: Callable[[int], str] = str, echo: Echo | None = None
    ) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.token_text = token_text
        self.echo = echo
        self._offsets: dict[int, int] = {}  # each choice's text length so far in its streamed log-probabilities
        self._echoed: set[int] = set()  # choices whose prompt went out
        self._prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}  # by prompt, from its first sample

    def echoes(self, index: int) -> bool:
        """Whether choice `index` still has its prompt to stream."""
        return self.echo is not None and index not in self._echoed

    def _legacy_logprobs(self, entries: Entries | None, index: int) -> dict[str, Any] | None:
        """The legacy completions object: tokens, their log-probabilities, the top ones (the sampled token always
        among them), and each token's offset in the choice's text."""
        if entries is None:
            return None
        tokens = [self.token_text(token) for token, _ in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        top = [
            None if item is None else {self.token_text(t): lp for t, lp in [*item.top, (item.token_id, item.logprob)]}
            for _, item in entries
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [None if item is None else item.logprob for _, item in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _with_prompt(
        self, index: int, text: str, items: list[TokenLogprob] | None, prompt_items: list | None
    ) -> tuple[str, Entries | None]:
        """A choice's text and log-probability entries, under `echo` its prompt's before them the first time the
        choice goes out (a stream's later chunks carry only their own)."""
        entries = None if items is None else [(item.token_id, item) for item in items]
        if self.echo is None or index in self._echoed:
            return text, entries
        self._echoed.add(index)
        prompt = index // self.echo.n
        if prompt_items is not None:
            self._prompt_logprobs[prompt] = prompt_items
        if entries is not None:
            asked = self._prompt_logprobs.get(prompt, [None] * len(self.echo.ids[prompt]))
            entries = list(zip(self.echo.ids[prompt], asked, strict=True)) + entries
        return self.echo.texts[prompt] + text, entries

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
        choices = []
        for i, sample in enumerate(samples):
            first = samples[i - i % self.echo.n] if self.echo else sample  # its prompt's first sample
            text, entries = self._with_prompt(i, sample.text, sample.logprobs, first.prompt_logprobs)
            logprobs = self._legacy_logprobs(entries, i)
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": sample.finish_reason})
        return self._wrap(choices, usage=use)

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        return []

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> dict[str, Any]:
        text, entries = self._with_prompt(index, text, logprobs, prompt_logprobs)
        choice = {"index": index, "text": text, "logprobs": self._legacy_logprobs(entries, index)}
        return self._wrap([{**choice, "finish_reason": finish_reason}])

    def last_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        return self.chunk("", finish_reason, index)

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return self._wrap([], usage=use)


class ChatFormat(CompletionFormat):
    """Shapes /v1/chat/completions answers: `chat.completion` objects and `chat.completion.chunk` deltas; with
    `tools`, the answers are tool calls (tools.py)."""

    id_prefix = "chatcmpl"
    endpoint = "/v1/chat/completions"

    def __init__(
        self, request_id: str, model: str, token_text: Callable[[int], str] = str, tools: ToolCalls | None = None
    ) -> None:
        super().__init__(request_id, model, token_text)
        self.tools = tools
        self._calls: dict[int, str] = {}  # each choice's tool-call text so far

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
        choices = []
        for i, s in enumerate(samples):
            message, reason = {"role": "assistant", "content": s.text}, s.finish_reason
            if self.tools is not None:
                message, reason = self.tools.message(s.text, reason, i)
            choices.append(
                {"index": i, "message": message, "logprobs": self.logprobs(s.logprobs), "finish_reason": reason}
            )
        return self._wrap(choices, chunk=False, usage=use)

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        content = "" if self.tools is None else None
        return [self._delta({"role": "assistant", "content": content}, None, i) for i in range(n)]

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> dict[str, Any] | None:
        if self.tools is None:
            return self._delta({"content": text}, finish_reason, index, logprobs)
        first = index not in self._calls
        self._calls[index] = self._calls.get(index, "") + text
        delta = self.tools.delta(text, index, first)
        if delta is None and not logprobs:
            return None  # "required": the calls go out whole in the last chunk
        return self._delta(delta or {}, finish_reason, index, logprobs)

    def last_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        if self.tools is None:
            return self._delta({}, finish_reason, index)
        text = self._calls.get(index, "")
        delta = {} if self.tools.named is not None else self.tools.last_delta(text, index)
        reason = finish_reason if "content" in delta else self.tools.finish_reason(finish_reason)
        return self._delta(delta, reason, index)

    def _delta(
        self, delta: dict[str, Any], finish_reason: str | None, index: int, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs)}
        return self._wrap([{**choice, "finish_reason": finish_reason}])
