"""Labelled data for sequence classification: the genre of a Bible verse's book, and the user's labelled files.

`bible:genre` labels every World English Bible verse with the genre of its book, one of GENRES:

    law        Genesis - Deuteronomy (1-5)
    history    Joshua - Esther (6-17) and Acts (44)
    wisdom     Job - Song of Solomon (18-22)
    prophets   Isaiah - Malachi (23-39) and Revelation (66)
    gospels    Matthew - John (40-43)
    letters    Romans - Jude (45-65)

Whole books are held out, one per genre for dev and one for test, so that a model must recognise a genre in a
book it never saw, not memorise a book's names and phrases:

    dev     Numbers (4), Judges (7), Ecclesiastes (21), Amos (30), Mark (41), Galatians (48)       3,101 verses
    test    Deuteronomy (5), 1 Samuel (9), Proverbs (20), Isaiah (23), John (43), Romans (45)    5,288 verses
    train   the other 54 books                                                                 22,713 verses

The dev and test verses come in a fixed shuffled order, so that their first n (the trainer's `eval_sentences`)
hold every genre. A user's labelled file is TSV (`text<TAB>label`) or JSONL (`{"src": text, "tgt": label}`),
with labels as class ids 0, 1, ...
"""

from __future__ import annotations

import random
import sqlite3
from contextlib import closing
from pathlib import Path

from tformer.data.corpora import ENGLISH, bible_db_path, clean_verse
from tformer.data.readers import DataError, read_parallel
from tformer.data.tokenizer import Tokenizer

GENRE_CORPUS = "bible:genre"
GENRES = ("law", "history", "wisdom", "prophets", "gospels", "letters")
_GENRE_BOOKS: dict[str, tuple[int, ...]] = {
    "law": tuple(range(1, 6)),
    "history": (*range(6, 18), 44),
    "wisdom": tuple(range(18, 23)),
    "prophets": (*range(23, 40), 66),
    "gospels": tuple(range(40, 44)),
    "letters": tuple(range(45, 66)),
}
BOOK_GENRE: dict[int, int] = {book: GENRES.index(genre) for genre, books in _GENRE_BOOKS.items() for book in books}
GENRE_SPLIT_BOOKS: dict[str, frozenset[int]] = {
    "dev": frozenset({4, 7, 21, 30, 41, 48}),
    "test": frozenset({5, 9, 20, 23, 43, 45}),
}
SHUFFLE_SEED = 0

Labelled = list[tuple[str, int]]  # (text, class id)


def genre_split_of(book: int) -> str:
    """The split ("train", "dev" or "test") of a book in the genre task."""
    return next((split for split, books in GENRE_SPLIT_BOOKS.items() if book in books), "train")


def bible_genres(split: str = "train") -> Labelled:
    """(verse, genre id) pairs of one split: train in canonical order, dev and test in a fixed shuffled order."""
    if split not in ("train", "dev", "test"):
        raise DataError(f"unknown split {split!r}; choose one of train, dev, test")
    query = "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ? ORDER BY bNumber, cNumber, vNumber"
    with closing(sqlite3.connect(f"{bible_db_path().as_uri()}?mode=ro", uri=True)) as db:
        rows = db.execute(query, (ENGLISH,)).fetchall()
    examples = []
    for book, chapter, verse, text in rows:
        if genre_split_of(book) == split and (text := clean_verse(ENGLISH, (book, chapter, verse), text)):
            examples.append((text, BOOK_GENRE[book]))
    if split != "train":
        random.Random(SHUFFLE_SEED).shuffle(examples)
    return examples


def read_labelled(path: str | Path) -> Labelled:
    """(text, class id) pairs from a TSV or JSONL file; a label that is not a class id is a DataError."""
    examples = []
    for line, (text, label) in enumerate(read_parallel(path), start=1):
        if not label.strip().isdigit():
            raise DataError(
                f"{path}: example {line} has label {label!r}; labels must be class ids 0, 1, ... "
                "(map the label names to ids and keep the names in model.label_names)"
            )
        examples.append((text, int(label)))
    return examples


def labelled_split(corpus: str, split: str, dev_corpus: str | None = None) -> Labelled:
    """The examples of `split` for a classification corpus: `bible:genre`, or a file (train) and `dev_corpus`."""
    if corpus == GENRE_CORPUS:
        return bible_genres(split)
    if corpus.startswith("bible:"):
        raise DataError(f"corpus {corpus} has no labels; the labelled embedded corpus is {GENRE_CORPUS}")
    if split == "test" or (split == "dev" and dev_corpus is None):
        return []
    path = corpus if split == "train" else dev_corpus
    if not Path(path).is_file():
        raise DataError(f"corpus {path} is not a file; use '{GENRE_CORPUS}' or a labelled TSV / JSONL file")
    return read_labelled(path)


def encode_labelled(tokenizer: Tokenizer, examples: Labelled) -> list[tuple[list[int], int]]:
    """(token ids without <s> and </s>, class id) for each example; the objective adds the special tokens."""
    encoded = tokenizer.encode_batch([text for text, _ in examples], add_bos=False)
    return [(ids, label) for ids, (_, label) in zip(encoded, examples, strict=True)]
