"""The weight files of a Hugging Face model directory: model.safetensors or its shards, read by tensor name.

Pickled checkpoints (pytorch_model.bin) are refused with a message saying how to convert them: unpickling can run
arbitrary code. Every file's header is checked field by field before it is opened, and an index may name only
shards inside its own directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tformer.models import CheckpointError
from tformer.models.safetensors_header import check_safetensors_header

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class Weights:
    """Read access, by name, to the tensors of the safetensors file(s) of a checkpoint directory."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        self.file_of: dict[str, Path] = {}
        self._handles: dict[str, Any] = {}
        for file in files:
            check_safetensors_header(file)
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt"))
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{file}: {_unreadable(err)}") from None
            for name in handle.keys():
                if name in self.file_of:
                    raise CheckpointError(f"{file}: tensor {name} is also in {self.file_of[name]}; remove one copy")
                self.file_of[name], self._handles[name] = file, handle
        self.names = set(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[name].get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{self.file_of[name]}: cannot read tensor {name}: {_unreadable(err)}") from None


@contextmanager
def open_weights(path: Path) -> Iterator[Weights]:
    """The checkpoint's tensors, with every file open until the block ends."""
    with ExitStack() as stack:
        yield Weights(weight_files(path), stack)


def weight_files(path: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists; pickled checkpoints are refused."""
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    if (path / WEIGHTS_INDEX).is_file():
        return _shards(path / WEIGHTS_INDEX)
    pickled = [name for name in PICKLED if (path / name).is_file()]
    if pickled:
        raise CheckpointError(
            f"{path / pickled[0]} is a pickled PyTorch checkpoint, and tformer never unpickles files (loading one can "
            f"run arbitrary code); convert it to {WEIGHTS} first, e.g. in a trusted environment with transformers: "
            f"AutoModel.from_pretrained(dir).save_pretrained(dir) writes safetensors"
        )
    raise CheckpointError(f"{path} has no {WEIGHTS} or {WEIGHTS_INDEX}; put the model's safetensors weights there")


def _shards(index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{index}: not JSON ({type(err).__name__}: {err}); copy the model again") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index}: not a safetensors index: its weight_map field (an object from tensor names to shard files) is "
            f"{'missing' if weight_map is None else 'a ' + type(weight_map).__name__}; copy the model again"
        )
    for tensor, name in weight_map.items():
        _check_shard_name(index, tensor, name)
    names = sorted(set(weight_map.values()))
    missing = [name for name in names if not (index.parent / name).is_file()]
    if missing:
        raise CheckpointError(f"{index} lists shards that are not in {index.parent}: {listed(missing)}; copy them")
    return [index.parent / name for name in names]


def _check_shard_name(index: Path, tensor: str, name: object) -> None:
    """A shard is a relative path inside the index's directory: no absolute path, no '..', no backslash."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index}: weight_map[{tensor!r}] is {name!r}, not the file name of a shard")
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name or ":" in name:
        raise CheckpointError(
            f"{index}: weight_map[{tensor!r}] names {name!r}, outside the model directory; a shard must be a file "
            "in the directory of the index"
        )


def _unreadable(err: Exception) -> str:
    return f"not a readable safetensors file ({err}); it may be truncated or corrupt, so copy or export it again"


def listed(names: list[str], limit: int = 8) -> str:
    if not names:
        return "nothing"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
