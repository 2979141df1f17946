"""Malformed GGUF headers, written byte by byte, give a CheckpointError naming the file and the field at fault
(issue 52 item 6), where they used to raise ZeroDivisionError, RecursionError or wrap a shape's size silently."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tformer.interop.gguf import from_gguf, open_gguf
from tformer.models import CheckpointError

UINT32, STRING, ARRAY, UINT64 = 4, 8, 9, 10
F32 = 0


def gguf_bytes(fields: list[bytes], tensors: list[bytes], data: bytes = b"") -> bytes:
    """A GGUF v3 file: header, the given encoded metadata and tensor infos, padding to 32, then `data`."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields)) + b"".join(fields) + b"".join(tensors)
    return head + b"\0" * (-len(head) % 32) + data


def text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<Q", len(raw)) + raw


def field(key: str, kind: int, value: bytes) -> bytes:
    return text(key) + struct.pack("<I", kind) + value


def tensor(name: str, shape: tuple[int, ...], kind: int = F32, offset: int = 0) -> bytes:
    return (
        text(name)
        + struct.pack("<I", len(shape))
        + struct.pack(f"<{len(shape)}Q", *shape)
        + struct.pack("<IQ", kind, offset)
    )


def write(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_a_well_formed_hand_written_file_reads(tmp_path: Path) -> None:
    """The writer above is right: the same bytes with sane values read back (the cases below differ in one field)."""
    content = gguf_bytes(
        [field("general.alignment", UINT32, struct.pack("<I", 32))],
        [tensor("w", (4, 2))],
        struct.pack("<8f", *range(8)),
    )
    reader = open_gguf(write(tmp_path, "good.gguf", content))
    assert reader.fields == {"general.alignment": 32}
    assert reader.dequantize(reader.tensors[0]).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_alignment_that_is_not_a_power_of_two(tmp_path: Path, alignment: int) -> None:
    content = gguf_bytes([field("general.alignment", UINT32, struct.pack("<I", alignment))], [tensor("w", (4,))])
    path = write(tmp_path, "align.gguf", content + b"\0" * 16)
    with pytest.raises(CheckpointError, match=rf"align\.gguf: .*'general\.alignment' is {alignment}; it must be a"):
        from_gguf(path)


def test_nested_arrays_are_refused_without_recursing(tmp_path: Path) -> None:
    depth = 100_000  # deep enough to exhaust Python's recursion limit many times over
    nested = struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", UINT32, 0)
    path = write(tmp_path, "nested.gguf", gguf_bytes([field("tokenizer.ggml.deep", ARRAY, nested)], []))
    with pytest.raises(CheckpointError, match=r"nested\.gguf: .*metadata 'tokenizer\.ggml\.deep': arrays nested more"):
        open_gguf(path)


def test_shape_whose_size_overflows_int64(tmp_path: Path) -> None:
    path = write(tmp_path, "huge.gguf", gguf_bytes([], [tensor("blk.0.attn_q.weight", (1 << 40, 1 << 40))]))
    with pytest.raises(
        CheckpointError, match=r"huge\.gguf: .*tensor 'blk\.0\.attn_q\.weight' has shape \[1099511627776"
    ):
        open_gguf(path)


def test_too_many_dimensions_and_partial_blocks(tmp_path: Path) -> None:
    path = write(tmp_path, "dims.gguf", gguf_bytes([], [tensor("w", (1, 1, 1, 1, 1))]))
    with pytest.raises(CheckpointError, match=r"dims\.gguf: .*tensor 'w' has 5 dimensions"):
        open_gguf(path)
    q8_0 = 8
    path = write(tmp_path, "rows.gguf", gguf_bytes([], [tensor("w", (48, 2), kind=q8_0)], b"\0" * 256))
    with pytest.raises(CheckpointError, match=r"rows\.gguf: .*tensor 'w' has shape \[48, 2\].*32-value blocks"):
        open_gguf(path)


def test_unknown_metadata_value_type_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "kind.gguf", gguf_bytes([field("general.name", 13, b"")], []))
    with pytest.raises(CheckpointError, match=r"kind\.gguf: .*metadata 'general\.name': unknown value type 13"):
        open_gguf(path)
