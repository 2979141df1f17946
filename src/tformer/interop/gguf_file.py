"""A fast reader of GGUF files: metadata, tensor table and memory-mapped tensor bytes, dequantized in torch.

The `gguf` package's reader turns every metadata string into a numpy view, slow to open a file with a large
vocabulary. This reader parses the header with `struct`, far faster (docs/design-notes.md, "interop/gguf_file.py"),
and dequantizes the common block formats (the K-quants too) with vectorized torch ops, bit for bit as `gguf.quants`
does (`gguf_quants`; the tests compare the two). Other block formats go through `gguf.quants`.

Layout (little-endian, GGUF v2 and v3): magic, version u32, tensor count u64, metadata count u64; metadata as
(key string, value type u32, value); tensor infos as (name, n_dims u32, dims u64 innermost first, type u32,
offset u64); then the tensor data, aligned to `general.alignment` (32 by default).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from tformer.interop.gguf_quants import DEQUANTIZERS

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # arrays of arrays: llama.cpp writes none; a deeper nesting is corruption, not data
# GGUF metadata value type -> struct format of one scalar
SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
NUMPY_TYPES: dict[int, str] = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
STRING, ARRAY = 8, 9


class Truncated(Exception):
    """A read past the end of the file: bytes start..end were needed."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__(start, end)
        self.start, self.end = start, end


class Malformed(Exception):
    """The header holds something no valid GGUF file holds (an unknown value type, an unsupported version)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its shape as GGUF lists it (innermost dimension first) and where its bytes are."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    start: int  # byte offset in the file
    n_bytes: int

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape in PyTorch's order, outermost dimension first."""
        return tuple(reversed(self.shape))


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.offset = buffer, 0

    def take(self, size: int) -> memoryview:
        start, end = self.offset, self.offset + size
        if end > len(self.buffer):
            raise Truncated(start, end)
        self.offset = end
        return self.buffer[start:end]

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in SCALARS:
            return self.scalar(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise Malformed(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in NUMPY_TYPES:
                dtype = np.dtype(NUMPY_TYPES[item_kind])
                return np.frombuffer(self.take(dtype.itemsize * count), dtype).tolist()
            return [self.value(item_kind, depth + 1) for _ in range(count)]
        raise Malformed(f"unknown value type {kind} at byte {self.offset}")


class GGUFFile:
    """The metadata (`fields`), tensor table (`tensors`) and memory-mapped bytes of one GGUF file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        buffer = memoryview(self._map if self._map is not None else b"")
        cursor = _Cursor(buffer)
        if bytes(cursor.take(4)) != GGUF_MAGIC:
            raise Malformed("the magic is missing")
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise Malformed(
                f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as a huge version)"
            )
        n_tensors, n_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cursor.string()
            try:
                self.fields[key] = cursor.value(cursor.scalar("<I"))
            except Malformed as err:
                raise Malformed(f"metadata {key!r}: {err}") from None
        infos = [self._tensor_info(cursor) for _ in range(n_tensors)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment < 1
            or alignment & (alignment - 1)
        ):
            raise Malformed(f"metadata 'general.alignment' is {alignment!r}; it must be a power of two (32 by default)")
        data_start = -(-cursor.offset // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, shape, kind, offset in infos:
            tensor_type = GGMLQuantizationType(kind)
            if tensor_type not in GGML_QUANT_SIZES:
                raise Malformed(f"tensor {name!r} has type {tensor_type.name}, which no longer has a block layout")
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            count = math.prod(shape)  # Python integers: a product past 64 bits is caught here, not wrapped
            if count >= 1 << 63 or (shape and shape[0] % block):
                raise Malformed(
                    f"tensor {name!r} has shape {list(shape)} (innermost first): "
                    + ("more values than 64 bits count" if count >= 1 << 63 else f"rows of whole {block}-value blocks")
                    + f" are needed for {tensor_type.name}"
                )
            start = data_start + offset
            n_bytes = count // block * block_bytes
            if start + n_bytes > size:
                raise Truncated(start, start + n_bytes)
            self.tensors.append(TensorInfo(name, shape, tensor_type, start, n_bytes))

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string()
        n_dims = cursor.scalar("<I")
        if n_dims > MAX_DIMS:
            raise Malformed(f"tensor {name!r} has {n_dims} dimensions; ggml tensors have at most {MAX_DIMS}")
        shape = tuple(cursor.scalar("<Q") for _ in range(n_dims))
        kind, offset = cursor.scalar("<I"), cursor.scalar("<Q")
        if kind not in GGMLQuantizationType._value2member_map_:
            raise Malformed(f"tensor {name} has unknown type {kind}")
        return name, shape, kind, offset

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (a number, string, bool or list), or `default` when absent."""
        return self.fields.get(key, default)

    def raw(self, tensor: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor over the file's private mapping (nothing is copied)."""
        return torch.frombuffer(self._map, dtype=torch.uint8, count=tensor.n_bytes, offset=tensor.start)

    def dequantize(self, tensor: TensorInfo) -> torch.Tensor:
        """The tensor as float32 in PyTorch's dimension order."""
        raw = self.raw(tensor)
        kind = tensor.tensor_type
        if kind in DEQUANTIZERS:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            values = DEQUANTIZERS[kind](raw.view(-1, block_bytes))
        else:
            values = torch.from_numpy(gguf_dequantize(raw.numpy(), kind).astype(np.float32, copy=False))
        return values.reshape(tensor.torch_shape)
