"""What the engine hands back: a request's output of one step (streaming) and a finished request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """What one request produced in one step (streaming): new token ids and new text."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    index: int = 0  # which of the request's samples (SamplingParams.n)


@dataclass
class Completion:
    """A finished request: every generated token id (a final stop token included) and the text."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    index: int = 0


def accumulate(completion: Completion, out: RequestOutput) -> None:
    """Adds one step's output to a completion (what `Engine.generate` collects)."""
    completion.token_ids += out.token_ids
    completion.text += out.text
    if out.finished:
        completion.finish_reason = out.finish_reason
