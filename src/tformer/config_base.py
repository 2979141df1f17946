"""ConfigBase: typed dataclass configs read from and written to YAML or JSON, with errors that name the key."""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Self

import yaml

from tformer.errors import ConfigError
from tformer.files import read_mapping


class ConfigBase:
    """Typed dataclass fields with YAML/JSON round trips; subclasses validate in `__post_init__`.

    A file may hold this config at top level or under `section` (a recipe has `model:` and `train:`).
    """

    section = ""

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            allowed = _allowed_types(hints[f.name])
            if float in allowed and not isinstance(value, (bool, float)):
                value = _as_float(value)
                setattr(self, f.name, value)
            if not any(_is_instance(value, t) for t in allowed):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
                raise ConfigError(f"{f.name} must be {names}, got {value!r} ({type(value).__name__})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> Self:
        """Builds a config from plain data, naming `source` in errors about unknown keys."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of config keys, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                hint = difflib.get_close_matches(str(key), known, n=1)
                suggestion = f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(known)}"
                raise ConfigError(f"{source}: unknown config key '{key}'{suggestion}")
        try:
            return cls(**data)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        """Reads a YAML file, or JSON for a .json suffix."""
        data = read_config_file(path)
        if cls.section and isinstance(data.get(cls.section), dict):
            data = data[cls.section]
        return cls.from_dict(data, source=str(path))

    def to_file(self, path: str | Path) -> None:
        """Writes JSON for a .json suffix, YAML otherwise; the write is atomic."""
        path = Path(path)
        if path.suffix == ".json":
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML or JSON file, or a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    return read_mapping(path, ConfigError, "config keys")


def _is_instance(value: Any, kind: type) -> bool:
    if kind is type(None):
        return value is None
    if kind is int and isinstance(value, bool):
        return False
    if typing.get_origin(kind) is list:
        return isinstance(value, list)
    return isinstance(value, kind)


def _allowed_types(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _as_float(value: Any) -> Any:
    """Ints widen to float; so do strings like '1e-5', which YAML 1.1 (PyYAML) reads as text."""
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(value, choices, n=1)
        suggestion = f"did you mean '{hint[0]}'? " if hint else ""
        raise ConfigError(f"unknown {key} '{value}'; {suggestion}choose one of: {', '.join(choices)}")
