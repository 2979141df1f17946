"""Pre-tokenized shards (`tformer prepare`, data/shards.py): the shards decode to the corpus; training from them
gives the examples, batches and losses of training from the corpus with the same tokenizer; resume (also at another
world size) continues with the exact next batch; the reader's memory does not grow with the corpus; an interrupted
prepare continues to the same bytes; bad input gets a clear error.

The corpora are small (a few hundred lines of the embedded Bible); tiny chunks and shards make them span several
shards and worker tasks.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import steps

from tformer.checkpoints import checkpoint_dir
from tformer.cli import main
from tformer.data import Tokenizer, bible_pairs, bible_text
from tformer.data.readers import DataError, decode_line, normalize_text, parse_tsv_line, read_parallel, read_text
from tformer.data.shards import (
    MANIFEST_NAME,
    Chunk,
    CorpusFile,
    ShardedCorpus,
    parse_chunk,
    partial_dir,
    prepare_shards,
    token_dtype,
)
from tformer.training import Trainer, load_recipe
from tformer.training.corpus import batch_objective, prepare_data, sentinels
from tformer.training.init_from import vocab_of

pytestmark = pytest.mark.usefixtures("one_thread")

LINES = bible_text("dev")[:400]
PAIRS = bible_pairs("en-de", "dev")[:300]


def write_corpus(directory: Path, kind: str, fmt: str) -> Path:
    """The text lines or pairs as a corpus file of format `fmt`, with a blank line and messy whitespace that the
    readers clean, and one pair with an empty side that they drop."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = directory / "corpus.parquet"
        columns = {"text": LINES} if kind == "text" else {"src": [s for s, _ in PAIRS], "tgt": [t for _, t in PAIRS]}
        pq.write_table(pa.table(columns), path, row_group_size=50)
        return path
    if kind == "text":
        rows = [f"  {line.replace(' ', '  ', 1)} " for line in LINES]
        if fmt == "jsonl":
            rows = [json.dumps({"text": row, "id": i}) for i, row in enumerate(rows)]
    else:
        rows = [f"{s}\t{t} " for s, t in PAIRS] + ["only a source\t "]
        if fmt == "jsonl":
            rows = [json.dumps({"src": s, "tgt": t}) for s, t in (row.split("\t") for row in rows)]
    rows.insert(7, "")
    path = directory / f"corpus.{'jsonl' if fmt == 'jsonl' else 'tsv' if kind == 'pairs' else 'txt'}"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def recipe(directory: Path, corpus: Path, objective: str = "clm", **train: object) -> Path:
    preset = {"clm": "tiny-gpt2", "mlm": "tiny-bert", "seq2seq": "tiny-transformer"}.get(objective, "tiny-transformer")
    model = {"preset": preset, "dropout": 0.0, "attn_dropout": 0.0, "max_seq_len": 128}
    if objective == "mlm":
        model["encoder_head"] = "mlm"
    train = {
        "corpus": str(corpus),
        "prepared": str(directory / "shards"),
        "objective": objective,
        "vocab_size": 300,
        "max_len": 96,  # about half the verses fit
        "max_tokens": 400,
        "max_steps": 6,
        "save_every": 3,
        "eval_every": 10_000,
        "log_every": 1,
        "optimizer": "adamw-cosine",
        "lr": 1e-3,
        "warmup": 2,
        "out_dir": str(directory / "run"),
        **train,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": model, "train": train}))
    return path


def prepare(
    recipe_path: Path, *overrides: str, workers: int = 2, chunk_bytes: int = 4096, sample: int = 1 << 20, **kw: object
) -> dict | None:
    """`tformer prepare`'s work with tiny chunks and shards (so several of each), from Python."""
    _, config = load_recipe(recipe_path, list(overrides))
    kind = "pairs" if config.objective == "seq2seq" else "text"
    corpus = CorpusFile.of(config.corpus, kind)

    def make_tokenizer() -> Tokenizer:
        return Tokenizer.train(corpus.sample(sample), config.vocab_size, num_sentinels=sentinels(config))

    def special_ids(tokenizer: Tokenizer) -> tuple[int, int]:
        return vocab_of(tokenizer).bos_id, vocab_of(tokenizer).eos_id

    settings = {"vocab_size": config.vocab_size, "sentinels": sentinels(config)}
    return prepare_shards(
        corpus,
        Path(config.prepared),
        make_tokenizer,
        settings=settings,
        special_ids=special_ids,
        workers=workers,
        shard_tokens=kw.pop("shard_tokens", 2000),
        chunk_bytes=chunk_bytes,
        report=lambda _: None,
        **kw,
    )


# ---- the shards hold the corpus ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "fmt"), [("text", "text"), ("text", "jsonl"), ("pairs", "tsv"), ("pairs", "jsonl")])
def test_prepared_shards_decode_to_the_corpus(kind: str, fmt: str, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path, kind, fmt)
    manifest = prepare(recipe(tmp_path, corpus, "clm" if kind == "text" else "seq2seq"))
    assert len(manifest["shards"]) > 2  # documents spread over several shards and chunks
    shards = ShardedCorpus(tmp_path / "shards")
    tokenizer = shards.tokenizer()
    assert shards.dtype == np.dtype("<u2") and shards.n_tokens == manifest["tokens"]
    docs = [shards.document(i).tolist() for i in range(shards.n_documents)]
    if kind == "text":
        assert all(d[0] == tokenizer.bos_id and d[-1] == tokenizer.eos_id for d in docs)
        assert tokenizer.decode_batch([d[1:-1] for d in docs]) == LINES  # cleaned as read_text cleans
        if fmt == "text":
            assert tokenizer.decode_batch([d[1:-1] for d in docs]) == read_text(corpus)
        stream = [t for d in docs for t in d]
        assert shards.tokens(0, shards.n_tokens).tolist() == stream  # the shards read as one stream
    else:
        assert [(docs[i], docs[i + 1]) for i in range(0, len(docs), 2)] == [
            (tokenizer.encode(s), tokenizer.encode(t)) for s, t in read_parallel(corpus)
        ]
        assert [tuple(tokenizer.decode_batch(docs[i : i + 2])) for i in range(0, len(docs), 2)] == PAIRS


@pytest.mark.parametrize("kind", ["text", "pairs"])
def test_parquet_is_read_in_row_batches(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    corpus = write_corpus(tmp_path, kind, "parquet")
    prepare(recipe(tmp_path, corpus, "clm" if kind == "text" else "seq2seq"), chunk_bytes=2000)
    shards = ShardedCorpus(tmp_path / "shards")
    tokenizer = shards.tokenizer()
    docs = [shards.document(i).tolist() for i in range(shards.n_documents)]
    if kind == "text":
        assert tokenizer.decode_batch([d[1:-1] for d in docs]) == LINES
    else:
        assert [tuple(tokenizer.decode_batch(docs[i : i + 2])) for i in range(0, len(docs), 2)] == PAIRS


@pytest.mark.parametrize("kind", ["text", "pairs"])
def test_a_chunk_is_cleaned_as_the_readers_clean_each_line(kind: str, tmp_path: Path) -> None:
    # parse_chunk normalises a whole chunk at once; the reference is the readers' functions line by line, on lines
    # full of what NFC composes (e, a combining acute; Hangul jamo), whitespace runs of every kind and line breaks
    pieces = ["e", "\u0301", "A\u030a", "\u1100", "\u1161", "\u11a8", "word", " ", "  ", "\t", "\x0b", "\x0c",
              "\x85", "\u2028", "\u00a0", "\u2000", "\u3000", "\r\n", "\r", "\n"]  # fmt: skip
    rng = np.random.default_rng(0)
    lines = ["".join(rng.choice(pieces, rng.integers(1, 12))) for _ in range(3000)]
    if kind == "pairs":  # one tab a line, so that most lines are pairs
        lines = [line.replace("\t", " ") + "\t" + line[::-1].replace("\t", "") for line in lines]
    data = "\n".join(lines).encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    expected = []
    for number, raw in enumerate(data.splitlines(), start=1):
        line = decode_line(raw, path, number)
        try:
            cleaned = normalize_text(line) if kind == "text" else parse_tsv_line(line, path, number)
        except DataError as err:
            cleaned = str(err)  # a line with no tab or two: the same error, with its number
        if cleaned:
            expected.append(cleaned)
    got = []
    corpus = CorpusFile.of(path, kind)
    for number, raw in enumerate(data.splitlines(keepends=True), start=1):  # one chunk a line, to see the errors
        try:
            got += parse_chunk(corpus, Chunk(raw, number, 0, 0))
        except DataError as err:
            got.append(str(err))
    assert got == expected
    assert len([e for e in expected if kind == "text" or isinstance(e, tuple)]) > 1000  # not all errors
    whole = parse_chunk(corpus, Chunk(data, 1, 0, 0)) if kind == "text" else None
    assert whole is None or whole == expected


def test_token_ids_take_two_bytes_while_the_vocabulary_fits() -> None:
    assert token_dtype(300) == token_dtype(65_536) == np.dtype("<u2")
    assert token_dtype(65_537) == token_dtype(151_936) == np.dtype("<u4")


# ---- training from shards is training from the corpus ------------------------------------------------------------


@pytest.mark.parametrize(
    ("objective", "extra"),
    [("clm", {"pack": True}), ("clm", {}), ("mlm", {}), ("span_corruption", {"vocab_size": 400}), ("seq2seq", {})],
)
def test_shards_give_the_corpus_examples_and_batches(objective: str, extra: dict, tmp_path: Path) -> None:
    kind = "pairs" if objective == "seq2seq" else "text"
    corpus = write_corpus(tmp_path, kind, "tsv" if kind == "pairs" else "text")
    path = recipe(tmp_path, corpus, objective, **extra)
    prepare(path)
    _, config = load_recipe(path)
    from_shards = prepare_data(config, tmp_path / "run-shards")
    raw_run = tmp_path / "run-raw"  # the same tokenizer, so that the ids agree
    from_shards.tokenizer.save(raw_run)
    _, raw_config = load_recipe(path, ["train.prepared=null"])
    from_corpus = prepare_data(raw_config, raw_run)
    assert from_corpus.skipped == from_shards.skipped
    if not extra.get("pack"):
        assert from_shards.skipped > 0  # some verses are longer than max_len: the kept ones must line up
    assert list(from_shards.lengths) == list(from_corpus.lengths)
    assert len(from_shards.examples) == len(from_corpus.examples)
    assert [from_shards.examples[i] for i in range(len(from_corpus.examples))] == list(from_corpus.examples)
    objective_fn, vocab = batch_objective(config), vocab_of(from_shards.tokenizer)
    indices = list(range(0, len(from_corpus.examples), 7))[:12]
    a = objective_fn([from_shards.examples[i] for i in indices], vocab, torch.Generator().manual_seed(3))
    b = objective_fn([from_corpus.examples[i] for i in indices], vocab, torch.Generator().manual_seed(3))
    for name, value in vars(a).items():
        assert value is None or torch.equal(value, getattr(b, name)), name


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_training_from_shards_equals_training_from_the_corpus(tmp_path: Path) -> None:
    path = recipe(tmp_path, write_corpus(tmp_path, "text", "text"), "clm", pack=True)
    prepare(path)
    shards = Trainer(*load_recipe(path))
    shards.fit()
    raw_run = tmp_path / "raw"  # the same tokenizer, so that the ids agree
    raw_run.mkdir()
    shutil.copy(tmp_path / "shards" / "tokenizer.json", raw_run / "tokenizer.json")
    raw = Trainer(*load_recipe(path, ["train.prepared=null", f"train.out_dir={raw_run}"]))
    raw.fit()
    assert losses(shards.run_dir) == losses(raw_run)  # bit for bit: the same batches in the same order
    assert all(torch.equal(a, b) for a, b in zip(weights(shards).values(), weights(raw).values(), strict=True))


def test_resume_mid_epoch_continues_with_the_exact_next_batch(tmp_path: Path) -> None:
    path = recipe(tmp_path, write_corpus(tmp_path, "pairs", "tsv"), "seq2seq", max_steps=6, save_every=3)
    prepare(path)

    def recorded(trainer: Trainer) -> list[list[int]]:
        seen, batch = [], trainer._batch
        trainer._batch = lambda indices, micro_step: seen.append(list(indices)) or batch(indices, micro_step)
        trainer.fit()
        return seen

    straight = recorded(Trainer(*load_recipe(path, [f"train.out_dir={tmp_path / 'straight'}"])))
    cut = tmp_path / "cut"  # the run as a kill after its step-3 checkpoint leaves it
    shutil.copytree(tmp_path / "straight", cut)
    shutil.rmtree(checkpoint_dir(cut, 6))
    resumed = Trainer(*load_recipe(path, [f"train.out_dir={cut}"]))
    assert resumed.step == 3 and 6 < len(resumed.sampler), "the cut must fall inside the first epoch"
    assert recorded(resumed) == straight[3:]
    assert losses(cut) == losses(tmp_path / "straight")


def test_a_two_rank_run_on_shards_resumes_in_one_process_at_its_position(tmp_path: Path) -> None:
    """DDP on 2 ranks takes the global batches of each step between them; its checkpoint's data position, resumed in
    one process, continues with the global batch that a one-process run takes next: the same losses."""
    from helpers import run_processes, torchrun

    path = recipe(tmp_path, write_corpus(tmp_path, "text", "text"), "clm", pack=True, grad_accum=2, max_steps=4)
    prepare(path)

    def train(out: Path, nproc: int, *overrides: str) -> None:
        args = ["-m", "tformer", "train", str(path), f"train.out_dir={out}", *overrides]
        import sys

        result = run_processes([sys.executable, *args] if nproc == 1 else torchrun(nproc, *args))
        assert result.returncode == 0, result.stderr[-3000:]

    train(tmp_path / "one", 1)
    train(tmp_path / "two", 2, "train.max_steps=2", "train.save_every=2")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    train(resumed, 1)
    assert steps(resumed)[-1] == 4
    expected, got = losses(tmp_path / "one"), losses(resumed)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # 1-2 on two ranks, 3-4 resumed in one process
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


# ---- memory: the reader and the writer never hold the corpus -------------------------------------------------------


def peak_traced(fn) -> int:  # noqa: ANN001
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    """Python's and numpy's peak allocations (tracemalloc) while preparing, in this process, and while reading
    every packed block back: the same for a corpus 8 times larger, and far below its size. The tokenizer's own
    allocations (Rust) are not traced; benchmarks/prepare_large.py measures whole processes."""
    peaks = {}
    for copies in (2, 16):
        directory = tmp_path / f"x{copies}"
        corpus = write_corpus(directory, "text", "text")
        corpus.write_text(corpus.read_text() * copies)
        path = recipe(directory, corpus, "clm", pack=True, max_len=64)
        prepare_peak = peak_traced(
            lambda p=path: prepare(p, workers=1, chunk_bytes=4096, shard_tokens=10**9, sample=16_384)
        )
        _, config = load_recipe(path)
        data = prepare_data(config, directory / "run")

        def read_all(examples=data.examples) -> None:  # noqa: ANN001
            for i in range(len(examples)):
                examples[i]

        peaks[copies] = (prepare_peak, peak_traced(read_all), corpus.stat().st_size, len(data.examples))
    (small_prepare, small_read, _, _), (large_prepare, large_read, large_size, blocks) = peaks[2], peaks[16]
    assert blocks > 1000, peaks
    assert large_prepare < 1.5 * small_prepare + 50_000 and large_prepare < large_size / 4, peaks
    assert large_read < 1.5 * small_read + 10_000 and large_read < large_size / 20, peaks


# ---- an interrupted prepare ------------------------------------------------------------------------------------------


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix in (".bin", ".idx", ".json")}


def test_an_interrupted_prepare_continues_to_the_same_shards(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "data", "text", "text")
    straight = recipe(tmp_path / "a", corpus, "clm")
    prepare(straight)
    cut = recipe(tmp_path / "b", corpus, "clm")
    assert prepare(cut, time_budget=1e-9) is None  # stops after its first chunk
    work = partial_dir(tmp_path / "b" / "shards")
    with pytest.raises(DataError, match="interrupted prepare: run `tformer prepare` again"):
        ShardedCorpus(tmp_path / "b" / "shards")
    progress = json.loads((work / "progress.json").read_text())
    assert 0 < progress["position"] < corpus.stat().st_size
    with open(work / f"shard-{len(progress['shards']):05d}.bin", "ab") as f:  # appended after the record, killed
        f.write(b"\x07" * 10)
    prepare(cut)
    assert not work.exists()
    assert shard_bytes(tmp_path / "a" / "shards") == shard_bytes(tmp_path / "b" / "shards")


def test_the_command_prepares_once_and_trains(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    path = recipe(tmp_path, write_corpus(tmp_path, "text", "text"), "clm", pack=True, max_steps=2)
    assert main(["prepare", str(path), "--sample-mb", "0.1", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "training the tokenizer on 0.1 MB" in out and "prepared 400 documents" in out
    manifest = json.loads((tmp_path / "shards" / MANIFEST_NAME).read_text())
    assert manifest["settings"]["sample_bytes"] == int(0.1 * 2**20) and manifest["examples"] == 400
    assert main(["prepare", str(path), "--sample-mb", "0.1"]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert main(["train", str(path)]) == 0


# ---- bad input ---------------------------------------------------------------------------------------------------


def test_bad_corpora_are_named_with_their_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such corpus file"):
        CorpusFile.of(tmp_path / "missing.txt", "text")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="the corpus file is empty"):
        CorpusFile.of(tmp_path / "empty.txt", "text")
    lines = [f"{s}\t{t}" for s, t in PAIRS]
    lines[250] = "one\ttab\ttoo many"  # in a late chunk, tokenized by a worker: its line number must be exact
    (tmp_path / "bad.tsv").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad.tsv:251: expected exactly one tab between source and target, found 2"):
        prepare(recipe(tmp_path / "t", tmp_path / "bad.tsv", "seq2seq"))
    text = "\n".join(LINES).encode()
    (tmp_path / "latin1.txt").write_bytes(text + b"\nna\xefve\n")
    with pytest.raises(DataError, match=rf"latin1.txt:{len(LINES) + 1}: bytes that are not UTF-8 at column 3"):
        prepare(recipe(tmp_path / "u", tmp_path / "latin1.txt", "clm"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: object has no key 'text'"):
        prepare(recipe(tmp_path / "j", tmp_path / "bad.jsonl", "clm"), workers=1)


def test_damaged_or_mismatched_shards_are_refused(tmp_path: Path) -> None:
    path = recipe(tmp_path, write_corpus(tmp_path, "text", "text"), "clm")
    with pytest.raises(DataError, match=r"not a finished prepared corpus \(no manifest.json\): run `tformer prepare"):
        ShardedCorpus(tmp_path / "shards")
    prepare(path)
    _, config = load_recipe(path)
    # a run whose tokenizer is another one: the ids would mean other text
    other = tmp_path / "other-run"
    Tokenizer.train(LINES[:100], 280).save(other)
    with pytest.raises(DataError, match="is not the tokenizer .* was prepared with"):
        prepare_data(config, other)
    _, pairs = load_recipe(path, ["train.objective=seq2seq", "model.preset=tiny-transformer"])
    with pytest.raises(DataError, match="holds text but objective 'seq2seq' trains on pairs"):
        prepare_data(pairs, tmp_path / "r2")
    _, bigger = load_recipe(path, ["train.vocab_size=500"])
    with pytest.raises(DataError, match="prepared with vocab_size 300, the recipe asks for 500"):
        prepare_data(bigger, tmp_path / "r3")
    shard = tmp_path / "shards" / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"shard-00001.bin: .* bytes but the manifest says .*damaged"):
        ShardedCorpus(tmp_path / "shards")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="exists and is not a prepared corpus"):
        prepare(path, f"train.prepared={tmp_path / 'taken'}")


def test_the_command_refuses_what_it_cannot_prepare(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    corpus = write_corpus(tmp_path, "text", "text")
    path = recipe(tmp_path, corpus, "clm")
    for overrides, message in [
        (["train.prepared=null"], "set train.prepared"),
        (["train.corpus=bible:en-de"], "reads one corpus file"),
        ([f"train.corpus={tmp_path / 'no.txt'}"], "no such corpus file"),
    ]:
        assert main(["prepare", str(path), *overrides]) == 2
        assert message in capsys.readouterr().err
    if not _has_pyarrow():
        (tmp_path / "c.parquet").write_bytes(b"PAR1")  # pyarrow is an optional extra
        assert main(["prepare", str(path), f"train.corpus={tmp_path / 'c.parquet'}"]) == 2
        assert "reading Parquet needs pyarrow" in capsys.readouterr().err


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


# ---- the sampler's cut -------------------------------------------------------------------------------------------


def greedy_cut(lengths: list[int], order: list[int], max_tokens: int, max_sentences: int | None) -> list[list[int]]:
    """The greedy loop the sampler's cut replaced: add examples while the padded batch fits."""
    batches, batch, longest = [], [], 0
    for i in order:
        full = max_sentences is not None and len(batch) >= max_sentences
        if batch and (full or (len(batch) + 1) * max(longest, lengths[i]) > max_tokens):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, lengths[i])
    return [*batches, batch]


@pytest.mark.parametrize("max_sentences", [None, 3])
def test_the_sampler_cuts_as_the_greedy_loop(max_sentences: int | None) -> None:
    from tformer.data import TokenBatchSampler

    rng = np.random.default_rng(0)
    for n, spread in ((1, 5), (500, 3), (2000, 60), (3000, 1)):
        lengths = rng.integers(1, 1 + spread, n).tolist()
        sampler = TokenBatchSampler(lengths, 64, seed=1, max_sentences=max_sentences)
        epoch_rng = np.random.default_rng([1, 0])
        permuted = epoch_rng.permutation(n)
        order = permuted[np.argsort(np.asarray(lengths)[permuted], kind="stable")].tolist()
        cut = greedy_cut(lengths, order, 64, max_sentences)
        expected = [cut[j] for j in epoch_rng.permutation(len(cut)).tolist()]
        assert sampler.global_batches(0) == expected
        plain = TokenBatchSampler(lengths, 64, shuffle=False, max_sentences=max_sentences)
        assert plain.batches(0) == greedy_cut(lengths, np.argsort(lengths, kind="stable").tolist(), 64, max_sentences)
        assert len(plain) == len(plain.batches(0))
