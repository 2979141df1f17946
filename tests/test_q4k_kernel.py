"""The Q4_K kernel (`kernels/q4k.py`): its layout holds a GGUF file's Q4_K blocks exactly (against
`gguf.quants.dequantize`), its matmul equals the plain formula on the dequantized weights with activations rounded
as it rounds them, in its vectorized, AVX2 and portable builds, each row independent of the others, inside a
compiled graph, bad input is a TformerError, and a GGUF file's Q4_K layers load as it (MoE experts as INT4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import gguf_writers
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tformer.engine.loading import load_quantized
from tformer.errors import TformerError
from tformer.interop.gguf import from_gguf
from tformer.kernels import dispatch, native, q4k
from tformer.kernels.int4 import Int4Linear
from tformer.kernels.q4k import BLOCK_BYTES, Q4KLinear, q4k_formula, q4k_matmul
from tformer.kernels.quantize import set_precision

pytestmark = pytest.mark.skipif(q4k.kernel() is None, reason="no C++ compiler to build the Q4_K kernel with")


def blocks_of(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    """(out, in / 256 * 144) bytes of random Q4_K blocks: any byte is a valid nibble pair or 6-bit scale and
    minimum; each block's fp16 d and dmin of a realistic magnitude."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out_f * in_f // 256, BLOCK_BYTES), dtype=np.uint8)
    for start in (0, 2):
        halves = (rng.uniform(0.5, 1.0, len(blocks)) * 2e-3).astype(np.float16)
        blocks[:, start : start + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(out_f, -1))


def reference(blocks: torch.Tensor, in_f: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.numpy(), Q.Q4_K)
    return torch.from_numpy(values.astype(np.float32)).reshape(-1, in_f)


@pytest.mark.parametrize("out_f,in_f", [(16, 256), (48, 512), (32, 768)])
def test_the_layout_keeps_the_files_blocks_bit_for_bit(out_f: int, in_f: int) -> None:
    for blocks in (blocks_of(out_f, in_f), torch.from_numpy(gguf_writers.quantize_q4_k(np.random.randn(out_f, in_f)))):
        layer = Q4KLinear.from_blocks(blocks, (out_f, in_f))
        assert layer.packed.shape == (out_f // 16, in_f // 256, 2368)  # 4.625 bits a weight: the file's 4.5 + 2 bits
        assert layer.packed.numel() * 144 == blocks.numel() * 148  # of 8 per 256 for the 6-bit scales in bytes
        expected = reference(blocks, in_f)
        assert torch.equal(layer.dequantized(), expected)
        ids = torch.tensor([[0, out_f - 1, 17 % out_f], [5, 5, out_f // 2]])
        assert torch.equal(layer.rows(ids), expected[ids])


def test_from_blocks_in_pieces_packs_as_one_piece() -> None:
    """A layer packs about 4M weights at a time (small temporaries): 1024 rows of 8192 in two pieces of 512."""
    wide = blocks_of(1024, 8192, seed=1)
    pieces = Q4KLinear.from_blocks(wide, (1024, 8192))
    assert torch.equal(pieces.packed[32:], Q4KLinear.from_blocks(wide[512:], (512, 8192)).packed)
    assert torch.equal(pieces.rows(torch.tensor([3, 700])), reference(wide[[3, 700]], 8192))


@pytest.mark.parametrize("portable", [False, True], ids=["vectorized", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,in_f,out_f", [(1, 256, 16), (3, 512, 48), (4, 768, 32), (9, 512, 32), (20, 256, 16)])
def test_kernel_matches_the_formula(m: int, in_f: int, out_f: int, dtype: torch.dtype, portable: bool) -> None:
    """Token counts below and above the 4 the VNNI loop takes at a time. Activations spread over 4 orders of
    magnitude between rows."""
    layer = Q4KLinear.from_blocks(blocks_of(out_f, in_f), (out_f, in_f))
    x = (torch.randn(m, in_f, generator=torch.Generator().manual_seed(m)) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    out = q4k_matmul(x, layer.packed, portable)
    assert out.dtype == dtype and out.shape == (m, out_f)
    expected = q4k_formula(x, layer.packed)
    scale = expected.abs().amax(1, keepdim=True)
    if dtype == torch.float32:  # exact integer sums per super-block, times fp32 scales added in fp32
        assert ((out.double() - expected).abs() <= 1e-6 * scale).all()
    else:  # and bf16 rounds the result once
        assert ((out.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-6 * scale).all()


def test_vectorized_and_portable_loops_give_the_same_numbers_and_rows_are_independent() -> None:
    layer = Q4KLinear.from_blocks(blocks_of(64, 1024), (64, 1024))
    x = torch.randn(13, 1024)
    out = q4k_matmul(x, layer.packed)
    assert torch.equal(out, q4k_matmul(x, layer.packed, portable=True))
    for row in range(13):  # one token alone; 13 as 4 + 4 + 4 + 1
        assert torch.equal(q4k_matmul(x[row : row + 1], layer.packed), out[row : row + 1])
    assert torch.equal(q4k_matmul(x[2:7], layer.packed), out[2:7])


def test_the_layer_is_close_to_the_float_linear_with_its_bias_and_fused_rows() -> None:
    """Against F.linear on the dequantized weight: the activations' two int8 steps keep the error to 1e-4 of the
    largest output; a wrong layout, scale or minimum is O(1)."""
    blocks = blocks_of(48, 512)
    bias = torch.randn(48)
    layer = Q4KLinear.from_blocks(blocks, (48, 512), bias)
    x = torch.randn(2, 3, 512)
    expected = torch.nn.functional.linear(x, reference(blocks, 512), bias)
    out = layer(x)
    assert out.shape == (2, 3, 48)
    assert (out - expected).abs().max() <= 1e-4 * expected.abs().max()
    with dispatch.portable_kernels():  # off the x86 kernels: the dequantized weight, one matmul
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    other = Q4KLinear.from_blocks(blocks_of(32, 512, seed=2), (32, 512), torch.randn(32))
    fused = Q4KLinear.concatenated([layer, other])
    assert torch.equal(fused(x), torch.cat([layer(x), other(x)], -1))


def test_the_layer_runs_inside_a_compiled_graph() -> None:
    layer = Q4KLinear.from_blocks(blocks_of(32, 512), (32, 512))
    x = torch.randn(3, 512)
    compiled = torch.compile(lambda t: layer(t) * 2, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x), layer(x) * 2)


def test_bad_input_is_a_clear_error() -> None:
    blocks = blocks_of(32, 512)
    with pytest.raises(TformerError, match=r"out_features a multiple of 16, in_features of 256"):
        Q4KLinear.from_blocks(blocks[:24], (24, 512))
    with pytest.raises(TformerError, match=r"blk.3.ffn_up.weight: .* got shape \[32, 500\]"):
        Q4KLinear.from_blocks(blocks, (32, 500), name="blk.3.ffn_up.weight")
    with pytest.raises(TformerError, match=r"got shape \[32, 512\] and blocks \[32, 287\]"):
        Q4KLinear.from_blocks(blocks[:, :287], (32, 512))
    layer = Q4KLinear.from_blocks(blocks, (32, 512))
    with pytest.raises(TformerError, match=r"512 input features got an input of shape \[2, 256\]"):
        layer(torch.randn(2, 256))
    with pytest.raises(TformerError, match=r"got x \[2, 256\] and chunks \[2, 2, 2368\]"):
        q4k_matmul(torch.randn(2, 256), layer.packed)


def q4k_file(path: Path, model: torch.nn.Module) -> Path:
    """`model` as a GGUF file whose block matrices are all Q4_K (a router, ffn_gate_inp, stays F32)."""
    tensors = gguf_writers.tensors(model, "llama")
    types = {name: Q.Q4_K for name, value in tensors.items() if value.ndim >= 2 and ".ffn_gate_inp." not in name}
    types = {name: kind for name, kind in types.items() if name.startswith("blk.")}
    overrides = {}
    for name in types:
        value = tensors[name]
        overrides[name] = gguf_writers.quantize_q4_k(value.reshape(-1, value.shape[-1])).reshape(*value.shape[:-1], -1)
    return gguf_writers.write(
        path, model, "llama", Q.F32, tensors_override=overrides, types=types, keys=gguf_writers.TINY_TOKENIZER
    )


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_files_q4_k_layers_load_as_stored_close_to_the_float_model(moe: bool, tmp_path: Path) -> None:
    """A tiny Llama (or Mixtral) whose matrices are all Q4_K: with `--quantize auto` each dense layer is a
    Q4KLinear holding the file's weights exactly, MoE experts stay INT4 (`Int4Linear.grouped` multiplies groups of
    experts in one call), and with the float head and embedding the logits are within 1e-3 of the largest of the
    float model's (the activations' int8 steps, and INT4's fp16 scales; measured 4e-5 dense); a wrong layer is
    O(1). `--quantize int4` keeps INT4's groups."""
    transformers = pytest.importorskip("transformers")
    sizes = {**gguf_writers.TINY_SIZES, "hidden_size": 256, "intermediate_size": 256}
    torch.manual_seed(0)
    if moe:
        config = transformers.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config).eval()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()
    path = q4k_file(tmp_path / "q4k.gguf", model)
    reference = from_gguf(path)
    served, _ = load_quantized(path, "int4", as_stored=True)
    ours, theirs = served.decoder.layers[0], reference.decoder.layers[0]
    pairs = [(ours.self_attn.q_proj, theirs.self_attn.q_proj), (ours.self_attn.out_proj, theirs.self_attn.out_proj)]
    if not moe:
        pairs.append((ours.ffn.down_proj, theirs.ffn.down_proj))
    for layer, float_layer in pairs:
        assert isinstance(layer, Q4KLinear) and torch.equal(layer.dequantized(), float_layer.weight)
    if moe:
        expert = ours.ffn.experts[0]
        assert all(isinstance(layer, Int4Linear) for layer in (expert.gate_proj, expert.up_proj, expert.down_proj))
    set_precision(served, "float32", "int4")
    served.lm_head = reference.lm_head  # the file's F32 head is INT8 (one scale a row, ~0.7% of the logits): float
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Embedding):
            served.set_submodule(name, module)
    ids = torch.tensor([[5, 17, 3, 60, 42, 8, 91, 33]])
    with torch.no_grad():
        expected = reference(ids)
        error = (served(ids) - expected).abs().max() / expected.abs().max()
    assert error < 1e-3, error
    int4, _ = load_quantized(path, "int4")
    assert isinstance(int4.decoder.layers[0].self_attn.q_proj, Int4Linear)


AVX2_CHECK = """
import sys, torch
from tformer.kernels import native
native.COMPILER_FLAGS = [f if f != "-march=native" else "-march=haswell" for f in native.COMPILER_FLAGS]
from tformer.kernels import q4k
sys.path.insert(0, sys.argv[1])
from test_q4k_kernel import blocks_of
assert q4k.instructions() == "AVX2", q4k.instructions()
layer = q4k.Q4KLinear.from_blocks(blocks_of(48, 768), (48, 768))
for m in (1, 2, 3, 9):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, 768).to(dtype)
        assert torch.equal(q4k.q4k_matmul(x, layer.packed), q4k.q4k_matmul(x, layer.packed, portable=True)), (m, dtype)
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
