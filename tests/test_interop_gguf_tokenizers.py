"""Byte-level BPE vocabularies of Llama 3 (`tokenizer.ggml.pre` llama-bpe) and Qwen2/3 (qwen2) from GGUF metadata,
against `transformers` building its tokenizer from the same file (`AutoTokenizer.from_pretrained(gguf_file=...)`).

The vocabulary is hand-made: GPT-2's 256 byte characters and a few merges, so that how a text is split into words
before BPE (numbers in threes or one by one, contractions in any case, newlines) decides the tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tformer.interop.gguf_tokenizer import tokenizer_from_gguf

transformers = pytest.importorskip("transformers")

TEXTS = [
    "12345 apples",
    "I DON'T know, you'll see",
    "hello\n\n  world!!\n",
    "x = 3.14159 * 2",
    "héllo wörld 2024",
    "",
]


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


MERGES = ["1 2", "12 3", "Ġ t", "h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "' t", "' T", "D O", "DO N"]


def write_vocab(path: Path, pre: str) -> Path:
    tokens = byte_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_vocabularies_split_as_transformers_does(pre: str, tmp_path: Path) -> None:
    path = write_vocab(tmp_path / f"{pre}.gguf", pre)
    ours = tokenizer_from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), (pre, text)
        assert ours.decode(ids) == text
    numbers = [ours.backend.id_to_token(i) for i in ours.encode("12345")]
    assert numbers == (["123", "4", "5"] if pre == "llama-bpe" else ["1", "2", "3", "4", "5"])
