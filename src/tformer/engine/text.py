"""Incremental detokenization with stop strings, for streaming.

Text is released as soon as it is final: a trailing incomplete UTF-8 character (decoded as U+FFFD) and any
ending that could still grow into a stop string are held back until the next token settles them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TextCodec(Protocol):
    """What the engine needs from a tokenizer (`tformer.data.tokenizer.Tokenizer` is one): text to ids and back."""

    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TextTracker:
    """One request's text so far and how much of it has been sent.

    Decoding is incremental, as in Hugging Face's TextStreamer and vLLM's detokenizer, so that a token costs
    the same at any length: each push decodes only the tokens not yet settled, after the last settled chunk
    as context (a decoder may strip a leading space, or see half a character, at the start of what it is
    given; the context chunk has the same start, so its text is subtracted). The tokens settle once their
    text does not end in U+FFFD. `text` keeps only the unsent text and enough sent text before it for a stop
    string to straddle the two.
    """

    def __init__(self, tokenizer: TextCodec | None, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.text = ""  # the end of the text so far: sent context, then unsent text
        self.sent = 0  # how much of `text` has been sent
        self._context = max((len(s) for s in self.stop), default=1) - 1  # sent characters a stop search rereads
        self._settled = 0  # `text[:_settled]` ends where token `_read` starts; the rest may still change
        self._prefix = 0  # ids[_prefix:_read]: the last settled chunk, decoded again as context
        self._read = 0
        self._prefix_text = ""  # the text of ids[_prefix:_read] decoded alone

    def push(self, output_ids: Sequence[int], stop_token: bool = False) -> tuple[str, bool]:
        """Decodes the output so far (without a final stop token); returns (new final text, hit a stop string).

        `output_ids` only grows from one push to the next (it is a sample's output)."""
        if self.tokenizer is None:
            return "", False
        pending = self._decode_new(output_ids, len(output_ids) - 1 if stop_token else len(output_ids))
        self.text = self.text[: self._settled] + pending
        hit = self._find_stop()
        if hit is not None:
            self.text = self.text[:hit]
            return self._release(hit), True
        if stop_token:
            return self._release(len(self.text)), False
        delta = self._release(self._settled_length())
        self._drop_sent()
        return delta, False

    def flush(self) -> str:
        """Everything still held back (the request ended without a stop string)."""
        return self._release(len(self.text))

    def _decode_new(self, ids: Sequence[int], end: int) -> str:
        """Decodes ids[_read:end] after their context; settles them unless their text ends in U+FFFD (a
        character whose bytes have not all come). Returns the text of the tokens left unsettled."""
        if end <= self._read:
            return ""
        assert self.tokenizer is not None
        tail = self.tokenizer.decode(ids[self._prefix : end])[len(self._prefix_text) :]
        if tail.endswith("\ufffd"):
            return tail
        self.text = self.text[: self._settled] + tail
        self._settled += len(tail)
        self._prefix, self._read = self._read, end
        self._prefix_text = self.tokenizer.decode(ids[self._prefix : self._read])
        return ""

    def _drop_sent(self) -> None:
        """Forgets sent text that no stop string can reach any more (settled text only)."""
        cut = min(self.sent - self._context, self._settled)
        if cut > 0:
            self.text = self.text[cut:]
            self.sent -= cut
            self._settled -= cut

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
