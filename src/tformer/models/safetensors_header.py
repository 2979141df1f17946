"""The header of a safetensors file, checked field by field before the file is opened.

The safetensors library refuses a malformed header too, but its message names neither the tensor nor the field
("invalid shape, data type, or offset for tensor"). A file from elsewhere (a Hugging Face directory, a copied
checkpoint) gets a CheckpointError here that names the file, the tensor and the field that is wrong.

The format: 8 bytes, the little-endian length N of a JSON header; N bytes of JSON, an object mapping each tensor
name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data after the header), plus an
optional "__metadata__" object of strings; then the data, every byte of it belonging to exactly one tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tformer.errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}


def check_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file declares ({name: {"dtype", "shape", "data_offsets"}}), after checking every
    field of its header against the file; a CheckpointError naming the file and the field otherwise."""
    size = path.stat().st_size
    if size < 8:
        raise _bad(path, f"{size} bytes is too short for a safetensors file (an 8-byte header length comes first)")
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > MAX_HEADER_BYTES:
            raise _bad(path, f"the header length field says {length:,} bytes, over safetensors' {MAX_HEADER_BYTES:,}")
        if 8 + length > size:
            raise _bad(path, f"the header length field says {length:,} bytes, but only {size - 8:,} follow it")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise _bad(path, f"the header is not JSON ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"the header is a JSON {type(header).__name__}, not an object of tensors")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, "__metadata__ must be an object whose values are strings")
    data_bytes = size - 8 - length
    for name, entry in header.items():
        _check_tensor(path, name, entry, data_bytes)
    _check_coverage(path, header, data_bytes)
    return header


def _check_tensor(path: Path, name: str, entry: Any, data_bytes: int) -> None:
    if not isinstance(entry, dict):
        raise _bad(path, f"tensor '{name}' is a JSON {type(entry).__name__}, not an object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise _bad(path, f"tensor '{name}' has no '{field}' field")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise _bad(path, f"tensor '{name}': dtype {dtype!r} is not a safetensors dtype ({', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise _bad(path, f"tensor '{name}': shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)):
        raise _bad(path, f"tensor '{name}': data_offsets {offsets!r} is not [begin, end] in bytes")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise _bad(path, f"tensor '{name}': data_offsets {offsets} lie outside the {data_bytes:,} bytes of data")
    bits = math.prod(shape) * DTYPE_BITS[dtype]  # Python integers: no overflow, however large the shape
    if bits != 8 * (end - begin):
        raise _bad(
            path,
            f"tensor '{name}': data_offsets span {end - begin:,} bytes, but shape {shape} of {dtype} needs "
            f"{bits / 8:,g}",
        )


def _check_coverage(path: Path, header: dict[str, dict[str, Any]], data_bytes: int) -> None:
    """Every byte of the data belongs to exactly one tensor (as the safetensors library requires)."""
    position, previous = 0, None
    for name, entry in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, end = entry["data_offsets"]
        if begin < position:
            raise _bad(path, f"tensors '{previous}' and '{name}' overlap (data_offsets {entry['data_offsets']})")
        if begin > position:
            raise _bad(path, f"data bytes {position:,} to {begin:,} belong to no tensor (before '{name}')")
        position, previous = end, name
    if position != data_bytes:
        raise _bad(path, f"data bytes {position:,} to {data_bytes:,} belong to no tensor")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: not a readable safetensors file ({what}); it may be truncated or corrupt, so copy or export it again"
    )
