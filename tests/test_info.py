"""`tformer info` arithmetic: FLOPs checked against torch's FLOP counter, KV bytes against the seed."""

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tformer import ConfigError, ModelConfig, build_model
from tformer.info import format_info, model_info


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-bert", "tiny-transformer"])
def test_forward_flops_match_torch_flop_counter(name):
    config = ModelConfig.from_preset(name, attention_backend="math")  # every matmul visible to the counter
    model = build_model(config).eval()
    T = 16
    tokens = torch.randint(0, config.vocab_size, (1, T))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens, tokens) if config.family == "encoder-decoder" else model(tokens)
    assert model_info(config, context=T).forward_flops_per_token * T == counter.get_total_flops()


def test_kv_cache_reproduces_the_seed_example():
    # Seed 001 sec. 5.1: LLaMA-7B in fp16 holds 2 x 32 x 4096 x 2 bytes = 0.5 MB per token, 1 GB at 2048.
    info = model_info(ModelConfig.from_preset("llama2-7b"), context=2048, kv_dtype="fp16")
    assert info.kv_bytes_per_token == 2**19
    assert info.kv_bytes_at_context == 2**30


def test_kv_cache_gqa_and_sliding_window():
    info = model_info(ModelConfig.from_preset("mistral-7b"), context=32768, kv_dtype="bf16")
    assert info.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 8 KV heads instead of 32
    assert info.kv_cached_tokens == 4096  # the rolling buffer never holds more than the window


def test_int8_kv_bytes_are_what_the_engine_allocates():
    """`info --kv-dtype int8` counts the float32 scale the engine keeps per head vector: SmolLM2-135M's figure is the
    engine's own `kv_bytes_per_token` for an int8 cache."""
    from tformer.engine.paged import kv_bytes_per_token

    config = ModelConfig.from_preset("smollm2-135m")
    info = model_info(config, context=2048, kv_dtype="int8")
    assert info.kv_bytes_per_token == 2 * 3 * (64 + 4) * 30
    with torch.device("meta"):
        model = build_model(config)
    assert info.kv_bytes_per_token == kv_bytes_per_token(model, "int8")


def test_training_flops_are_three_forward_passes_and_near_6n():
    info = model_info(ModelConfig.from_preset("llama2-7b"), context=1)
    assert info.training_flops_per_token == 3 * info.forward_flops_per_token
    assert info.training_flops_per_token == pytest.approx(6 * info.n_params_non_embedding, rel=0.03)


def test_encoder_has_no_kv_cache_and_format_mentions_it():
    config = ModelConfig.from_preset("bert-base")
    info = model_info(config)
    assert info.kv_bytes_per_token == 0
    assert "KV cache       none" in format_info("bert-base", config, info)


def test_bad_dtype_and_context():
    config = ModelConfig.from_preset("tiny-gpt2")
    with pytest.raises(ConfigError, match="unknown dtype 'fp12'"):
        model_info(config, kv_dtype="fp12")
    with pytest.raises(ConfigError, match="context must be at least 1"):
        model_info(config, context=0)


def test_moe_flops_count_the_chosen_experts_and_the_router():
    """A mixture of experts costs the router plus n_experts_per_token expert FFNs per token (hand formula, and
    torch's FLOP counter on the routed forward); the parameters still hold every expert."""
    config = ModelConfig.from_preset(
        "tiny-llama", n_experts=4, n_experts_per_token=2, moe_d_ff=24, attention_backend="math"
    )
    d, hd, T = config.d_model, config.head_dim, 16
    attention = 2 * (d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2) + 4 * config.n_heads * hd * T
    ffn = 2 * d * 4 + 2 * 2 * (3 * d * 24)  # router, then 2 of the 4 SwiGLU experts (gate, up, down)
    head = 2 * d * config.vocab_size
    info = model_info(config, context=T)
    assert info.forward_flops_per_token == config.n_decoder_layers * (attention + ffn) + head
    expert = 3 * d * 24
    assert info.n_params - model_info(replace(config, n_experts_per_token=4)).n_params == 0
    assert info.n_params_non_embedding >= config.n_decoder_layers * 4 * expert
    model = build_model(config).eval()
    tokens = torch.randint(0, config.vocab_size, (1, T))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens)
    assert info.forward_flops_per_token * T == counter.get_total_flops()
    dense = model_info(replace(config, n_experts_per_token=4), context=T)
    assert dense.forward_flops_per_token - info.forward_flops_per_token == config.n_decoder_layers * 2 * 2 * expert


def test_layers_of_mixed_windows_count_their_own_keys():
    """Gemma-style layer_types: a sliding layer reads the last sliding_window keys, a full one all; the KV cache
    keeps every token, as the engine does, once one layer sees every key."""
    full = ModelConfig.from_preset("tiny-llama", n_decoder_layers=3)
    mixed = replace(full, sliding_window=4, layer_types=["sliding", "full", "sliding"])
    T = 16
    saved = 2 * 4 * full.n_heads * full.head_dim * (T - 4)  # two sliding layers, 4 FLOPs per key and head dim
    assert (
        model_info(full, context=T).decoder_flops_per_token - model_info(mixed, context=T).decoder_flops_per_token
        == saved
    )
    assert model_info(mixed, context=T).kv_cached_tokens == T
    assert model_info(replace(mixed, layer_types=None), context=T).kv_cached_tokens == 4
