"""Incremental detokenization with stop strings, for streaming.

Text is released as soon as it is final: a trailing incomplete UTF-8 character (decoded as U+FFFD) and any
ending that could still grow into a stop string are held back until the next token settles them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TextTracker:
    """One request's text so far and how much of it has been sent."""

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.text = ""
        self.sent = 0

    def push(self, output_ids: Sequence[int], stop_token: bool = False) -> tuple[str, bool]:
        """Decodes the output so far (without a final stop token); returns (new final text, hit a stop string)."""
        if self.tokenizer is None:
            return "", False
        self.text = self.tokenizer.decode(output_ids[:-1] if stop_token else output_ids)
        hit = self._find_stop()
        if hit is not None:
            self.text = self.text[:hit]
            return self._release(hit), True
        if stop_token:
            return self._release(len(self.text)), False
        return self._release(self._settled_length()), False

    def flush(self) -> str:
        """Everything still held back (the request ended without a stop string)."""
        return self._release(len(self.text))

    def _find_stop(self) -> int | None:
        starts = [self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop]
        found = [i for i in starts if i >= 0]
        return min(found) if found else None

    def _settled_length(self) -> int:
        end = len(self.text.rstrip("\ufffd"))
        for stop in self.stop:
            for k in range(min(len(stop) - 1, end), 0, -1):
                if self.text[:end].endswith(stop[:k]):
                    end -= k
                    break
        return end

    def _release(self, end: int) -> str:
        delta = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return delta
