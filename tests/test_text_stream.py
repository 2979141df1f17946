"""The streaming detokenizer (engine/text.py) against its reference: the decode of all ids at once.

For real tokenizers (SmolLM2's byte-level BPE from its GGUF, a SentencePiece vocabulary whose characters fall back
to <0xXX> byte tokens, and a BPE trained on the EN-DE Bible) and texts whose characters span several tokens, the
text streamed over pushes of any size equals the decode of all ids, cut at the first stop string; random ids
(invalid UTF-8 included) give the same deltas as decoding everything on every push. The work of a push is
bounded: it decodes a few ids, not the whole output.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import smollm2_path
from helpers import write_spm_gguf

from tformer.data.corpora import bible_pairs
from tformer.data.tokenizer import Tokenizer
from tformer.engine.text import TextTracker
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf

TEXTS = [
    "Grüße aus Köln: schön, daß Ihr da seid! Übermäßig große Bäume.",
    "Emoji 😀👍🏽 und 👨‍👩‍👧 mitten im Satz, dann weiter.",
    "中文字符测试：你好，世界！日本語も。 mixed with English.",
    "Und Gott sprach: Es werde Licht! und es ward Licht. 🕯️ Ende.",
]
STOPS = [[], ["Licht"], ["😀"], ["世界", "zzz"], ["ß", "Bäume"], ["."]]


class CountingTokenizer:
    """A tokenizer that counts the ids each decode call is given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.bos_id, self.eos_id = inner, inner.bos_id, inner.eos_id
        self.decoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded.append(len(ids))
        return self.inner.decode(ids)


class DecodeAllTracker(TextTracker):
    """The reference: decodes the whole output on every push (quadratic), with the same hold-back rules."""

    def push(self, output_ids: Sequence[int], stop_token: bool = False) -> tuple[str, bool]:
        assert self.tokenizer is not None
        self.text = self.tokenizer.decode(output_ids[:-1] if stop_token else output_ids)
        hit = self._find_stop()
        if hit is not None:
            self.text = self.text[:hit]
            return self._release(hit), True
        if stop_token:
            return self._release(len(self.text)), False
        return self._release(self._settled_length()), False


def spm_byte_fallback(path: Path) -> Tokenizer:
    """A small LLaMA-style SentencePiece vocabulary: every character outside it falls back to <0xXX> bytes."""
    space = "\u2581"
    pieces = [space, *"abcdeghilnorstuw", f"{space}a", "er", f"{space}d", "ch", "ein", f"{space}und", "ll", "en"]
    return tokenizer_from_gguf(write_spm_gguf(path, pieces))


@pytest.fixture(scope="module", params=["smollm2", "spm-byte-fallback", "en-de-bpe"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "smollm2":
        return tokenizer_from_gguf(smollm2_path())
    if request.param == "spm-byte-fallback":
        return spm_byte_fallback(tmp_path_factory.mktemp("spm") / "spm.gguf")
    pairs = bible_pairs("en-de", "train")[:400]
    return Tokenizer.train([text for pair in pairs for text in pair], vocab_size=600)


def stream(tracker: TextTracker, ids: list[int], sizes: Sequence[int], stop_token: bool = False) -> list[str]:
    """Pushes `ids` in chunks of `sizes` (the last chunk with `stop_token`); returns the deltas, a flush last."""
    deltas, end = [], 0
    for size in sizes:
        end = min(end + size, len(ids))
        delta, hit = tracker.push(ids[:end], stop_token=stop_token and end == len(ids))
        deltas.append(delta)
        if hit:
            return deltas
    return [*deltas, tracker.flush()]


def random_sizes(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 1, 2, 3, 5]))
    return sizes


@pytest.mark.parametrize("stop", STOPS, ids=lambda s: "|".join(s) or "no-stop")
def test_streamed_text_is_the_decode_of_all_ids_cut_at_the_stop(tokenizer: Tokenizer, stop: list[str]) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_bos=False)
        assert len(ids) > 10
        for stop_token in (False, True):
            full = tokenizer.decode(ids[:-1] if stop_token else ids)
            starts = [i for i in (full.find(s) for s in stop) if i >= 0]
            expected = full[: min(starts)] if starts else full
            for sizes in ([1] * len(ids), [2] * len(ids), [len(ids)], random_sizes(len(ids), rng)):
                deltas = stream(TextTracker(tokenizer, stop), ids, sizes, stop_token)
                assert "".join(deltas) == expected, (text, sizes)
                assert not any("\ufffd" in d for d in deltas)  # a character is sent whole, never half


def test_random_ids_stream_as_decoding_everything_each_push(tokenizer: Tokenizer) -> None:
    """Ids no text encodes to (byte tokens out of order, invalid UTF-8): the same deltas as the reference."""
    rng = random.Random(1)
    byte_ids = tokenizer.encode("äöü€😀字ß", add_bos=False)
    for _ in range(20):
        ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(len(tokenizer)) for _ in range(40)]
        for stop in ([], ["e"], ["\ufffd"]):
            sizes = random_sizes(len(ids), rng)
            ours = stream(TextTracker(tokenizer, stop), ids, sizes)
            assert ours == stream(DecodeAllTracker(tokenizer, stop), ids, sizes), ids


def test_a_push_decodes_a_bounded_number_of_ids(tokenizer: Tokenizer) -> None:
    """Decoding all ids each push costs O(n) a token; the tracker decodes a few ids per push at any length."""
    text = " ".join(de for _, de in bible_pairs("en-de", "train")[:150]) + " 😀 字"
    ids = tokenizer.encode(text, add_bos=False)[:2500]
    assert len(ids) == 2500
    counting = CountingTokenizer(tokenizer)
    deltas = stream(TextTracker(counting, ["Amen."]), ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(counting.decoded) <= 16  # the last settled chunk plus the unsettled ids: a character's bytes at most
    assert sum(counting.decoded) <= 6 * len(ids)  # decoding everything each push: 2500 * 2501 / 2 ids
