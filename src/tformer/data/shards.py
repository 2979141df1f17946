"""Pre-tokenized corpora on disk (nanoGPT's train.bin, Megatron's indexed datasets): tokenize once, then train from
memory maps, so a corpus larger than memory trains in constant memory and no rank re-reads or re-tokenizes it.

A prepared directory holds

    tokenizer.json, tokenizer_config.json   the tokenizer the ids belong to (trained once on a sample)
    shard-00000.bin, ...                    token ids, uint16 when the vocabulary fits, else uint32
    shard-00000.idx, ...                    int64 offsets of the documents in the shard's ids (documents + 1)
    manifest.json                           written last: what was prepared, from what, and every file's size

A text document is stored as the packed stream writes it (data/packing.py), ``<s> x </s>``, so the shards
concatenated are the packed stream itself and a packed block is one slice. A parallel example is two documents,
source then target, stored bare (the objectives add the specials). Documents never straddle shards.

`prepare_shards` reads the corpus in chunks of lines (or Parquet record batches), never whole, and tokenizes them in
worker processes while the main process appends the results in corpus order. It writes into ``DIR.partial`` and
records its position there as it goes (progress.json), so that an interrupted prepare continues where it stopped;
only a finished one gets a manifest and its final name. `ShardedCorpus` refuses a directory without a manifest or
with a file whose size disagrees with it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import time
import unicodedata
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tformer.data.readers import BOM, DataError, decode_line, normalize_text, parse_jsonl_line, parse_tsv_line
from tformer.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from tformer.data.tokenizer import Tokenizer
from tformer.files import fsync_tree, read_mapping, replace_directory, write_text_atomically

FORMAT, VERSION = "tformer-shards", 1
MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = "progress.json"
KINDS = ("text", "pairs")
FORMATS = ("text", "tsv", "jsonl", "parquet")
OFFSET_DTYPE = np.dtype("<i8")
SAVE_PROGRESS_EVERY = 5.0  # seconds between durable progress records: what an interrupted prepare redoes at most


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id: uint16 up to 65,536 ids, else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def tokenizer_digest(directory: Path) -> str:
    """SHA-256 of the tokenizer.json in `directory`: the shards' ids are valid only with this tokenizer."""
    return hashlib.sha256((directory / TOKENIZER_FILE).read_bytes()).hexdigest()


# ---- the corpus, read in chunks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """A piece of the corpus: whole lines (bytes) or Parquet rows (one list per column), and where it ends."""

    data: bytes | list[list[Any]]
    first_line: int  # 1-based line (or row) number of its first line, for error messages
    end: int  # byte offset (or row index) just after it: where the next chunk starts
    next_line: int  # the line (or row) number there


@dataclass(frozen=True)
class CorpusFile:
    """A corpus file to prepare: its format (from the suffix), whether it holds text or pairs, and its fields.

    `kind` text: plain text (one document a line), JSONL or Parquet with a `keys[0]` field. `kind` pairs: TSV
    (source<TAB>target), JSONL or Parquet with fields `keys` = (source, target).
    """

    path: Path
    format: str
    kind: str
    keys: tuple[str, ...]

    @classmethod
    def of(cls, path: str | os.PathLike[str], kind: str, keys: Sequence[str] | None = None) -> CorpusFile:
        path = Path(path)
        if kind not in KINDS:
            raise DataError(f"unknown corpus kind {kind!r}; use one of {', '.join(KINDS)}")
        if not path.is_file():
            raise DataError(f"{path}: no such corpus file; check train.corpus (relative paths start at {Path.cwd()})")
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the corpus file is empty; give a non-empty file")
        suffix = path.suffix.lower()
        fmt = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(suffix)
        if fmt is None:
            fmt = "tsv" if kind == "pairs" else "text"
        if fmt == "parquet":
            _require_pyarrow(path)
        default = ("src", "tgt") if kind == "pairs" else ("text",)
        return cls(path, fmt, kind, tuple(keys or default))

    def identity(self) -> dict[str, Any]:
        """What the shards were made from: a changed file (size or modification time) means preparing again."""
        stat = self.path.stat()
        return {"path": str(self.path.resolve()), "format": self.format, "kind": self.kind, "keys": list(self.keys),
                "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}  # fmt: skip

    def chunks(self, chunk_bytes: int, start: int = 0, first_line: int = 1) -> Iterator[Chunk]:
        """The corpus from byte offset (or row) `start` on, in chunks of about `chunk_bytes` cut at line ends."""
        if self.format == "parquet":
            yield from _parquet_chunks(self, chunk_bytes, start)
            return
        with self.path.open("rb") as handle:
            handle.seek(start)
            offset, line = start, first_line
            while block := handle.read(chunk_bytes):
                if not block.endswith(b"\n"):
                    block += handle.readline()  # up to the end of the line (or of the file)
                yield Chunk(block, line, offset + len(block), line + block.count(b"\n"))
                offset += len(block)
                line += block.count(b"\n")

    def sample(self, n_bytes: int, pieces: int = 64) -> list[str]:
        """About `n_bytes` of the corpus's text for training the tokenizer, read in `pieces` stretches spread evenly
        over the file (a sorted or grouped corpus is sampled from end to end), both sides of each pair."""
        size = self.path.stat().st_size if self.format != "parquet" else _parquet_rows(self.path)
        if self.format == "parquet":  # rows, not bytes: the first rows up to about n_bytes of text
            texts: list[str] = []
            for chunk in self.chunks(n_bytes):
                texts += [t for example in parse_chunk(self, chunk) for t in _sides(example)]
                break
            return texts
        piece = max(n_bytes // pieces, 1)
        starts = [0] if n_bytes >= size else sorted({int(s) for s in np.linspace(0, size - piece, pieces)})
        texts = []
        with self.path.open("rb") as handle:
            for start in starts:
                handle.seek(start)
                if start > 0:
                    handle.readline()  # the rest of a line cut in the middle
                block = handle.read(min(piece, n_bytes))
                block += handle.readline()
                texts += [t for example in self._parse_leniently(block) for t in _sides(example)]
        return texts

    def _parse_leniently(self, block: bytes) -> list:
        """The sample's lines, bad ones skipped: the full pass names them with their line numbers."""
        try:
            return parse_chunk(self, Chunk(block, 0, 0, 0))
        except DataError:
            good = []
            for line in block.splitlines():
                try:
                    good += parse_chunk(self, Chunk(line, 0, 0, 0))
                except DataError:
                    continue
            return good


def _sides(example: str | tuple[str, str]) -> tuple[str, ...]:
    return (example,) if isinstance(example, str) else example


def _require_pyarrow(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow, which is not installed; `pip install pyarrow`, or give the "
            "corpus as JSONL, TSV or plain text"
        ) from None
    return pq


def _parquet_rows(path: Path) -> int:
    return _require_pyarrow(path).ParquetFile(path).metadata.num_rows


def _parquet_chunks(corpus: CorpusFile, chunk_bytes: int, start: int) -> Iterator[Chunk]:
    pq = _require_pyarrow(corpus.path)
    file = pq.ParquetFile(corpus.path)
    missing = [key for key in corpus.keys if key not in file.schema_arrow.names]
    if missing:
        raise DataError(
            f"{corpus.path}: no column {missing[0]!r} (columns: {file.schema_arrow.names}); name the text columns "
            "with --keys"
        )
    rows_per_batch = max(chunk_bytes // 128, 1)  # about chunk_bytes of text at some 128 bytes a row
    row = 0
    for batch in file.iter_batches(batch_size=rows_per_batch, columns=list(corpus.keys)):
        end = row + batch.num_rows
        if end > start:
            columns = [batch.column(key).to_pylist()[max(start - row, 0) :] for key in corpus.keys]
            yield Chunk(columns, max(start, row) + 1, end, end + 1)
        row = end


def parse_chunk(corpus: CorpusFile, chunk: Chunk) -> list:
    """The cleaned documents (text) or (source, target) pairs of a chunk, with the readers' rules (readers.py):
    blank lines and pairs with an empty side are dropped, and a bad line raises `DataError` naming it."""
    if corpus.format == "parquet":
        return _parse_rows(corpus, chunk)
    data = chunk.data
    assert isinstance(data, bytes)
    if chunk.first_line == 1 and data.startswith(BOM):
        data = data[len(BOM) :]
    if corpus.format in ("text", "tsv") and (lines := _clean_lines(data, corpus.format)) is not None:
        if corpus.format == "text":
            return [line for line in lines if line]
        return _tsv_pairs(lines, corpus.path, chunk.first_line)
    out: list = []
    for number, raw in enumerate(data.splitlines(), start=chunk.first_line):
        line = decode_line(raw, corpus.path, number)
        if corpus.format == "text":
            if text := normalize_text(line):
                out.append(text)
        elif corpus.format == "tsv":
            if pair := parse_tsv_line(line, corpus.path, number):
                out.append(pair)
        elif (fields := parse_jsonl_line(line, corpus.path, number, corpus.keys)) is not None and all(fields):
            out.append(fields[0] if corpus.kind == "text" else fields)
    return out


# Whitespace that normalize_text would change, within a line (and, in TSV, within a side): a run of two or more, or
# one that is not a space. Matching only these leaves the many single spaces of ordinary text alone.
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # where bytes.splitlines cuts, so that line numbers agree
_TO_COLLAPSE = {
    "text": re.compile(r"[^\S\r\n]{2,}|[^\S \r\n]"),
    "tsv": re.compile(r"[^\S\t\r\n]{2,}|[^\S \t\r\n]"),
}


def _clean_lines(data: bytes, fmt: str) -> list[str] | None:
    """The chunk's lines as normalize_text leaves them (in TSV, each side), normalised on the whole chunk at once
    rather than line by line: the same strings, a fraction of the Python calls (NFC never composes across a line
    break or a tab, so normalising the whole equals normalising the pieces). None when the chunk is not UTF-8: the
    line-by-line path then names the line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = _TO_COLLAPSE[fmt].sub(" ", unicodedata.normalize("NFC", text))
    lines = _LINE_BREAK.split(text) if "\r" in text else text.split("\n")
    return [line.strip() for line in lines] if fmt == "text" else lines


def _tsv_pairs(lines: list[str], path: Path, first_line: int) -> list[tuple[str, str]]:
    """parse_tsv_line's pairs of lines already normalised by _clean_lines."""
    out = []
    for number, line in enumerate(lines, start=first_line):
        if line.count("\t") != 1:
            if line.strip():
                parse_tsv_line(line, path, number)  # raises DataError naming the line
            continue
        src, tgt = line.split("\t")
        if (src := src.strip()) and (tgt := tgt.strip()):
            out.append((src, tgt))
    return out


def _parse_rows(corpus: CorpusFile, chunk: Chunk) -> list:
    out: list = []
    for i, values in enumerate(zip(*chunk.data, strict=True)):
        if not all(isinstance(v, str) for v in values):
            bad = next(v for v in values if not isinstance(v, str))
            raise DataError(
                f"{corpus.path}: row {chunk.first_line + i}: the text columns must hold strings, got "
                f"{type(bad).__name__}"
            )
        cleaned = tuple(normalize_text(v) for v in values)
        if all(cleaned):
            out.append(cleaned[0] if corpus.kind == "text" else cleaned)
    return out


# ---- tokenizing a chunk (in a worker process) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Encoding:
    """How chunks become ids: the corpus, the tokenizer's directory, the specials around a text and the id type."""

    corpus: CorpusFile
    tokenizer_dir: Path
    bos_id: int
    eos_id: int
    dtype: str


_worker: tuple[Encoding, Tokenizer] | None = None


def _start_worker(encoding: Encoding) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a process: the processes are the parallelism
    _worker = (encoding, Tokenizer.load(encoding.tokenizer_dir))


def _encode_in_worker(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, int, int]:
    assert _worker is not None
    return encode_chunk(*_worker, chunk)


def encode_chunk(encoding: Encoding, tokenizer: Tokenizer, chunk: Chunk) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(ids, document lengths, chunk end, line there) of a chunk: text as ``<s> x </s>`` per document, pairs as
    source then target; documents that encode to nothing are dropped, as the packed and unpacked trainers drop them."""
    examples = parse_chunk(encoding.corpus, chunk)
    if encoding.corpus.kind == "text":
        encoded = [ids for ids in tokenizer.encode_batch(examples, add_bos=False) if ids]
        bos, eos = [encoding.bos_id], [encoding.eos_id]
        pieces = [piece for ids in encoded for piece in (bos, ids, eos)]
        lengths = [len(ids) + 2 for ids in encoded]
    else:
        sources = tokenizer.encode_batch([s for s, _ in examples], add_bos=False)
        targets = tokenizer.encode_batch([t for _, t in examples], add_bos=False)
        pieces = [side for pair in zip(sources, targets, strict=True) for side in pair]
        lengths = [len(ids) for ids in pieces]
    total = sum(lengths)
    ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=encoding.dtype, count=total)
    return ids, np.asarray(lengths, dtype=OFFSET_DTYPE), chunk.end, chunk.next_line


# ---- writing -------------------------------------------------------------------------------------------------------


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


class _ShardWriter:
    """Appends documents to numbered shards in `directory`, starting a new one past `shard_tokens` ids, and records
    the position durably so that a restart continues from it (`progress`)."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int, progress: dict[str, Any]) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.progress = progress  # plan, finished shards, and the open shard's tokens and documents
        self.bin = self.idx = None
        self._open()

    def _paths(self, i: int) -> tuple[Path, Path]:
        return self.directory / f"{shard_name(i)}.bin", self.directory / f"{shard_name(i)}.idx"

    def _open(self) -> None:
        current = self.progress["current"]
        bin_path, idx_path = self._paths(len(self.progress["shards"]))
        self.bin, self.idx = open(bin_path, "ab"), open(idx_path, "ab")  # noqa: SIM115 -- open across calls
        # what was appended after the last durable record is written again: cut the files back to it (a new index
        # grows to its first offset, a zero)
        self.bin.truncate(current["tokens"] * self.dtype.itemsize)
        self.idx.truncate((current["docs"] + 1) * OFFSET_DTYPE.itemsize)

    def append(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        current = self.progress["current"]
        self.bin.write(ids.tobytes())
        self.idx.write((current["tokens"] + np.cumsum(lengths)).astype(OFFSET_DTYPE).tobytes())
        current["tokens"] += len(ids)
        current["docs"] += len(lengths)

    def full(self) -> bool:
        return self.progress["current"]["tokens"] >= self.shard_tokens

    def save(self, position: int, line: int) -> None:
        """Makes everything appended so far durable, with the corpus `position` (and `line`) it reached."""
        for handle in (self.bin, self.idx):
            handle.flush()
            os.fsync(handle.fileno())
        self.progress.update(position=position, line=line)
        write_text_atomically(self.directory / PROGRESS_NAME, json.dumps(self.progress, indent=1))

    def close_shard(self, position: int, line: int) -> None:
        """Ends the open shard (when it holds documents) and opens the next."""
        current = self.progress["current"]
        if current["docs"] == 0:
            return
        self.progress["shards"].append({"name": shard_name(len(self.progress["shards"])), **current})
        self.progress["current"] = {"tokens": 0, "docs": 0}
        self.save(position, line)
        self.close()
        self._open()

    def close(self) -> None:
        for handle in (self.bin, self.idx):
            handle.close()


def partial_dir(out_dir: Path) -> Path:
    """Where `prepare_shards` writes until it is done: DIR.partial beside DIR."""
    return out_dir.with_name(out_dir.name + ".partial")


def prepare_shards(
    corpus: CorpusFile,
    out_dir: Path,
    make_tokenizer: Callable[[], Tokenizer],
    *,
    settings: dict[str, Any],
    special_ids: Callable[[Tokenizer], tuple[int, int]],
    workers: int = 0,
    shard_tokens: int = 1 << 27,
    chunk_bytes: int = 1 << 20,
    time_budget: float = 0.0,
    report: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """Tokenizes `corpus` into shards in `out_dir`; returns the manifest, or None when `time_budget` seconds ran
    out first (the same call then continues where this one stopped).

    make_tokenizer: trains (or loads) the tokenizer; called once, unless an interrupted prepare already saved one
    settings: what else decides the ids (vocabulary size, sentinels, sample size, tokenizer source): a directory
      prepared with other settings, or from a changed corpus, is prepared again
    special_ids: the (bos, eos) ids written around each text document (the packed stream's)
    workers: processes that tokenize (0: one per CPU; 1: in this process)
    """
    started = time.monotonic()
    out_dir = Path(out_dir)
    plan = {"source": corpus.identity(), "settings": settings, "shard_tokens": shard_tokens}
    if (finished := _finished_manifest(out_dir)) is not None:
        if {k: finished.get(k) for k in plan} == plan:
            report(f"{out_dir} is already prepared from this corpus with these settings")
            return finished
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise DataError(
            f"{out_dir} exists and is not a prepared corpus (no {MANIFEST_NAME}); give train.prepared a new "
            "directory, or delete this one"
        )
    work = partial_dir(out_dir)
    progress = _read_progress(work)
    if progress is None or progress["plan"] != plan:
        if work.exists():
            report(f"starting over: {work} was left by a prepare of another corpus or other settings")
            shutil.rmtree(work)
        work.mkdir(parents=True)
        tokenizer = make_tokenizer()
        tokenizer.save(work)
        bos, eos = special_ids(tokenizer)
        dtype = token_dtype(tokenizer.vocab_size)
        progress = {"plan": plan, "tokenizer_sha256": tokenizer_digest(work), "vocab_size": tokenizer.vocab_size,
                    "bos_id": bos, "eos_id": eos, "dtype": dtype.str, "shards": [],
                    "current": {"tokens": 0, "docs": 0}, "position": 0, "line": 1}  # fmt: skip
        write_text_atomically(work / PROGRESS_NAME, json.dumps(progress, indent=1))
    elif progress["position"] > 0:
        report(f"continuing an interrupted prepare at byte (or row) {progress['position']:,} of {corpus.path}")
    encoding = Encoding(corpus, work, progress["bos_id"], progress["eos_id"], progress["dtype"])
    writer = _ShardWriter(work, np.dtype(progress["dtype"]), shard_tokens, progress)
    position, line = progress["position"], progress["line"]
    done = True
    try:
        last_save = time.monotonic()
        chunks = corpus.chunks(chunk_bytes, position, line)
        for ids, lengths, position, line in _encoded(encoding, chunks, workers):
            writer.append(ids, lengths)
            if writer.full():
                writer.close_shard(position, line)
            elif time.monotonic() - last_save > SAVE_PROGRESS_EVERY:
                writer.save(position, line)
                last_save = time.monotonic()
            if time_budget and time.monotonic() - started > time_budget:
                done = False
                break
        if done:
            writer.close_shard(position, line)
        else:
            writer.save(position, line)
    finally:
        writer.close()
    if not done:
        report(f"stopped after {time_budget:g} s at byte (or row) {position:,}; the same command continues")
        return None
    return _finish(work, out_dir, progress)


def _encoded(encoding: Encoding, chunks: Iterator[Chunk], workers: int) -> Iterator[tuple[np.ndarray, ...]]:
    """The chunks encoded in order, by `workers` processes with a few chunks each in flight (so the reader never
    runs ahead of the writer by more than that), or in this process when `workers` is 1."""
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        tokenizer = Tokenizer.load(encoding.tokenizer_dir)
        for chunk in chunks:
            yield encode_chunk(encoding, tokenizer, chunk)
        return
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(encoding,)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _read_progress(work: Path) -> dict[str, Any] | None:
    path = work / PROGRESS_NAME
    if not path.is_file():
        return None
    try:
        return read_mapping(path, DataError, "prepare progress")
    except DataError:
        return None  # torn by a crash before atomic writes existed: start over


def _finish(work: Path, out_dir: Path, progress: dict[str, Any]) -> dict[str, Any]:
    """Writes the manifest, makes everything durable and gives the directory its final name."""
    dtype = np.dtype(progress["dtype"])
    shards = [
        {**shard, "bin_bytes": shard["tokens"] * dtype.itemsize, "idx_bytes": (shard["docs"] + 1) * 8}
        for shard in progress["shards"]
    ]
    if not shards:
        raise DataError(f"{progress['plan']['source']['path']}: the corpus holds no text to prepare")
    (work / f"{shard_name(len(shards))}.bin").unlink(missing_ok=True)  # the empty shard opened last
    (work / f"{shard_name(len(shards))}.idx").unlink(missing_ok=True)
    kind = progress["plan"]["source"]["kind"]
    docs = sum(s["docs"] for s in shards)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        **{k: progress[k] for k in ("tokenizer_sha256", "vocab_size", "bos_id", "eos_id", "dtype")},
        **progress["plan"],
        "tokens": sum(s["tokens"] for s in shards),
        "documents": docs,
        "examples": docs // 2 if kind == "pairs" else docs,
        "shards": shards,
    }
    (work / PROGRESS_NAME).unlink()
    write_text_atomically(work / MANIFEST_NAME, json.dumps(manifest, indent=1))
    fsync_tree(work)
    replace_directory(work, out_dir)
    return manifest


def _finished_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST_NAME
    return read_mapping(path, DataError, "prepared shards") if path.is_file() else None


# ---- reading -------------------------------------------------------------------------------------------------------


class ShardedCorpus:
    """A finished prepare, read through memory maps: only the pages of the documents asked for enter memory.

    Documents are numbered across shards in corpus order. `tokens(start, stop)` reads the shards as one stream.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        manifest = _finished_manifest(self.directory)
        if manifest is None:
            hint = (
                f"; {partial_dir(self.directory)} holds an interrupted prepare: run `tformer prepare` again to end it"
                if partial_dir(self.directory).is_dir()
                else ": run `tformer prepare RECIPE` first"
            )
            raise DataError(f"{self.directory} is not a finished prepared corpus (no {MANIFEST_NAME}){hint}")
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise DataError(
                f"{self.directory}/{MANIFEST_NAME}: not {FORMAT} version {VERSION} (got {manifest.get('format')!r} "
                f"{manifest.get('version')!r}); prepare the corpus again with this tformer"
            )
        self.manifest = manifest
        self.kind: str = manifest["kind"]
        self.dtype = np.dtype(manifest["dtype"])
        self.bos_id, self.eos_id = int(manifest["bos_id"]), int(manifest["eos_id"])
        self._ids: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        for shard in manifest["shards"]:
            for suffix, key in (("bin", "bin_bytes"), ("idx", "idx_bytes")):
                path = self.directory / f"{shard['name']}.{suffix}"
                size = path.stat().st_size if path.is_file() else None
                if size != shard[key]:
                    raise DataError(
                        f"{path}: {'missing' if size is None else f'{size:,} bytes'} but the manifest says "
                        f"{shard[key]:,}; the prepared corpus is damaged: run `tformer prepare` again"
                    )
            self._ids.append(np.memmap(self.directory / f"{shard['name']}.bin", self.dtype, "r"))
            self._offsets.append(np.memmap(self.directory / f"{shard['name']}.idx", OFFSET_DTYPE, "r"))
        # where each shard starts, in documents and in tokens of the whole stream
        self.doc_starts = np.cumsum([0] + [s["docs"] for s in manifest["shards"]])
        self.token_starts = np.cumsum([0] + [s["tokens"] for s in manifest["shards"]])
        self.n_documents, self.n_tokens = int(self.doc_starts[-1]), int(self.token_starts[-1])

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the ids belong to."""
        return Tokenizer.load(self.directory)

    def check_tokenizer(self, tokenizer_dir: Path) -> None:
        """Raises `DataError` unless the tokenizer.json in `tokenizer_dir` is the one the shards were made with."""
        if tokenizer_digest(tokenizer_dir) != self.manifest["tokenizer_sha256"]:
            raise DataError(
                f"{tokenizer_dir / TOKENIZER_FILE} is not the tokenizer {self.directory} was prepared with, so the "
                f"ids would mean other text; train into a new train.out_dir, or prepare the corpus again"
            )

    def document_lengths(self) -> np.ndarray:
        """The stored length of every document (text ones with their <s> and </s>), in corpus order."""
        return np.concatenate([np.diff(offsets) for offsets in self._offsets])

    def document(self, i: int) -> np.ndarray:
        """The stored ids of document `i` (a view into the memory map)."""
        shard = int(np.searchsorted(self.doc_starts, i, side="right")) - 1
        local = i - int(self.doc_starts[shard])
        offsets = self._offsets[shard]
        return self._ids[shard][int(offsets[local]) : int(offsets[local + 1])]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Ids `start` to `stop` of all shards read as one stream."""
        first = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        pieces = []
        shard = first
        while start < stop and shard < len(self._ids):
            base = int(self.token_starts[shard])
            piece = self._ids[shard][start - base : min(stop, int(self.token_starts[shard + 1])) - base]
            pieces.append(piece)
            start += len(piece)
            shard += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


# ---- training examples on the shards: what data/objectives.py and data/packing.py take --------------------------


class TextDocuments(Sequence):
    """Text documents as the objectives take them (ids without <s> and </s>), the `keep`-th documents only."""

    def __init__(self, corpus: ShardedCorpus, keep: np.ndarray | None = None) -> None:
        self.corpus, self.keep = corpus, keep

    def __len__(self) -> int:
        return self.corpus.n_documents if self.keep is None else len(self.keep)

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        doc = i if self.keep is None else int(self.keep[i])
        return self.corpus.document(doc)[1:-1].tolist()


class Pairs(Sequence):
    """(source ids, target ids) examples, the `keep`-th pairs only."""

    def __init__(self, corpus: ShardedCorpus, keep: np.ndarray | None = None) -> None:
        self.corpus, self.keep = corpus, keep

    def __len__(self) -> int:
        return self.corpus.n_documents // 2 if self.keep is None else len(self.keep)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:  # type: ignore[override]
        pair = i if self.keep is None else int(self.keep[i])
        return self.corpus.document(2 * pair).tolist(), self.corpus.document(2 * pair + 1).tolist()


class PackedBlocks(Sequence):
    """Blocks of ``block_size + 1`` ids of the stream, each starting on the last id of the one before: what
    `pack_sequences` cuts from the same documents, read from the shards instead of built in memory."""

    def __init__(self, corpus: ShardedCorpus, block_size: int) -> None:
        if corpus.n_tokens < 2:
            raise DataError(f"{corpus.directory}: nothing to pack: the corpus holds fewer than 2 tokens")
        self.corpus, self.block_size = corpus, block_size

    def __len__(self) -> int:
        return -(-(self.corpus.n_tokens - 1) // self.block_size)

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        start = i * self.block_size
        return self.corpus.tokens(start, min(start + self.block_size + 1, self.corpus.n_tokens)).tolist()

    def lengths(self) -> np.ndarray:
        """Every block's length: block_size + 1, the last one perhaps shorter."""
        lengths = np.full(len(self), self.block_size + 1, dtype=np.int64)
        lengths[-1] = self.corpus.n_tokens - (len(self) - 1) * self.block_size
        return lengths
