"""Model weights: embedding scaling, tying and sharing, initialization (GPT-2, Xavier, DeepNet), save/load, and
parity with `transformers`: each against the paper's formula, the same model before saving, or `transformers`
running the same weights (written by tformer.interop.hf.to_hf).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import logits, make_model, tiny_config, tokens

import tformer
from tformer import ModelConfig, TransformerModel
from tformer.interop.hf import to_hf
from tformer.layers import sinusoidal_table

# ---- embeddings ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [True, False])
def test_token_embeddings_are_scaled_by_sqrt_d_model(scale: bool) -> None:
    config = tiny_config("tiny-transformer", scale_embeddings=scale)
    stack = make_model(config).encoder
    ids, positions = tokens(2, 6, config.vocab_size), torch.arange(6).expand(2, 6)
    factor = math.sqrt(config.d_model) if scale else 1.0
    expected = stack.tokens.weight[ids] * factor + sinusoidal_table(config.max_seq_len, config.d_model)[positions]
    torch.testing.assert_close(stack.embed(ids, positions), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("preset", ["tiny-transformer", "tiny-gpt2", "tiny-bert"])
def test_tied_output_projection_shares_the_token_embedding(preset: str, tie: bool) -> None:
    model = make_model(tiny_config(preset, tie_embeddings=tie))
    stack = model.encoder if model.config.family == "encoder" else model.decoder
    head = model.mlm_head.lm_head if model.config.family == "encoder" else model.lm_head
    assert (head.weight is stack.tokens.weight) == tie
    assert (head.weight.data_ptr() == stack.tokens.weight.data_ptr()) == tie
    if tie:  # one tensor: changing the embedding changes the head
        with torch.no_grad():
            stack.tokens.weight[3].add_(1.0)
        assert torch.equal(head.weight[3], stack.tokens.weight[3])


@pytest.mark.parametrize("share", [True, False])
def test_encoder_decoder_shares_source_and_target_embeddings(share: bool) -> None:
    model = make_model(tiny_config("tiny-transformer", share_embeddings=share))
    assert (model.encoder.tokens.weight is model.decoder.tokens.weight) == share
    names = {name for name, _ in model.named_parameters()}
    assert ("decoder.tokens.weight" in names) != share  # a shared Parameter is registered once


def test_xavier_init_keeps_tied_embeddings_normal_with_std_d_to_minus_half() -> None:
    # fairseq / the 2017 paper: embeddings N(0, d^-0.5), also when the output projection is tied to them
    config = tiny_config("tiny-transformer", vocab_size=4000, d_model=64)
    weight = make_model(config).encoder.tokens.weight
    assert weight.std().item() == pytest.approx(config.d_model**-0.5, rel=0.05)


# ---- save / load --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny-transformer", {}),
        ("tiny-gpt2", {}),
        ("tiny-llama", {"rope_scaling": "yarn", "rope_factor": 2.0}),
        ("tiny-bert", {"position": "alibi"}),
    ],
)
def test_save_then_load_gives_identical_logits(preset: str, overrides: dict, tmp_path: Path) -> None:
    model = make_model(tiny_config(preset, **overrides))
    model.save(tmp_path / "ckpt")
    loaded = tformer.load(tmp_path / "ckpt").eval()
    assert loaded.config == model.config
    config = model.config
    tgt, src = tokens(2, 8, config.tgt_vocab_size), tokens(2, 6, config.vocab_size, seed=2)
    with torch.no_grad():
        assert torch.equal(logits(loaded, tgt, src=src), logits(model, tgt, src=src))
    if config.tie_embeddings:  # ties survive the round trip
        stack = loaded.encoder if config.family == "encoder" else loaded.decoder
        head = loaded.mlm_head.lm_head if config.family == "encoder" else loaded.lm_head
        assert head.weight is stack.tokens.weight


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"d_model": 64}, "wrong shapes ["),  # same names, other shapes
        ({"n_decoder_layers": 3}, "missing ['decoder.layers.2."),  # weights for fewer layers than the config
        ({"n_decoder_layers": 1}, "unexpected ['decoder.layers.1."),  # weights for more layers
        ({"position": "rope"}, "unexpected ['decoder.positions.embedding.weight']"),
    ],
)
def test_loading_weights_that_do_not_match_the_config_raises(change: dict, message: str, tmp_path: Path) -> None:
    model = make_model(tiny_config("tiny-gpt2"))
    model.save(tmp_path)
    ModelConfig.from_dict({**model.config.to_dict(), **change}).to_file(tmp_path / "config.yaml")
    with pytest.raises(tformer.CheckpointError) as err:
        tformer.load(tmp_path)
    assert "model.safetensors" in str(err.value) and message in str(err.value)


def test_loading_an_incomplete_checkpoint_names_the_missing_file(tmp_path: Path) -> None:
    make_model(tiny_config("tiny-gpt2")).save(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(tformer.CheckpointError, match="model.safetensors is missing"):
        tformer.load(tmp_path)


# ---- initialization -----------------------------------------------------------------------------------------------


def test_gpt2_init_scales_residual_projections() -> None:
    n_layers = 8
    config = tiny_config("tiny-gpt2", d_model=256, n_heads=4, d_ff=1024, n_decoder_layers=n_layers)
    model = make_model(config)
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    for layer in model.decoder.layers:
        assert layer.self_attn.out_proj.weight.std().item() == pytest.approx(residual_std, rel=0.03)
        assert layer.ffn.down_proj.weight.std().item() == pytest.approx(residual_std, rel=0.03)
        assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.03)
        assert layer.ffn.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert model.decoder.tokens.weight.std().item() == pytest.approx(0.02, rel=0.03)


DEEPNORM_BETAS = {  # DeepNet's beta for 4-layer stacks, written out per family and stack
    "decoder": {"decoder": (8 * 4) ** -0.25},
    "encoder": {"encoder": (8 * 4) ** -0.25},
    "encoder-decoder": {"encoder": 0.87 * (4**4 * 4) ** (-1 / 16), "decoder": (12 * 4) ** -0.25},
}


@pytest.mark.parametrize("family", DEEPNORM_BETAS)
def test_deepnorm_init_scales_value_and_output_projections_by_beta(family: str) -> None:
    config = tiny_config(
        family, d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=4, n_decoder_layers=4, norm_placement="deepnorm"
    )
    model = make_model(config)
    square_std = math.sqrt(2 / (256 + 256))  # Xavier-normal std for a 256 x 256 weight
    ffn_std = math.sqrt(2 / (256 + 1024))
    for stack_name, beta in DEEPNORM_BETAS[family].items():
        assert config.deepnorm_coefficients(stack_name)[1] == pytest.approx(beta, rel=1e-12)
        for layer in getattr(model, stack_name).layers:
            for attn in filter(None, (layer.self_attn, layer.cross_attn)):
                assert attn.v_proj.weight.std().item() == pytest.approx(beta * square_std, rel=0.03)
                assert attn.out_proj.weight.std().item() == pytest.approx(beta * square_std, rel=0.03)
                assert attn.q_proj.weight.std().item() == pytest.approx(square_std, rel=0.03)
                assert attn.k_proj.weight.std().item() == pytest.approx(square_std, rel=0.03)
            assert layer.ffn.up_proj.weight.std().item() == pytest.approx(beta * ffn_std, rel=0.03)
            assert layer.ffn.down_proj.weight.std().item() == pytest.approx(beta * ffn_std, rel=0.03)


# ---- parity with transformers -------------------------------------------------------------------------------------


def randomize_norms(model: TransformerModel) -> TransformerModel:
    """Norm gains and biases away from 1 and 0 (and a random MLM bias), so a misplaced norm shows up."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("lm_head.bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return model


def in_transformers(model: TransformerModel, path: Path, auto_class: str):
    """The same model in transformers: written by tformer.interop.hf.to_hf, read by transformers (eager attention)."""
    import transformers

    to_hf(model, path)
    return getattr(transformers, auto_class).from_pretrained(path, attn_implementation="eager").eval()


LLAMA_ROPE = {  # tformer's fields and the rope_parameters transformers must see for them
    "none": ({}, {"rope_type": "default"}),
    "linear": ({"rope_scaling": "linear", "rope_factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    "yarn": (
        {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_len": 16},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ),
}


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("rope", LLAMA_ROPE)
def test_llama_matches_transformers(rope: str, window: int | None, tmp_path: Path) -> None:
    ours_rope, hf_rope = LLAMA_ROPE[rope]
    config = tiny_config("tiny-llama", rope_theta=500.0, sliding_window=window, **ours_rope)
    model = randomize_norms(make_model(config))
    hf = in_transformers(model, tmp_path, "AutoModelForCausalLM")
    assert type(hf).__name__ == ("LlamaForCausalLM" if window is None else "MistralForCausalLM")  # Mistral: + window
    written = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert {"rope_theta": 500.0, **hf_rope}.items() <= written.items()
    ids = tokens(2, 12, 97)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_gpt2_matches_transformers(tmp_path: Path) -> None:
    model = randomize_norms(make_model(tiny_config("tiny-gpt2")))
    hf = in_transformers(model, tmp_path, "AutoModelForCausalLM")
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.activation_function == "gelu_new"
    ids = tokens(2, 12, 97)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_bert_matches_transformers(tmp_path: Path) -> None:
    model = randomize_norms(make_model(tiny_config("tiny-bert")))
    hf = in_transformers(model, tmp_path, "AutoModelForMaskedLM")
    assert type(hf).__name__ == "BertForMaskedLM"
    ids, types = tokens(2, 10, 97), torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])  # right padding
    with torch.no_grad():
        ours, theirs = model(ids, mask, types), hf(ids, attention_mask=mask, token_type_ids=types).logits
    kept = mask.bool()  # transformers leaves padded positions unspecified
    torch.testing.assert_close(ours[kept], theirs[kept], atol=1e-5, rtol=1e-5)
