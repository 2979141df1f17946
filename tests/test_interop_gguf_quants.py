"""tformer's vectorized dequantizers (interop/gguf_quants.py) against `gguf.quants.dequantize`, bit for bit.

Types gguf-py can quantize are quantized from random floats; for the K-quants (gguf-py only dequantizes them)
random raw blocks are made, with their f16 scales set to finite values, so every bit pattern of the quants,
packed scales and minimums occurs.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tformer.interop.gguf import dequantize_tensor, open_gguf
from tformer.interop.gguf_quants import DEQUANTIZERS

QUANTIZABLE = (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# K-quant -> byte offsets of its f16 fields (the rest of a block is any bit pattern)
F16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(kind: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks: random bytes, with each f16 scale a finite value of either sign and many magnitudes."""
    _, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for start in F16_FIELDS[kind]:
        scale = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-4, 1, n_blocks)).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("kind", QUANTIZABLE, ids=lambda k: k.name)
def test_quantized_blocks_dequantize_as_gguf_does(kind: Q) -> None:
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((64, 512)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block: scale 0
    raw = gguf.quants.quantize(values, kind)
    expected = gguf.quants.dequantize(raw, kind).astype(np.float32).reshape(-1)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block_bytes))
    got = DEQUANTIZERS[kind](blocks).reshape(-1)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(expected))


@pytest.mark.parametrize("kind", list(F16_FIELDS), ids=lambda k: k.name)
def test_k_quant_blocks_dequantize_as_gguf_does(kind: Q) -> None:
    blocks = random_blocks(kind, 2048, np.random.default_rng(int(kind)))
    expected = gguf.quants.dequantize(blocks, kind).astype(np.float32)
    got = DEQUANTIZERS[kind](torch.from_numpy(blocks))
    assert got.shape == (2048, 256)
    assert torch.equal(got.reshape(expected.shape), torch.from_numpy(expected))


@pytest.mark.parametrize("kind", list(F16_FIELDS), ids=lambda k: k.name)
def test_k_quant_tensor_in_a_file_reads_as_gguf_does(kind: Q, tmp_path: Path) -> None:
    """Through the file reader: a (rows, 512) tensor of K-quant blocks, as the gguf package reads it."""
    blocks = random_blocks(kind, 24 * 2, np.random.default_rng(1)).reshape(24, -1)
    writer = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    writer.add_tensor("w.weight", blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = gguf.GGUFReader(tmp_path / "k.gguf").tensors[0]
    expected = gguf.quants.dequantize(reference.data, kind).astype(np.float32)
    reader = open_gguf(tmp_path / "k.gguf")
    got = dequantize_tensor(reader, reader.tensors[0])
    assert tuple(got.shape) == (24, 512) == expected.shape
    assert torch.equal(got, torch.from_numpy(expected))
