"""Build a tformer `Tokenizer` from the tokenizer a GGUF file describes in its metadata.

A GGUF file carries no tokenizer.json; llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), each token's
type, and either BPE merges (`tokenizer.ggml.model` = "gpt2": byte-level BPE) or SentencePiece scores
("llama"). `tokenizer.ggml.pre` names the regular expressions that split text into words before BPE; each
name llama.cpp knows is a fixed list of expressions, mirrored in `PRE_TOKENIZER_SPLITS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tformer.data.tokenizer import Tokenizer
from tformer.interop.gguf import GGUFError, metadata, open_gguf
from tformer.interop.gguf_file import GGUFFile

# GPT-2's word split: contractions, letters, numbers, other symbols, each with at most one leading space
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's (and Qwen2's, with single digits): contractions in any case, a letter run with at most one leading
# non-letter, numbers of up to three digits, symbols with their trailing newlines, then whitespace
LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre -> expressions applied one after the other (llama.cpp's lists for these names)
PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    "default": [GPT2_SPLIT],
    "gpt-2": [GPT2_SPLIT],  # llama.cpp's name for GPT-2's split
    "gpt2": [GPT2_SPLIT],  # what tformer's writer wrote before, which llama.cpp does not know
    "smollm": [r"\p{N}", GPT2_SPLIT],  # every digit on its own, then GPT-2's split
    "starcoder": [r"\p{N}", GPT2_SPLIT],
    "refact": [r"\p{N}", GPT2_SPLIT],
    "llama-bpe": [LLAMA3_SPLIT],  # Llama 3.x
    "llama3": [LLAMA3_SPLIT],
    "smaug-bpe": [LLAMA3_SPLIT],
    "qwen2": [QWEN2_SPLIT],  # Qwen2, Qwen2.5, Qwen3
    "deepseek-r1-qwen": [QWEN2_SPLIT],
}
# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# tokenizer.ggml.<key>_token_id -> tformer's special-token role
SPECIAL_ID_KEYS: dict[str, str] = {
    "bos": "bos",
    "eos": "eos",
    "padding": "pad",
    "unknown": "unk",
    "mask": "mask",
}
SPACE = "\u2581"  # SentencePiece's visible space


def tokenizer_from_gguf(path: str | os.PathLike[str], reader: GGUFFile | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file: vocabulary, merges or scores, special tokens, add_bos and chat template."""
    reader = reader or open_gguf(path)
    kind = metadata(reader, "tokenizer.ggml.model")
    if kind not in TOKENIZER_BUILDERS:
        raise GGUFError(
            f"{path}: tokenizer model {kind!r} is not supported; supported: {', '.join(TOKENIZER_BUILDERS)}"
        )
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    backend = TOKENIZER_BUILDERS[kind](reader, tokens, types, path)
    _add_special_tokens(backend, tokens, types)
    specials = {}
    for key, role in SPECIAL_ID_KEYS.items():
        token_id = metadata(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            specials[role] = tokens[token_id]
    add_bos = bool(metadata(reader, "tokenizer.ggml.add_bos_token", kind == "llama")) and "bos" in specials
    template = metadata(reader, "tokenizer.chat_template")
    return Tokenizer(backend, specials, add_bos=add_bos, chat_template=template)


def _byte_level_bpe(reader: GGUFFile, tokens: list[str], types: list[int], path: Any) -> HFTokenizer:
    """GPT-2-style byte-level BPE: tokens are spelled in GPT-2's byte alphabet, merges are "left right"."""
    pre = metadata(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(f"{path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZER_SPLITS)}")
    merges = metadata(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise GGUFError(f"{path}: a 'gpt2' tokenizer needs tokenizer.ggml.merges, which is missing")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(reader: GGUFFile, tokens: list[str], types: list[int], path: Any) -> HFTokenizer:
    """SentencePiece BPE (LLaMA 1/2): merges rebuilt from the scores, byte fallback through <0xXX> tokens."""
    scores = metadata(reader, "tokenizer.ggml.scores")
    if scores is None:
        raise GGUFError(f"{path}: a 'llama' tokenizer needs tokenizer.ggml.scores, which is missing")
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = metadata(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(tokens, types, scores),
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=True,
    )
    backend = HFTokenizer(model)
    prefix = bool(metadata(reader, "tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges the adjacent pair whose union scores highest; as BPE ranks, best score first."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, kind, score in zip(tokens, types, scores, strict=True):
        if kind not in (NORMAL, USER_DEFINED):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _add_special_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (<|im_start|>, ...) match whole and are special; user-defined ones match whole too."""
    control = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


Builder = Callable[[GGUFFile, list[str], list[int], Any], HFTokenizer]
TOKENIZER_BUILDERS: dict[str, Builder] = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
