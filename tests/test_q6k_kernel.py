"""The Q6_K kernel (`kernels/q6k.py`): its layout holds a GGUF file's Q6_K blocks bit for bit (against
`gguf.quants.dequantize`), its matmul equals the plain formula on the dequantized weights with activations rounded
as it rounds them, in its vectorized, AVX2 and portable builds, each row independent of the others, inside a
compiled graph, and bad input is a TformerError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tformer.errors import TformerError
from tformer.kernels import dispatch, native, q6k
from tformer.kernels.q6k import BLOCK_BYTES, Q6KLinear, q6k_formula, q6k_matmul

pytestmark = pytest.mark.skipif(q6k.kernel() is None, reason="no C++ compiler to build the Q6_K kernel with")


def blocks_of(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    """(out, in / 256 * 210) bytes of random Q6_K blocks: any byte is a valid quant or sub-scale; each block's
    fp16 d of a realistic magnitude (gguf-py has no Q6_K quantizer)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out_f * in_f // 256, BLOCK_BYTES), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.0, len(blocks)) * 2e-3).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(out_f, -1))


def reference(blocks: torch.Tensor, in_f: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q6_K)
    return torch.from_numpy(values.astype(np.float32)).reshape(-1, in_f)


@pytest.mark.parametrize("out_f,in_f", [(16, 256), (48, 512), (32, 768)])
def test_the_layout_keeps_the_files_blocks_bit_for_bit(out_f: int, in_f: int) -> None:
    blocks = blocks_of(out_f, in_f)
    layer = Q6KLinear.from_blocks(blocks, (out_f, in_f))
    assert layer.packed.shape == (out_f // 16, in_f // 256, 3360)
    assert layer.packed.numel() == blocks.numel()  # 3360 bytes a chunk of 16 x 256 weights: 16 blocks of 210
    expected = reference(blocks, in_f)
    assert torch.equal(layer.dequantized(), expected)
    ids = torch.tensor([[0, out_f - 1, 17 % out_f], [5, 5, out_f // 2]])
    assert torch.equal(layer.rows(ids), expected[ids])  # a tied embedding's lookup, from the rows' tiles alone


def test_from_blocks_in_pieces_packs_as_one_piece() -> None:
    """A layer packs about 4M weights at a time (small temporaries): 1024 rows of 8192 in two pieces of 512."""
    wide = blocks_of(1024, 8192, seed=1)
    pieces = Q6KLinear.from_blocks(wide, (1024, 8192))
    assert torch.equal(pieces.packed[32:], Q6KLinear.from_blocks(wide[512:], (512, 8192)).packed)
    assert torch.equal(pieces.rows(torch.tensor([3, 700])), reference(wide[[3, 700]], 8192))


@pytest.mark.parametrize("portable", [False, True], ids=["vectorized", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,in_f,out_f", [(1, 256, 16), (3, 512, 48), (4, 768, 32), (9, 512, 32), (20, 256, 16)])
def test_kernel_matches_the_formula(m: int, in_f: int, out_f: int, dtype: torch.dtype, portable: bool) -> None:
    """Token counts below and above the ones the VNNI loop takes 4 at a time and from which it unpacks each tile
    once (8). Activations spread over 4 orders of magnitude between rows."""
    layer = Q6KLinear.from_blocks(blocks_of(out_f, in_f), (out_f, in_f))
    x = (torch.randn(m, in_f, generator=torch.Generator().manual_seed(m)) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    out = q6k_matmul(x, layer.packed, portable)
    assert out.dtype == dtype and out.shape == (m, out_f)
    expected = q6k_formula(x, layer.packed)
    scale = expected.abs().amax(1, keepdim=True)
    if dtype == torch.float32:  # exact integer sums per super-block, times fp32 scales added in fp32
        assert ((out.double() - expected).abs() <= 1e-6 * scale).all()
    else:  # and bf16 rounds the result once
        assert ((out.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-6 * scale).all()


def test_vectorized_and_portable_loops_give_the_same_numbers_and_rows_are_independent() -> None:
    layer = Q6KLinear.from_blocks(blocks_of(64, 1024), (64, 1024))
    x = torch.randn(13, 1024)
    out = q6k_matmul(x, layer.packed)
    assert torch.equal(out, q6k_matmul(x, layer.packed, portable=True))
    for row in range(13):  # one token alone, through the loop for few tokens; 13 through the unpacked tiles
        assert torch.equal(q6k_matmul(x[row : row + 1], layer.packed), out[row : row + 1])
    assert torch.equal(q6k_matmul(x[2:7], layer.packed), out[2:7])


def test_the_layer_is_close_to_the_float_linear_with_its_bias_and_fused_rows() -> None:
    """Against F.linear on the dequantized weight: the activations' two int8 steps keep the error to 1e-4 of the
    largest output (measured 2.7e-5 here, as INT4's two steps give 7e-5); a wrong layout or scale is O(1)."""
    blocks = blocks_of(48, 512)
    bias = torch.randn(48)
    layer = Q6KLinear.from_blocks(blocks, (48, 512), bias)
    x = torch.randn(2, 3, 512)
    expected = torch.nn.functional.linear(x, reference(blocks, 512), bias)
    out = layer(x)
    assert out.shape == (2, 3, 48)
    assert (out - expected).abs().max() <= 1e-4 * expected.abs().max()
    with dispatch.portable_kernels():  # off the x86 kernels: the dequantized weight, one matmul
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    other = Q6KLinear.from_blocks(blocks_of(32, 512, seed=2), (32, 512), torch.randn(32))
    fused = Q6KLinear.concatenated([layer, other])
    assert torch.equal(fused(x), torch.cat([layer(x), other(x)], -1))


def test_the_layer_runs_inside_a_compiled_graph() -> None:
    layer = Q6KLinear.from_blocks(blocks_of(32, 512), (32, 512))
    x = torch.randn(3, 512)
    compiled = torch.compile(lambda t: layer(t) * 2, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x), layer(x) * 2)


def test_bad_input_is_a_clear_error() -> None:
    blocks = blocks_of(32, 512)
    with pytest.raises(TformerError, match=r"out_features a multiple of 16, in_features of 256"):
        Q6KLinear.from_blocks(blocks[:24], (24, 512))
    with pytest.raises(TformerError, match=r"blk.3.ffn_down.weight: .* got shape \[32, 500\]"):
        Q6KLinear.from_blocks(blocks, (32, 500), name="blk.3.ffn_down.weight")
    with pytest.raises(TformerError, match=r"got shape \[32, 512\] and blocks \[32, 419\]"):
        Q6KLinear.from_blocks(blocks[:, :419], (32, 512))
    layer = Q6KLinear.from_blocks(blocks, (32, 512))
    with pytest.raises(TformerError, match=r"512 input features got an input of shape \[2, 256\]"):
        layer(torch.randn(2, 256))
    with pytest.raises(TformerError, match=r"got x \[2, 256\] and chunks \[2, 2, 3360\]"):
        q6k_matmul(torch.randn(2, 256), layer.packed)


AVX2_CHECK = """
import sys, torch
from tformer.kernels import native
native.COMPILER_FLAGS = [f if f != "-march=native" else "-march=haswell" for f in native.COMPILER_FLAGS]
from tformer.kernels import q6k
sys.path.insert(0, sys.argv[1])
from test_q6k_kernel import blocks_of
assert q6k.instructions() == "AVX2", q6k.instructions()
layer = q6k.Q6KLinear.from_blocks(blocks_of(48, 768), (48, 768))
for m in (1, 2, 3, 9):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, 768).to(dtype)
        assert torch.equal(q6k.q6k_matmul(x, layer.packed), q6k.q6k_matmul(x, layer.packed, portable=True)), (m, dtype)
print("same")
"""


@pytest.mark.skipif(
    not dispatch.X86 or " avx2 " not in f" {native.cpu_name()} ", reason="needs an x86 CPU with AVX2 to run it on"
)
def test_the_avx2_build_gives_the_portable_loops_numbers() -> None:
    """The AVX2 loop (a CPU such as AMD's Zen 3), built for Haswell and run here in a fresh process (its op would
    clash with this process's build): the very numbers of the portable loop, as the VNNI loop's are."""
    env = {**os.environ, dispatch.PORTABLE_SWITCH: "0"}
    run = subprocess.run(
        [sys.executable, "-c", AVX2_CHECK, str(Path(__file__).parent)], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0 and run.stdout.strip() == "same", run.stderr[-2000:]
