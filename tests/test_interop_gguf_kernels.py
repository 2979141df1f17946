"""Quantized layers built straight from a GGUF file's blocks (`StoredLinear`, `stored_layer`, `load_quantized`)
against the layer built from the dequantized float weights, with `gguf.quants.dequantize` as the reference.

What each type keeps (docs/interop.md, "Each type in its kernel"):
- Q4_0 and Q4_1 are INT4's groups of 32 exactly: the layer's weights equal the file's bit for bit.
- Q4_K's groups of 32 are exact in q; each group's d * scale and dmin * minimum (float32 products of a 6-bit
  integer and an fp16) are rounded to INT4's fp16, so the weights are q * fp16(s) + fp16(m), bit for bit.
- Q6_K serves as stored (`kernels/q6k.py`, its tests in test_q6k_kernel.py): the file's bits, a tied Q6_K head too.
  Q4_K serves as stored too with --quantize auto (`kernels/q4k.py`, test_q4k_kernel.py), INT4's groups otherwise.
- Q5_0, Q5_1, Q5_K and Q8_0 serve as INT8 (INT8 has one scale per row, the blocks one per 16 or 32 weights;
  --quantize int4 sends the 5-bit ones to INT4, whose 4 bits they do not fit), as Q6_K does under --quantize int8:
  requantized from their dequantized rows, a few rows at a time, the numbers equal those of the layer quantized
  from the whole float weight.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import gguf_writers
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch import nn

from tformer.config import ConfigError
from tformer.engine.loading import load_quantized, stored_layer
from tformer.interop.gguf import GGUFError, StoredLinear, from_gguf
from tformer.kernels import int4
from tformer.kernels.int4 import Int4Linear
from tformer.kernels.q4k import Q4KLinear
from tformer.kernels.q6k import Q6KLinear
from tformer.kernels.quantize import Int8Linear, RowsEmbedding, set_precision

pytestmark = pytest.mark.skipif(int4.kernel() is None, reason="no C++ compiler to build the INT4 kernel with")

OUT, IN = 64, 512
GGUF_PY_QUANTIZES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
K_QUANT_F16 = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each block's f16 fields
EXACT = (Q.Q4_0, Q.Q4_1)
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K)
ALL_TYPES = (*INT4_TYPES, Q.Q6_K, Q.Q8_0)


def blocks_of(kind: Q, seed: int = 0) -> np.ndarray:
    """(OUT, bytes a row) blocks of a weight: gguf-py's quantization of random floats where it has one; for
    Q5_K and Q6_K random bytes with f16 fields of one realistic magnitude; Q4_K from the tests' quantizer."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((OUT, IN)) * 0.05).astype(np.float32)
    if kind in GGUF_PY_QUANTIZES:
        return np.ascontiguousarray(gguf.quants.quantize(values, kind)).view(np.uint8).reshape(OUT, -1)
    if kind == Q.Q4_K:
        return gguf_writers.quantize_q4_k(values)
    _, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(OUT * IN // 256, block_bytes), dtype=np.uint8)
    for start in K_QUANT_F16[kind]:
        scale = (rng.uniform(0.5, 1.0, len(blocks)) * 2e-3).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(OUT, -1)


def stored(kind: Q, seed: int = 0) -> tuple[StoredLinear, torch.Tensor]:
    """The blocks as a StoredLinear and the float weight gguf.quants dequantizes them to."""
    raw = blocks_of(kind, seed)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32)).reshape(OUT, IN)
    return StoredLinear("blk.0.w.weight", kind, torch.from_numpy(raw), (OUT, IN)), reference


def float_layer(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return layer


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda k: k.name)
def test_rows_dequantize_in_chunks_as_gguf_does(kind: Q) -> None:
    weight, reference = stored(kind)
    assert torch.equal(weight.floats(), reference)
    chunks = list(weight.chunks(values=16 * IN))  # 16 rows a chunk
    assert [len(c) for c in chunks] == [16] * 4 and torch.equal(torch.cat(chunks), reference)


@pytest.mark.parametrize("kind", EXACT, ids=lambda k: k.name)
def test_q4_0_and_q4_1_blocks_are_int4_groups_bit_for_bit(kind: Q) -> None:
    weight, reference = stored(kind)
    layer = stored_layer(weight, "int4")
    assert isinstance(layer, Int4Linear)
    assert torch.equal(layer.dequantized(), reference)


def test_q4_k_groups_are_exact_but_for_their_scales_rounded_to_fp16() -> None:
    weight, reference = stored(Q.Q4_K)
    q, scales, minimums = weight.int4_groups()
    per_group = q.float().view(OUT, -1, 32)
    assert torch.equal((per_group * scales[..., None] + minimums[..., None]).view(OUT, IN), reference)
    layer = stored_layer(weight, "int4")
    rounded = per_group * scales.half().float()[..., None] + minimums.half().float()[..., None]
    assert torch.equal(layer.dequantized(), rounded.view(OUT, IN))
    # fp16 keeps 11 significant bits: each weight moves by at most 2^-11 of (15 |scale| + |minimum|)
    bound = 2.0**-11 * (15 * scales.abs() + minimums.abs())
    error = (layer.dequantized() - reference).abs().view(OUT, -1, 32).amax(-1)
    assert (error <= bound).all() and 0 < error.max()


@pytest.mark.parametrize("kind", (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0), ids=lambda k: k.name)
@pytest.mark.parametrize("target", ["int4", "int8"])
def test_requantized_types_equal_the_layer_quantized_from_the_float_weight(kind: Q, target: str) -> None:
    weight, reference = stored(kind)
    ours = stored_layer(weight, target)
    theirs = Int4Linear(float_layer(reference)) if target == "int4" else Int8Linear(float_layer(reference))
    assert type(ours) is type(theirs)
    assert torch.equal(ours.packed, theirs.packed)
    if target == "int8":
        assert torch.equal(ours.scales, theirs.scales)


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("target", ["int4", "int8"])
def test_kernel_layer_from_blocks_is_close_to_the_float_linear(kind: Q, target: str) -> None:
    """The layer's output against F.linear on the dequantized weight, the largest error relative to the largest
    output. Tolerances are about 3x the errors measured here: INT4 on Q4_0 / Q4_1 groups 2e-4 (measured 7e-5, the
    activations' two int8 steps), on Q4_K 2e-3 (6e-4: its scales rounded to fp16); INT8 0.03 (up to 0.011: the
    weights rounded to 8 bits a row); INT4 requantizing another grid onto 4 bits a group of 32 0.3 (up to 0.11).
    A wrong layout (a block's values in the wrong place, a wrong scale) is O(1)."""
    weight, reference = stored(kind)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(3))
    expected = F.linear(x, reference)
    error = (stored_layer(weight, target)(x) - expected).abs().max() / expected.abs().max()
    if target == "int8":
        tolerance = 0.03
    else:
        tolerance = {Q.Q4_0: 2e-4, Q.Q4_1: 2e-4, Q.Q4_K: 2e-3}.get(kind, 0.3)
    assert error <= tolerance, error


def test_a_bias_and_the_int8_fallback_for_a_shape_int4_cannot_take() -> None:
    weight, reference = stored(Q.Q4_1)
    narrow = StoredLinear("blk.0.w.weight", Q.Q4_1, weight.rows[:40], (40, IN))  # 40 rows: not a multiple of 16
    bias = torch.randn(40)
    layer = stored_layer(narrow, "int4", bias)
    assert isinstance(layer, Int8Linear) and layer.bias is bias
    assert torch.equal(layer.packed, Int8Linear(float_layer(reference[:40])).packed)


def test_int8_layers_concatenate_as_fusion_joins_them() -> None:
    parts = [stored_layer(stored(kind, seed)[0], "int8", torch.randn(OUT)) for seed, kind in enumerate(ALL_TYPES[:3])]
    fused = Int8Linear.concatenated(parts)
    x = torch.randn(3, IN)
    assert torch.equal(fused(x), torch.cat([part(x) for part in parts], -1))


def test_bad_blocks_and_shapes_are_clear_errors() -> None:
    weight, _ = stored(Q.Q4_K)
    with pytest.raises(GGUFError, match=r"Q4_K weight of shape \[64, 320\] needs rows of whole 256-value blocks"):
        StoredLinear("blk.0.w.weight", Q.Q4_K, weight.rows, (OUT, 320))
    with pytest.raises(GGUFError, match=r"blk.0.w.weight: a Q4_K weight .* got \[64, 143\]"):
        StoredLinear("blk.0.w.weight", Q.Q4_K, weight.rows[:, :143], (OUT, 256))
    q, scales, minimums = weight.int4_groups()
    with pytest.raises(ConfigError, match="int4 groups do not fit"):
        Int4Linear.from_groups(q, scales[:, :-1], minimums)
    with pytest.raises(ConfigError, match="out_features by 16"):
        Int4Linear.from_groups(q[:8], scales[:8], minimums[:8])
    with pytest.raises(ConfigError, match="out_features by 16"):
        Int4Linear.from_chunks([torch.randn(24, IN)])
    with pytest.raises(ConfigError, match="no rows"):
        Int4Linear.from_chunks([])
    with pytest.raises(ConfigError, match="one or more chunks"):
        Int8Linear.from_chunks([])


# ---- through a file: every layer type in one model ----------------------------------------------------------------

MIXED = {  # a Q4_K_M-like mix, one type a tensor, q and k permuted as llama.cpp stores them
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q5_K,
    "ffn_down": Q.Q4_1,
}


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mixed(tmp_path_factory.mktemp("mixed") / "mixed.gguf", MIXED)


@pytest.fixture(scope="module")
def q6k_head_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mix with the tied embedding (and so the head) in Q6_K, as a Llama 3.2 Q4_K_M file keeps it."""
    return write_mixed(tmp_path_factory.mktemp("q6k_head") / "q6k_head.gguf", {**MIXED, "token_embd": Q.Q6_K})


def write_mixed(path: Path, mix: dict[str, Q]) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(  # q/k/v biases: a replaced layer must keep them
        vocab_size=96,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    for name, parameter in model.named_parameters():
        if name.endswith("bias"):
            nn.init.normal_(parameter, std=0.1)
    tensors = gguf_writers.tensors(model, "qwen2")
    types, overrides = {}, {}
    for name, value in tensors.items():
        short = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        kind = mix.get(short) if value.ndim == 2 else None
        if kind is not None:
            types[name] = kind
            if kind == Q.Q4_K:
                overrides[name] = gguf_writers.quantize_q4_k(value)
            elif kind in (Q.Q5_K, Q.Q6_K):  # gguf-py cannot quantize these: Q8_0-like random bytes of the type
                rng = np.random.default_rng(len(name))
                _, block_bytes = GGML_QUANT_SIZES[kind]
                raw = rng.integers(0, 256, (value.size // 256, block_bytes), dtype=np.uint8)
                for start in K_QUANT_F16[kind]:
                    scale = np.full(len(raw), 1e-3, np.float16)
                    raw[:, start : start + 2] = scale.view(np.uint8).reshape(-1, 2)
                overrides[name] = raw.reshape(value.shape[0], -1)
    return gguf_writers.write(
        path, model, "qwen2", Q.F32, tensors_override=overrides, types=types, keys=gguf_writers.TINY_TOKENIZER
    )


def layer_types(model: nn.Module) -> dict[str, type]:
    block = model.decoder.layers[1]
    return {
        "q": type(block.self_attn.q_proj),
        "k": type(block.self_attn.k_proj),
        "v": type(block.self_attn.v_proj),
        "o": type(block.self_attn.out_proj),
        "gate": type(block.ffn.gate_proj),
        "up": type(block.ffn.up_proj),
        "down": type(block.ffn.down_proj),
    }


def test_a_file_loads_each_layer_in_its_own_types_kernel_with_its_bias(mixed_file: Path) -> None:
    reference = from_gguf(mixed_file)
    model, _ = load_quantized(mixed_file, "int4", as_stored=True)
    i4, i8 = Int4Linear, Int8Linear
    assert layer_types(model) == {"q": Q4KLinear, "k": i4, "v": Q6KLinear, "o": i8, "gate": i8, "up": i8, "down": i4}
    ours, theirs = model.decoder.layers[1].self_attn, reference.decoder.layers[1].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(ours, name).bias, getattr(theirs, name).bias)
    assert torch.equal(ours.v_proj.dequantized(), theirs.v_proj.weight)  # Q6_K as stored: the file's bits
    # q in Q4_K as stored and k in Q4_0 (exact): the row permutation undone on the blocks, as on floats
    assert torch.equal(ours.k_proj.dequantized(), theirs.k_proj.weight)
    assert torch.equal(ours.q_proj.dequantized(), theirs.q_proj.weight)
    every_int8, _ = load_quantized(mixed_file, "int8")
    assert set(layer_types(every_int8).values()) == {Int8Linear}
    ids = torch.tensor([[5, 17, 3, 60, 42, 8, 91, 33]])
    with torch.no_grad():
        expected = reference(ids)
        for served in (set_precision(model, "float32", "int4"), set_precision(every_int8, "float32", "int8")):
            error = (served(ids) - expected).abs().max() / expected.abs().max()
            assert error < 0.05, error  # every layer int8, or 4-bit groups; a wrong or unpermuted layer is O(1)


def test_int8_from_chunks_of_16_rows_packs_as_the_whole_weight_and_refuses_ragged_chunks() -> None:
    weight, reference = stored(Q.Q6_K)
    chunked = Int8Linear.from_chunks(weight.chunks(values=16 * IN))  # 4 chunks of 16 rows, packed one by one
    whole = Int8Linear(float_layer(reference))
    assert torch.equal(chunked.packed, whole.packed) and torch.equal(chunked.scales, whole.scales)
    with pytest.raises(ConfigError, match="each but the last a multiple of 16 rows"):
        Int8Linear.from_chunks([reference[:24], reference[24:]])


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_a_tied_embedding_is_one_int8_table_built_from_its_blocks(mixed_file: Path, quantize: str) -> None:
    """The tied head is built from token_embd's blocks as `quantize` builds it from the float load, and the
    embedding looks its rows up in it: no float copy of the table is left."""
    reference = from_gguf(mixed_file)
    model, _ = load_quantized(mixed_file, quantize, as_stored=True)
    head, table = model.lm_head, model.decoder.tokens
    assert isinstance(head, Int8Linear) and isinstance(table, RowsEmbedding) and table.head is head
    expected = Int8Linear(float_layer(reference.lm_head.weight.detach()))
    assert torch.equal(head.packed, expected.packed) and torch.equal(head.scales, expected.scales)
    ids = torch.tensor([[5, 17, 3, 95, 0]])
    assert torch.equal(table(ids), expected.dequantized()[ids])
    vocab_floats = reference.decoder.tokens.weight.numel()
    assert all(t.numel() < vocab_floats for t in [*model.parameters(), *model.buffers()] if t.is_floating_point())


def test_an_untied_head_is_int8_from_its_blocks_and_the_embedding_stays_float(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = gguf_writers.tiny_llama(num_hidden_layers=1, max_position_embeddings=64, tie_word_embeddings=False)
    path = gguf_writers.write(
        tmp_path / "untied.gguf",
        model,
        "llama",
        Q.F32,
        types={"output.weight": Q.Q8_0},
        keys=gguf_writers.TINY_TOKENIZER,
    )
    reference = from_gguf(path)
    ours, _ = load_quantized(path, "int4", as_stored=True)
    expected = Int8Linear(float_layer(reference.lm_head.weight.detach()))
    assert isinstance(ours.lm_head, Int8Linear)
    assert torch.equal(ours.lm_head.packed, expected.packed) and torch.equal(ours.lm_head.scales, expected.scales)
    assert type(ours.decoder.tokens) is nn.Embedding
    assert torch.equal(ours.decoder.tokens.weight, reference.decoder.tokens.weight)


def test_a_tied_q6_k_head_is_the_files_blocks_and_the_embedding_reads_its_rows(q6k_head_file: Path) -> None:
    """As stored, a Q6_K token_embd becomes a Q6_K head (the file's bits) that the embedding looks its rows up in,
    and the model's logits stay within 1e-3 of the dequantized float model's on the layers that are Q6_K or exact,
    0.05 with the requantized ones (INT8 rows, Q4_K's fp16 scales); under --quantize int8 the head is INT8."""
    reference = from_gguf(q6k_head_file)
    model, _ = load_quantized(q6k_head_file, "int4", as_stored=True)
    head, table = model.lm_head, model.decoder.tokens
    assert isinstance(head, Q6KLinear) and isinstance(table, RowsEmbedding) and table.head is head
    assert torch.equal(head.dequantized(), reference.lm_head.weight)
    ids = torch.tensor([[5, 17, 3, 95, 0, 42]])
    assert torch.equal(table(ids), reference.decoder.tokens.weight[ids])
    vocab_floats = reference.decoder.tokens.weight.numel()
    assert all(t.numel() < vocab_floats for t in [*model.parameters(), *model.buffers()] if t.is_floating_point())
    with torch.no_grad():
        expected = reference(ids)
        hidden = reference.decoder(ids)
        served = set_precision(model, "float32", "int4")
        error = (served(ids) - expected).abs().max() / expected.abs().max()
        assert error < 0.05, error
        head_error = (head(hidden) - reference.lm_head(hidden)).abs().max() / expected.abs().max()
        assert head_error < 1e-3, head_error  # the Q6_K kernel alone: the activations' two int8 steps
    every_int8, _ = load_quantized(q6k_head_file, "int8")
    assert isinstance(every_int8.lm_head, Int8Linear) and Q6KLinear not in set(layer_types(every_int8).values())
