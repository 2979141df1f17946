"""GGUF import from tiny LLaMA files written here: every supported tensor type, the reader, bad files, tokenizers.

The reference is `transformers` loading the same GGUF file (`from_pretrained(dir, gguf_file=...)`), which
dequantizes the same bits and undoes llama.cpp's q/k permutation on its own; the reader is also checked against
the `gguf` package's, and Q4_K against its documented layout decoded by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import gguf_writers
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import gguf_tensors, llama_cpp_permute, llama_metadata, write_spm_gguf

import tformer.models.init
from tformer.interop.gguf import GGUFError, dequantize_tensor, from_gguf, open_gguf, unpermute_rope_rows
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf
from tformer.models import CheckpointError

transformers = pytest.importorskip("transformers")

TINY = {**gguf_writers.TINY_SIZES, "intermediate_size": 256, "rms_norm_eps": 1e-5}


def tiny_hf_model(tie: bool = False, seed: int = 0) -> Any:
    """A random LlamaForCausalLM with GQA, weights large enough that logits are O(1) and norms not all ones."""
    torch.manual_seed(seed)
    model = gguf_writers.tiny_llama(
        **TINY,
        tie_word_embeddings=tie,
        initializer_range=0.15,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def encode(value: np.ndarray, qtype: Q) -> np.ndarray:
    """Raw GGUF bytes (or floats) for `value`; 1-D tensors stay F32, as llama.cpp keeps them."""
    if value.ndim == 1 or qtype == Q.F32:
        return value.astype(np.float32)
    return gguf.quants.quantize(value.astype(np.float32), qtype)


def write_gguf(
    path: Path,
    tensors: dict[str, np.ndarray],
    meta: dict[str, Any],
    qtype: Q = Q.F32,
    types: dict[str, Q] | None = None,
    arch: str = "llama",
) -> Path:
    """A GGUF file with `tensors` (each quantized to types.get(name, qtype), or raw bytes if uint8)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny test model")
    for key, value in meta.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, value in tensors.items():
        kind = (types or {}).get(name, qtype)
        data = value if value.dtype == np.uint8 else encode(value, kind)
        writer.add_tensor(name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_from_gguf(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


def max_logit_difference(ours: torch.nn.Module, theirs: Any, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(ids) - theirs(ids).logits).abs().max().item()


IDS = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2, 71, 33, 12, 50]])


# ---- tiny files, every supported type --------------------------------------------------------------------------


# measured max |delta logits| (logits within +-4.2, std 1.2): 0.0 for every type, i.e. bitwise equal, since both
# sides run fp32 from the same dequantized values; 1e-4 allows another reduction order on other CPUs/threads
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_tiny_llama_matches_transformers_loading_the_same_file(qtype: Q, tmp_path: Path) -> None:
    model = tiny_hf_model()
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", gguf_tensors(model), llama_metadata(model), qtype)
    ours, theirs = from_gguf(path), hf_from_gguf(path)
    assert ours.config.n_kv_heads == 2 and not ours.config.tie_embeddings
    assert max_logit_difference(ours, theirs, IDS) <= 1e-4
    if qtype == Q.F32:  # lossless: the original weights come back, so the q/k permutation was undone exactly
        with torch.no_grad():
            assert (ours(IDS) - model(IDS).logits).abs().max().item() <= 1e-4


def test_tied_embeddings_when_the_output_tensor_is_absent(tmp_path: Path) -> None:
    model = tiny_hf_model(tie=True)
    path = write_gguf(tmp_path / "tied.gguf", gguf_tensors(model), llama_metadata(model), Q.F16)
    ours = from_gguf(path)
    assert ours.config.tie_embeddings and ours.lm_head.weight is ours.decoder.tokens.weight
    assert max_logit_difference(ours, hf_from_gguf(path), IDS) <= 1e-4


def q4_k_block_by_hand(block: bytes) -> list[float]:
    """One Q4_K super-block (144 bytes -> 256 values), decoded per ggml's documented layout.

    f16 d, f16 dmin, 12 bytes packing eight 6-bit scales and eight 6-bit mins, then 128 bytes of 4-bit
    quants. Each 64 values use two sub-blocks: low nibbles (scale/min 2j), then high nibbles (2j + 1).
    """
    d, dmin = (float(np.frombuffer(block[i : i + 2], dtype=np.float16)[0]) for i in (0, 2))
    packed, quants = block[4:16], block[16:]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return packed[j] & 63, packed[j + 4] & 63
        return (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4), (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4)

    values = []
    for j in range(4):
        for sub, shift in ((2 * j, 0), (2 * j + 1, 4)):
            scale, minimum = scale_min(sub)
            values += [d * scale * ((q >> shift) & 0xF) - dmin * minimum for q in quants[32 * j : 32 * j + 32]]
    return values


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K bytes (rows, cols / 256 * 144) with random quants and small positive scales."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)  # d
    blocks[:, 2:4] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)  # dmin
    return blocks.reshape(rows, -1)


def test_q4_k_dequantizes_like_the_documented_format_and_like_transformers(tmp_path: Path) -> None:
    model = tiny_hf_model()
    tensors, rng = gguf_tensors(model), np.random.default_rng(0)
    for i in range(TINY["num_hidden_layers"]):  # ffn_down's rows hold intermediate_size = 256 values
        tensors[f"blk.{i}.ffn_down.weight"] = random_q4_k(TINY["hidden_size"], TINY["intermediate_size"], rng)
    path = write_gguf(
        tmp_path / "q4k.gguf",
        tensors,
        llama_metadata(model),
        Q.Q8_0,
        types={f"blk.{i}.ffn_down.weight": Q.Q4_K for i in range(2)},
    )
    reader = open_gguf(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type == Q.Q4_K
    ours = dequantize_tensor(reader, tensor)
    raw = tensors["blk.0.ffn_down.weight"]
    for row, block in [(0, 0), (37, 0), (63, 0)]:
        expected = torch.tensor(q4_k_block_by_hand(raw[row, block * 144 : (block + 1) * 144].tobytes()))
        torch.testing.assert_close(ours[row, block * 256 : (block + 1) * 256], expected, rtol=1e-6, atol=1e-7)
    assert max_logit_difference(from_gguf(path), hf_from_gguf(path), IDS) <= 1e-4


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_reader_matches_the_gguf_package_bit_for_bit(qtype: Q, tmp_path: Path) -> None:
    """tformer's GGUF reader against the `gguf` package's: every metadata value and every dequantized tensor."""
    model = tiny_hf_model()
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", gguf_tensors(model), llama_metadata(model), qtype)
    theirs, ours = gguf.GGUFReader(path), open_gguf(path)
    assert ours.fields == {
        name: field.contents() for name, field in theirs.fields.items() if not name.startswith("GGUF.")
    }
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        expected = gguf.quants.dequantize(reference.data, reference.tensor_type).astype(np.float32)
        got = dequantize_tensor(ours, mine)
        assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape
        assert torch.equal(got, torch.from_numpy(expected)), mine.name


def test_gguf_loads_without_initializing_any_weight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", gguf_tensors(tiny_hf_model()), llama_metadata(tiny_hf_model()), Q.Q4_1)
    expected = from_gguf(path).state_dict()

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("from_gguf initialized weights that the file then overwrote")

    for method in ("normal_", "uniform_", "fill_", "zero_"):
        monkeypatch.setattr(torch.Tensor, method, refuse)
    monkeypatch.setattr(tformer.models.init, "init_weights", refuse)
    loaded = from_gguf(path).state_dict()
    assert all(torch.equal(loaded[name], value) for name, value in expected.items())


def test_unpermute_inverts_llama_cpp_permutation_for_q_and_gqa_k() -> None:
    weight = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(4 * 16, 3)  # 4 heads of head_dim 16
    for heads in (4, 2):
        w = weight[: heads * 16]
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rope_rows(permuted, heads), w)


# ---- bad input ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_hf_model()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gguf_tensors(model), llama_metadata(model))


@pytest.mark.parametrize("keep", [0.98, 0.6, 0.02], ids=["tensor-data", "middle", "metadata"])
def test_truncated_file_is_reported_as_truncated(tiny_file: Path, tmp_path: Path, keep: float) -> None:
    data = tiny_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match=r"cut\.gguf is truncated: reading bytes .* fetch the file again"):
        from_gguf(cut)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    for name, content in [("pickle.gguf", b"\x80\x04\x95 not gguf at all"), ("empty.gguf", b"")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=f"{name} is not a GGUF file: it starts with"):
            from_gguf(tmp_path / name)
    with pytest.raises(GGUFError, match="no such file"):
        from_gguf(tmp_path / "missing.gguf")


def test_unsupported_quantization_type_names_tensor_and_type(tmp_path: Path) -> None:
    model = tiny_hf_model()
    tensors = gguf_tensors(model)
    iq4_xs_bytes = 136  # per 256 values
    tensors["blk.1.ffn_down.weight"] = np.random.default_rng(0).integers(0, 256, (64, iq4_xs_bytes), dtype=np.uint8)
    types = {"blk.1.ffn_down.weight": Q.IQ4_XS}
    path = write_gguf(tmp_path / "iq4xs.gguf", tensors, llama_metadata(model), types=types)
    with pytest.raises(
        GGUFError,
        match=r"unsupported quantization type IQ4_XS for blk\.1\.ffn_down\.weight; "
        r"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K",
    ):
        from_gguf(path)


def test_missing_tensor_shape_mismatch_and_architecture(tmp_path: Path) -> None:
    model = tiny_hf_model()
    tensors, meta = gguf_tensors(model), llama_metadata(model)
    del tensors["blk.1.ffn_up.weight"]
    with pytest.raises(GGUFError, match=r"missing tensor blk\.1\.ffn_up\.weight \(tformer's decoder\.layers\.1\."):
        from_gguf(write_gguf(tmp_path / "missing.gguf", tensors, meta))
    wrong = write_gguf(tmp_path / "wrong.gguf", gguf_tensors(model), {**meta, "feed_forward_length": 128})
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_gate\.weight has shape \[256, 64\], but the metadata imply"):
        from_gguf(wrong)
    other = write_gguf(tmp_path / "bloom.gguf", gguf_tensors(model), meta, arch="bloom")
    with pytest.raises(GGUFError, match="architecture 'bloom' is not supported; supported: llama, mistral, qwen2"):
        from_gguf(other)


# ---- tokenizers from hand-made GGUF files ----------------------------------------------------------------------


def test_unsupported_tokenizer_model_is_named(tmp_path: Path) -> None:
    model = tiny_hf_model()
    writer_path = tmp_path / "bert-vocab.gguf"
    writer = gguf.GGUFWriter(writer_path, "llama")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "a"])
    for name, value in list(gguf_tensors(model).items())[:1]:
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="tokenizer model 'bert' is not supported; supported: gpt2, llama"):
        tokenizer_from_gguf(writer_path)


def test_sentencepiece_tokenizer_from_gguf_matches_transformers(tmp_path: Path) -> None:
    """A hand-made LLaMA-style vocabulary: merges come from the scores, unknown characters fall back to bytes."""
    space = "\u2581"
    pieces = [
        space,
        *"abcdehlorw",
        f"{space}a",
        "ab",
        f"{space}ab",
        "bc",
        "abc",
        f"{space}abc",
        f"{space}h",
        "he",
        "ll",
        "llo",
        "hel",
        "hello",
        f"{space}hello",
        f"{space}w",
        "or",
        "ld",
        f"{space}wor",
        f"{space}world",
        "orld",
        space * 2,
        "lo",
    ]
    write_spm_gguf(tmp_path / "spm.gguf", pieces)
    ours = tokenizer_from_gguf(tmp_path / "spm.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    assert ours.add_bos  # llama.cpp's default for SentencePiece vocabularies
    for text in ["hello world", "abc ab", " hello", "héllo wörld", "  two  spaces", "x", "", "hello\nworld"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("hello world") == [1, 276, 264, 279, 287]  # ▁h e llo ▁world: highest-scoring merges first
    assert ours.decode(ours.encode("héllo wörld")) == "héllo wörld"  # é and ö went through <0xC3> <0xA9> ...
