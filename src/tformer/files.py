"""The small files tformer reads and writes beside its weights: config and tokenizer mappings, run records; and
where it caches what it builds on a machine (`cache_dir`).

A mapping is read with an error that names the file and says what is wrong; a file is written atomically, so
that a crash or a kill leaves the old file or the new one, never half of one. Atomic writes are also durable: the
new file's data reaches the disk (fsync) before the rename, and the rename itself (an fsync of the directory)
before they return, so that after a power cut the name never points to a file whose data was lost.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_mapping(path: Path, error: type[Exception], what: str, fix: str = "") -> dict[str, Any]:
    """The mapping a JSON file (or, unless the suffix is .json, a YAML file) holds; `error(message)` otherwise.

    `what` names the keys the file should hold; `fix` is appended to the message of a file that does not parse
    (how to get a good copy).
    """
    import yaml  # here, not at the top: a GGUF file or `tformer info` on a preset never reads YAML

    text = path.read_bytes()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text.decode("utf-8"))
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as err:
        kind = "JSON" if path.suffix == ".json" else "YAML/JSON"
        raise error(f"{path}: not valid {kind} ({err}){'; ' + fix if fix else ''}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping of {what}, got {type(data).__name__}")
    return data


def write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """Calls `write(tmp)` for a temporary path beside `target`, then renames it over `target`, durably: the data is
    on the disk before the rename, and the rename before this returns."""
    tmp = target.with_name(target.name + ".tmp")
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, target)
        fsync(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Writes `text` (UTF-8) to `path` atomically."""
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def fsync(path: Path) -> None:
    """Flushes a file's data, or a directory's entries (names created, renamed or removed in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """`fsync` on every file under `root`, then on every directory, deepest first, so that each name is on the
    disk with its data."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync(Path(directory) / name)
        fsync(Path(directory))


def replace_directory(work: Path, final: Path) -> None:
    """Gives the finished directory `work` the name `final`, durably: a directory already named `final` is renamed
    aside first and deleted only once `work` has taken its place, so a crash leaves one of the two whole."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(work, final)
    fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def cache_dir(name: str) -> Path:
    """tformer's cache for `name` on this machine (compiled kernels): $XDG_CACHE_HOME/tformer/NAME, else
    ~/.cache/tformer/NAME. Not created here."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tformer" / name
