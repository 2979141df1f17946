"""Hugging Face decoder-only families as data: GPT-2, LLaMA and Mistral (see `hf_spec`)."""

from __future__ import annotations

import math
from typing import Any

from tformer.config import ModelConfig
from tformer.interop.hf_spec import (
    CONV1D,
    FUSED,
    FUSED_CONV1D,
    GATED_IN,
    GATED_OUT,
    MLP_IN,
    MLP_OUT,
    Family,
    HFFields,
    Table,
    UnsupportedHFConfig,
    lookup,
    per_layer,
    weight_bias,
)

# ---- GPT-2 ----------------------------------------------------------------------------------------------------------

GPT2_FIXED = {
    "family": "decoder",
    "n_encoder_layers": 0,
    "position": "learned",
    "norm": "layernorm",
    "norm_bias": True,
    "norm_placement": "pre",
    "embedding_norm": False,
    "scale_embeddings": False,
    "type_vocab_size": 0,
    "sliding_window": None,
    "attn_bias": True,
    "ffn_bias": True,
    "lm_head_bias": False,
    "init": "gpt2",
}
GPT2_RENAMES = {
    "vocab_size": "vocab_size",
    "d_model": "n_embd",
    "n_decoder_layers": "n_layer",
    "n_heads": "n_head",
    "max_seq_len": "n_positions",
    "norm_eps": "layer_norm_epsilon",
    "tie_embeddings": "tie_word_embeddings",
    "dropout": "resid_pdrop",
    "attn_dropout": "attn_pdrop",
    "init_std": "initializer_range",
}
GPT2_DEFAULTS = {
    "n_positions": 1024,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
    "resid_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "initializer_range": 0.02,
    "activation_function": "gelu_new",
    "n_inner": None,
}
GPT2_REQUIRED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
GPT2_GLOBAL: Table = {
    "wte.weight": "decoder.tokens.weight",
    "wpe.weight": "decoder.positions.embedding.weight",
    **weight_bias("ln_f", "decoder.final_norm"),
}
GPT2_LAYER: Table = {
    "attn.c_attn.weight": (tuple(f"self_attn.{x}_proj.weight" for x in "qkv"), FUSED_CONV1D),
    "attn.c_attn.bias": (tuple(f"self_attn.{x}_proj.bias" for x in "qkv"), FUSED),
    "attn.c_proj.weight": (("self_attn.out_proj.weight",), CONV1D),
    "attn.c_proj.bias": "self_attn.out_proj.bias",
    "mlp.c_fc.weight": (("ffn.up_proj.weight",), CONV1D),
    "mlp.c_fc.bias": "ffn.up_proj.bias",
    "mlp.c_proj.weight": (("ffn.down_proj.weight",), CONV1D),
    "mlp.c_proj.bias": "ffn.down_proj.bias",
    **weight_bias("ln_1", "norm_attn.norm"),
    **weight_bias("ln_2", "norm_ffn.norm"),
}


def _gpt2_in(hf: HFFields) -> dict[str, Any]:
    return {
        "ffn": lookup(MLP_IN, hf["activation_function"], "activation_function"),
        "d_ff": hf["n_inner"] or 4 * hf["n_embd"],
    }


def _gpt2_out(config: ModelConfig) -> dict[str, Any]:
    return {"activation_function": lookup(MLP_OUT, config.ffn, "ffn", "Hugging Face"), "n_inner": config.d_ff}


def _gpt2_tensors(config: ModelConfig) -> tuple[Table, Table]:
    base = {**GPT2_GLOBAL, **per_layer(GPT2_LAYER, config.n_decoder_layers, "h.{i}.", "decoder.layers.{i}.")}
    return base, {} if config.tie_embeddings else {"lm_head.weight": "lm_head.weight"}


GPT2 = Family(
    "GPT2LMHeadModel",
    "gpt2",
    GPT2_FIXED,
    GPT2_RENAMES,
    GPT2_DEFAULTS,
    _gpt2_in,
    _gpt2_out,
    _gpt2_tensors,
    prefixes=("transformer.", ""),
    required=GPT2_REQUIRED,
    ignored=("lm_head.weight", "*h.*.attn.bias", "*h.*.attn.masked_bias"),
    loose=("n_encoder_layers",),
)
GPT2_BARE = Family(  # the base model alone: its output projection can only be the tied embedding
    "GPT2Model",
    "gpt2",
    {**GPT2_FIXED, "tie_embeddings": True},
    {k: v for k, v in GPT2_RENAMES.items() if k != "tie_embeddings"},
    GPT2_DEFAULTS,
    _gpt2_in,
    _gpt2_out,
    _gpt2_tensors,
    prefixes=("", "transformer."),
    required=GPT2_REQUIRED,
    ignored=("*h.*.attn.bias", "*h.*.attn.masked_bias"),
    loose=("n_encoder_layers",),
)

# ---- LLaMA and Mistral ----------------------------------------------------------------------------------------------

LLAMA_FIXED = {
    "family": "decoder",
    "n_encoder_layers": 0,
    "position": "rope",
    "norm": "rmsnorm",
    "norm_placement": "pre",
    "embedding_norm": False,
    "scale_embeddings": False,
    "type_vocab_size": 0,
    "lm_head_bias": False,
    "init": "normal",
    "dropout": 0.0,
}
LLAMA_RENAMES = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_decoder_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "attn_dropout": "attention_dropout",
    "init_std": "initializer_range",
}
LLAMA_DEFAULTS = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "hidden_act": "silu",
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
    "mlp_bias": False,
}
LLAMA_GLOBAL: Table = {"embed_tokens.weight": "decoder.tokens.weight", "norm.weight": "decoder.final_norm.weight"}
LLAMA_LAYER: Table = {
    **{f"self_attn.{x}_proj.weight": f"self_attn.{x}_proj.weight" for x in "qkv"},
    "self_attn.o_proj.weight": "self_attn.out_proj.weight",
    **{f"mlp.{x}_proj.weight": f"ffn.{x}_proj.weight" for x in ("gate", "up", "down")},
    "input_layernorm.weight": "norm_attn.norm.weight",
    "post_attention_layernorm.weight": "norm_ffn.norm.weight",
}
LLAMA_ATTN_BIAS: Table = {
    **{f"self_attn.{x}_proj.bias": f"self_attn.{x}_proj.bias" for x in "qkv"},
    "self_attn.o_proj.bias": "self_attn.out_proj.bias",
}
LLAMA_MLP_BIAS: Table = {f"mlp.{x}_proj.bias": f"ffn.{x}_proj.bias" for x in ("gate", "up", "down")}

ROPE_IN = {"default": "none", "linear": "linear", "dynamic": "dynamic-ntk", "yarn": "yarn"}
ROPE_OUT = {ours: theirs for theirs, ours in ROPE_IN.items()}


def _rope_parameters(hf: HFFields) -> dict[str, Any]:
    """rope_parameters (transformers 5) or rope_scaling + rope_theta (transformers 4), in one dict."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise UnsupportedHFConfig("rope_parameters differ per layer type, which tformer cannot represent")
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedHFConfig("partial_rotary_factor != 1 (RoPE on part of each head) has no tformer equivalent")
    return params


def _rope_in(hf: HFFields) -> dict[str, Any]:
    params = _rope_parameters(hf)
    kind = lookup(ROPE_IN, params["rope_type"], "rope_type")
    fields: dict[str, Any] = {"rope_theta": params["rope_theta"], "rope_scaling": kind}
    if kind == "none":
        return fields
    original = params.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    fields["rope_factor"] = factor
    if kind == "dynamic-ntk":  # transformers grows the base past max_position_embeddings, the trained context
        fields |= {
            "rope_original_max_len": hf["max_position_embeddings"],
            "max_seq_len": int(hf["max_position_embeddings"] * factor),
        }
    if kind == "yarn":
        _check_yarn(params, factor)
        fields |= {
            "rope_original_max_len": original,
            "yarn_beta_fast": params.get("beta_fast") or 32.0,
            "yarn_beta_slow": params.get("beta_slow") or 1.0,
        }
    return fields


def _check_yarn(params: dict[str, Any], factor: float) -> None:
    """tformer's YaRN uses the paper's attention temperature 0.1 ln(s) + 1 and truncated correction bounds."""
    default = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    attention_factor = params.get("attention_factor")
    if attention_factor is not None and abs(attention_factor - default) > 1e-6:
        raise UnsupportedHFConfig(f"rope_parameters.attention_factor={attention_factor} (tformer uses {default:.6f})")
    if params.get("mscale") and params.get("mscale_all_dim"):
        raise UnsupportedHFConfig("rope_parameters.mscale / mscale_all_dim (DeepSeek's YaRN variant)")
    if params.get("truncate", True) is not True:
        raise UnsupportedHFConfig("rope_parameters.truncate=false (untruncated YaRN correction range)")


def _rope_out(config: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": ROPE_OUT[config.rope_scaling], "rope_theta": config.rope_theta}
    out: dict[str, Any] = {"rope_parameters": params}
    if config.rope_scaling != "none":
        params["factor"] = config.rope_factor
    if config.rope_scaling == "dynamic-ntk":
        out["max_position_embeddings"] = config.rope_original_max_len
    if config.rope_scaling == "yarn":
        params |= {
            "original_max_position_embeddings": config.rope_original_max_len,
            "beta_fast": config.yarn_beta_fast,
            "beta_slow": config.yarn_beta_slow,
        }
    return out


def _decoder_in(hf: HFFields) -> dict[str, Any]:
    return {
        "ffn": lookup(GATED_IN, hf["hidden_act"], "hidden_act"),
        "n_kv_heads": hf["num_key_value_heads"],
        "head_dim": hf["head_dim"],
        **_rope_in(hf),
    }


def _decoder_out(config: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_act": lookup(GATED_OUT, config.ffn, "ffn", "Hugging Face"),
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        **_rope_out(config),
    }


def _llama_tensors(config: ModelConfig) -> tuple[Table, Table]:
    layer = {
        **LLAMA_LAYER,
        **(LLAMA_ATTN_BIAS if config.attn_bias else {}),
        **(LLAMA_MLP_BIAS if config.ffn_bias else {}),
    }
    base = {**LLAMA_GLOBAL, **per_layer(layer, config.n_decoder_layers, "layers.{i}.", "decoder.layers.{i}.")}
    return base, {} if config.tie_embeddings else {"lm_head.weight": "lm_head.weight"}


LLAMA_IGNORED = ("lm_head.weight", "*.rotary_emb.inv_freq")
LLAMA = Family(  # LlamaConfig has no sliding window: transformers ignores a sliding_window key, and so does tformer
    "LlamaForCausalLM",
    "llama",
    {**LLAMA_FIXED, "sliding_window": None},
    {**LLAMA_RENAMES, "attn_bias": "attention_bias", "ffn_bias": "mlp_bias"},
    LLAMA_DEFAULTS,
    _decoder_in,
    _decoder_out,
    _llama_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len"),
)
MISTRAL = Family(  # MistralConfig has no bias switches
    "MistralForCausalLM",
    "mistral",
    {**LLAMA_FIXED, "attn_bias": False, "ffn_bias": False},
    {**LLAMA_RENAMES, "sliding_window": "sliding_window"},
    {**LLAMA_DEFAULTS, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    _decoder_in,
    _decoder_out,
    _llama_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len"),
)
