"""`tformer convert --to gguf`: a LLaMA-style tformer model written as a GGUF file reads back, through tformer's
reader and through transformers' GGUF loader (an independent reader of llama.cpp's layout), to the same logits."""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from gguf_writers import llama3_divisors

from tformer import ConfigError, ModelConfig, build_model
from tformer.cli import main as tformer_main
from tformer.data.tokenizer import Tokenizer
from tformer.interop.gguf import dequantize_tensor, from_gguf, open_gguf
from tformer.interop.gguf_arch import unpermute_rope_rows
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf
from tformer.interop.gguf_writer import permute_rope_rows, to_gguf

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the bird sang at dawn"] * 20


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = Tokenizer.train(TEXTS, vocab_size=300)
    config = ModelConfig.from_preset(
        "tiny-llama", vocab_size=320, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, tie_embeddings=False
    )
    torch.manual_seed(0)
    return build_model(config).eval(), tokenizer


def f16_rounded(model):
    """The model with every weight rounded to f16 and back: what an f16 file holds (norms and a mixture's routers
    stay f32 there)."""
    rounded = build_model(model.config).eval()
    state = {
        k: v if v.ndim == 1 or k.endswith("router.weight") else v.half().float() for k, v in model.state_dict().items()
    }
    rounded.load_state_dict(state)
    return rounded


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out).float()


IDS = torch.tensor([[1, 40, 77, 120, 5, 260, 299, 3, 64, 18, 200, 9]])


def test_permutation_is_the_readers_inverse():
    weight = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(weight, 4), 4), weight)


def test_f16_reads_back_in_tformer_and_transformers(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    file = tmp_path / "tiny-f16.gguf"
    to_gguf(model, file, tokenizer, "f16")
    reference = logits(f16_rounded(model), IDS)
    ours = logits(from_gguf(file).eval(), IDS)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)  # the same weights: float32 rounding only
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name).eval()
    torch.testing.assert_close(logits(theirs, IDS), reference, atol=1e-4, rtol=0)
    # the tokenizer: every token at its id, its special ids and the byte-level model llama.cpp calls gpt2
    reader = open_gguf(file)
    assert reader.get("tokenizer.ggml.pre") == "gpt-2"  # llama.cpp's name for GPT-2's split; it refuses "gpt2"
    back = tokenizer_from_gguf(file, reader)
    assert back.backend.get_vocab() | {} == {t: i for t, i in tokenizer.backend.get_vocab().items()} | {
        f"[PAD{i}]": i for i in range(tokenizer.backend.get_vocab_size(), 320)
    }
    assert (back.bos_id, back.eos_id) == (tokenizer.bos_id, tokenizer.eos_id)
    # tformer's tokenizer adds a space before the text (ByteLevel add_prefix_space); llama.cpp's gpt2 does not
    assert back.encode(" the cat sat") == tokenizer.encode("the cat sat")


def test_q8_0_within_tolerance_of_float(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    file = tmp_path / "tiny-q8_0.gguf"
    to_gguf(model, file, tokenizer, "q8_0")
    reference = logits(model, IDS)
    ours = logits(from_gguf(file).eval(), IDS)
    # Q8_0 keeps 8 bits and an f16 scale per 32 weights: logits within 2% of their range here
    assert (ours - reference).abs().max() < 0.02 * reference.abs().max()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name).eval()
    torch.testing.assert_close(logits(theirs, IDS), ours, atol=1e-4, rtol=0)  # both dequantize the same blocks


def test_tied_head_and_cli(tmp_path, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    config = ModelConfig.from_preset("tiny-llama", vocab_size=320, d_model=64, d_ff=96, tie_embeddings=True)
    torch.manual_seed(1)
    model = build_model(config).eval()
    model.save(tmp_path / "ckpt")
    tokenizer.save(tmp_path / "ckpt")
    out = tmp_path / "out" / "tiny-q4_0.gguf"
    assert tformer_main(shlex.split(f"convert {tmp_path / 'ckpt'} --to gguf --type q4_0 --out {out}")) == 0
    reader = open_gguf(out)
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied: llama.cpp reuses token_embd
    back = from_gguf(out).eval()
    reference = logits(model, IDS)
    assert (logits(back, IDS) - reference).abs().max() < 0.3 * reference.abs().max()  # 4 bits: a loose bound


def test_other_families_and_types_are_refused(tmp_path):
    gpt2 = build_model(ModelConfig.from_preset("tiny-gpt2"))
    with pytest.raises(ConfigError, match="LLaMA-style decoders"):
        to_gguf(gpt2, tmp_path / "x.gguf")
    llama = build_model(ModelConfig.from_preset("tiny-llama"))
    with pytest.raises(ConfigError, match="q8_0"):
        to_gguf(llama, tmp_path / "x.gguf", type="q5_k")


def test_llama3_rope_goes_out_as_rope_freqs(tmp_path, model_and_tokenizer):
    """Llama 3's scaled RoPE goes out as the divisors llama.cpp's converter writes to rope_freqs, which give
    tformer's reader back the model's logits."""
    _, tokenizer = model_and_tokenizer
    config = ModelConfig.from_preset("llama3.2-1b").to_dict() | {
        "vocab_size": 320,
        "d_model": 64,
        "n_decoder_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "d_ff": 96,
        "head_dim": 64,  # Llama 3.2's: frequencies in every band (kept, blended, divided by rope_factor)
        "max_seq_len": 16384,
        "rope_original_max_len": 8192,  # Llama 3.x's, which the reader assumes (GGUF has no key for it)
    }
    torch.manual_seed(2)
    model = build_model(ModelConfig(**config)).eval()
    file = tmp_path / "llama3.gguf"
    to_gguf(model, file, tokenizer, "f16")
    reader = open_gguf(file)
    (freqs,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    rope = {
        "rope_theta": config["rope_theta"],
        "factor": config["rope_factor"],
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_divisors(rope, 64)  # convert_hf_to_gguf.py's loop, copied independently
    np.testing.assert_allclose(dequantize_tensor(reader, freqs).numpy(), expected, rtol=1e-6)
    assert len(set(expected.tolist())) > 2  # unscaled, scaled and smoothed frequencies all present
    # (transformers' GGUF loader ignores rope_freqs, so only tformer's reader, which applies it, is compared)
    ids = torch.randint(0, 320, (1, 40))
    reference = logits(f16_rounded(model), ids)
    torch.testing.assert_close(logits(from_gguf(file).eval(), ids), reference, atol=1e-5, rtol=0)


def test_mixture_of_experts_goes_out_as_llama_cpp_writes_mixtral(tmp_path, model_and_tokenizer):
    """A Mixtral-style model: `llama` with expert_count / expert_used_count, the router as ffn_gate_inp and each
    expert matrix stacked into one (experts, out, in) tensor, which tformer's reader splits back (expert j's bytes
    at offset j) to the model's f16-rounded logits; the stack order is checked against the model's own experts."""
    _, tokenizer = model_and_tokenizer
    config = ModelConfig.from_preset(
        "tiny-llama", vocab_size=320, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, n_experts=3, n_experts_per_token=2
    )
    torch.manual_seed(3)
    model = build_model(config).eval()
    file = tmp_path / "moe-f16.gguf"
    to_gguf(model, file, tokenizer, "f16")
    reader = open_gguf(file)
    assert (reader.get("llama.expert_count"), reader.get("llama.expert_used_count")) == (3, 2)
    by_name = {t.name: t for t in reader.tensors}
    up = dequantize_tensor(reader, by_name["blk.1.ffn_up_exps.weight"])
    assert up.shape == (3, 96, 64)
    for j in range(3):
        torch.testing.assert_close(up[j], model.decoder.layers[1].ffn.experts[j].up_proj.weight.half().float())
    router = by_name["blk.0.ffn_gate_inp.weight"]  # F32, as llama.cpp writes and quantizes it: never rounded
    assert router.tensor_type == GGMLQuantizationType.F32
    assert torch.equal(dequantize_tensor(reader, router), model.decoder.layers[0].ffn.router.weight)
    torch.testing.assert_close(logits(from_gguf(file).eval(), IDS), logits(f16_rounded(model), IDS), atol=1e-5, rtol=0)
    to_gguf(model, tmp_path / "moe-q4_0.gguf", tokenizer, "q4_0")
    quantized = {t.name: t.tensor_type for t in open_gguf(tmp_path / "moe-q4_0.gguf").tensors}
    assert quantized["blk.1.ffn_gate_inp.weight"] == GGMLQuantizationType.F32
    assert quantized["blk.1.ffn_up_exps.weight"] == GGMLQuantizationType.Q4_0
