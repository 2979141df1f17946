"""Readers for the user's own corpora: parallel TSV, two aligned text files, JSONL, and plain text.

Every reader returns cleaned text: Unicode NFC (so a decomposed "u + combining diaeresis" becomes "ü") with
runs of whitespace collapsed to one space and the ends stripped. Blank lines are skipped; a parallel example
whose source or target is empty after cleaning is dropped, as for the embedded corpus. Bad input raises
`DataError` with the file name and the 1-based line number, in the form ``path:line: what was wrong; fix``.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

from tformer.errors import DataError

PathLike = str | os.PathLike[str]
Pair = tuple[str, str]

_WHITESPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """NFC-normalise `text`, collapse whitespace runs to one space and strip both ends."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def iter_lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """Yield (line_number, line) for each line of a UTF-8 file, without the line ending.

    A UTF-8 byte-order mark at the start is ignored. Bytes that are not UTF-8 raise `DataError` naming the
    line and the byte column, so the user can find them (e.g. a Latin-1 file saved by an old editor).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; check the path (relative paths start at {Path.cwd()})")
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            yield number, decode_line(raw[3:] if number == 1 and raw.startswith(BOM) else raw, path, number)


BOM = b"\xef\xbb\xbf"


def decode_line(raw: bytes, path: PathLike, number: int) -> str:
    """One line's bytes as text without the line ending; bytes that are not UTF-8 raise `DataError`."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}:{number}: bytes that are not UTF-8 at column {err.start + 1} "
            f"({raw[err.start : err.end]!r}); re-encode the file as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8 {Path(path).name}`"
        ) from None
    return line.rstrip("\r\n")


def _require_examples(examples: list, path: PathLike, what: str) -> None:
    if not examples:
        raise DataError(f"{path}: no {what} found (the file is empty or has only blank lines); give a non-empty file")


def read_text(path: PathLike) -> list[str]:
    """Plain text for language models: one example per non-blank line."""
    texts = [text for _, line in iter_lines(path) if (text := normalize_text(line))]
    _require_examples(texts, path, "text lines")
    return texts


def read_tsv(path: PathLike) -> list[Pair]:
    """Parallel text as ``source<TAB>target`` per line; each non-blank line must hold exactly one tab."""
    pairs = [pair for number, line in iter_lines(path) if (pair := parse_tsv_line(line, path, number))]
    _require_examples(pairs, path, "source/target pairs")
    return pairs


def parse_tsv_line(line: str, path: PathLike, number: int) -> Pair | None:
    """The cleaned (source, target) of one TSV line; None for a blank line or an empty side."""
    if not line.strip():
        return None
    tabs = line.count("\t")
    if tabs != 1:
        raise DataError(
            f"{path}:{number}: expected exactly one tab between source and target, found {tabs}; "
            "remove tabs inside the text or use the JSONL format"
        )
    src, tgt = (normalize_text(side) for side in line.split("\t"))
    return (src, tgt) if src and tgt else None


def read_aligned(src_path: PathLike, tgt_path: PathLike) -> list[Pair]:
    """Parallel text as two files whose line i are translations of each other (Moses style)."""
    src_lines = list(iter_lines(src_path))
    tgt_lines = list(iter_lines(tgt_path))
    if len(src_lines) != len(tgt_lines):
        longer, shorter = (src_path, tgt_path) if len(src_lines) > len(tgt_lines) else (tgt_path, src_path)
        first_extra = min(len(src_lines), len(tgt_lines)) + 1
        raise DataError(
            f"{longer}:{first_extra}: line has no partner: {src_path} has {len(src_lines)} lines but {tgt_path} "
            f"has {len(tgt_lines)}; the files must be line-aligned (check {shorter} for a missing or merged line)"
        )
    pairs = [(normalize_text(s), normalize_text(t)) for (_, s), (_, t) in zip(src_lines, tgt_lines, strict=True)]
    pairs = [(s, t) for s, t in pairs if s and t]
    _require_examples(pairs, src_path, f"non-empty line pairs (with {tgt_path})")
    return pairs


def _json_field(obj: dict, key: str, path: PathLike, number: int) -> str:
    if key not in obj:
        raise DataError(
            f"{path}:{number}: object has no key {key!r} (keys: {sorted(obj)}); "
            "name the fields that hold the text (src_key=/tgt_key=, or tformer prepare --keys)"
        )
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{path}:{number}: {key!r} must be a string, got {type(value).__name__}")
    return normalize_text(value)


def read_jsonl(path: PathLike, src_key: str = "src", tgt_key: str = "tgt") -> list[Pair]:
    """Parallel text as one JSON object per line, e.g. ``{"src": "Hello", "tgt": "Hallo"}``."""
    pairs: list[Pair] = []
    for number, line in iter_lines(path):
        fields = parse_jsonl_line(line, path, number, (src_key, tgt_key))
        if fields is not None and all(fields):
            pairs.append((fields[0], fields[1]))
    _require_examples(pairs, path, "source/target pairs")
    return pairs


def parse_jsonl_line(line: str, path: PathLike, number: int, keys: tuple[str, ...]) -> tuple[str, ...] | None:
    """The cleaned text of `keys` in one JSONL line (some may be empty); None for a blank line."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: malformed JSON ({err.msg} at column {err.colno}); fix the line") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
    return tuple(_json_field(obj, key, path, number) for key in keys)


def read_parallel(
    path: PathLike, tgt_path: PathLike | None = None, src_key: str = "src", tgt_key: str = "tgt"
) -> list[Pair]:
    """Read a parallel corpus in whichever format `path` names.

    Two paths: aligned text files. One path ending in ``.jsonl`` (or ``.json``): JSONL with `src_key` and
    `tgt_key`. Any other single path: TSV.
    """
    if tgt_path is not None:
        return read_aligned(path, tgt_path)
    if Path(path).suffix.lower() in {".jsonl", ".json"}:
        return read_jsonl(path, src_key, tgt_key)
    return read_tsv(path)
