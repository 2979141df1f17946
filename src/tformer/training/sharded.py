"""Model and optimizer state as a torch.distributed.checkpoint (DCP) directory.

Each rank writes its own shards; a run resumes on any number of ranks (or alone), DCP re-slicing the saved
tensors to the new layout. A process training alone writes the same format, so its checkpoints resume on
several ranks too.

DCP's metadata file (`.metadata`) is a pickle. It is read here with an unpickler that builds only DCP's own
metadata classes, torch sizes and dtypes and plain containers, so a tampered checkpoint cannot run code;
the tensors themselves are raw bytes.
"""

from __future__ import annotations

import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tformer.models import CheckpointError

SHARDED_DIR = "sharded"
METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # its classes are plain dataclasses and enums
SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}
SAFE_GLOBALS |= {
    ("torch", str(dtype).removeprefix("torch."))
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == METADATA_MODULE:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == METADATA_MODULE:  # a class, not a function
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with a metadata unpickler restricted to DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as err:
            raise CheckpointError(f"{path}: not a readable DCP checkpoint: {err}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextmanager
def _quiet_when_alone() -> object:
    """DCP warns that it assumes a single process when no process group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Writes this rank's shards of the model and optimizer state under `path` (a collective on several ranks)."""
    model_state, optimizer_state = get_state_dict(module, optimizer)
    with _quiet_when_alone():
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            storage_writer=dcp.FileSystemWriter(path),
            no_dist=not dist.is_initialized(),
        )


def load_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Fills the (possibly sharded) model and optimizer from `path`, whatever world size wrote it."""
    model_state, optimizer_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        with _quiet_when_alone():
            dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # DCP gathers per-rank failures into a BaseException
        cause = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: cannot load the sharded training state: {cause}") from None
    kernels = [{k: group[k] for k in ("fused", "foreach") if k in group} for group in optimizer.param_groups]
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for group, kernel in zip(
        optimizer.param_groups, kernels, strict=True
    ):  # this run's kernel choice, not the saved one's
        group.update(kernel)
