"""Hugging Face decoder-only families as data: GPT-2, LLaMA (Llama 3 too), Mistral, Qwen2, Qwen3 and Phi-3
(see `hf_spec`)."""

from __future__ import annotations

import math
from typing import Any

import torch

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
    Transform,
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

QK_NORMS: Table = {f"self_attn.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}  # Qwen3, Gemma 3

ROPE_IN = {"default": "none", "linear": "linear", "dynamic": "dynamic-ntk", "yarn": "yarn", "llama3": "llama3"}
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
    if kind == "llama3":  # Llama 3.1-3.3: max_position_embeddings is the extended context, not the trained one
        fields |= {
            "rope_original_max_len": original,
            "rope_low_freq_factor": params.get("low_freq_factor", 1.0),
            "rope_high_freq_factor": params.get("high_freq_factor", 4.0),
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
    if config.rope_scaling == "llama3":
        params |= {
            "original_max_position_embeddings": config.rope_original_max_len,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
        }
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
    out_bias = config.attn_bias if config.attn_out_bias is None else config.attn_out_bias
    layer = {
        **LLAMA_LAYER,
        **({k: v for k, v in LLAMA_ATTN_BIAS.items() if "o_proj" not in k} if config.attn_bias else {}),
        **({k: v for k, v in LLAMA_ATTN_BIAS.items() if "o_proj" in k} if out_bias else {}),
        **(LLAMA_MLP_BIAS if config.ffn_bias else {}),
        **(QK_NORMS if config.qk_norm else {}),
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

# ---- Qwen2 / Qwen2.5 and Qwen3 -------------------------------------------------------------------------------------

# layer_types in config.json (transformers 5) -> tformer's names, and back
LAYER_TYPES_IN = {"sliding_attention": "sliding", "full_attention": "full"}
LAYER_TYPES_OUT = {ours: theirs for theirs, ours in LAYER_TYPES_IN.items()}


def windows_in(hf: HFFields, window: int | None, default_types: list[str]) -> dict[str, Any]:
    """sliding_window and layer_types from config.json's per-layer types (`default_types` where it has none)."""
    kinds = [lookup(LAYER_TYPES_IN, kind, "layer_types entry") for kind in hf.get("layer_types") or default_types]
    if window is None or "sliding" not in kinds:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": window, "layer_types": None if "full" not in kinds else kinds}


def windows_out(config: ModelConfig) -> dict[str, Any]:
    """config.json's sliding_window and layer_types (every layer named) for `config`."""
    kinds = config.layer_types or ["sliding" if config.sliding_window else "full"] * config.n_decoder_layers
    return {"sliding_window": config.sliding_window, "layer_types": [LAYER_TYPES_OUT[kind] for kind in kinds]}


def _qwen_in(hf: HFFields) -> dict[str, Any]:
    """Qwen's window applies (with use_sliding_window) to the layers from max_window_layers on."""
    window = hf["sliding_window"] if hf["use_sliding_window"] else None
    n_layers, first = hf["num_hidden_layers"], hf["max_window_layers"]
    default = ["sliding_attention" if window and i >= first else "full_attention" for i in range(n_layers)]
    return {**_decoder_in(hf), **windows_in(hf, window, default)}


def _qwen_out(config: ModelConfig) -> dict[str, Any]:
    windows = windows_out(config)
    return {**_decoder_out(config), **windows, "use_sliding_window": config.sliding_window is not None}


QWEN_DEFAULTS = {
    **LLAMA_DEFAULTS,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
}
QWEN2 = Family(  # q, k and v have biases, the output projection none
    "Qwen2ForCausalLM",
    "qwen2",
    {**LLAMA_FIXED, "attn_bias": True, "attn_out_bias": False, "ffn_bias": False},
    LLAMA_RENAMES,
    QWEN_DEFAULTS,
    _qwen_in,
    _qwen_out,
    _llama_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len"),
)
QWEN3 = Family(  # LLaMA's layer with a per-head RMSNorm on queries and keys
    "Qwen3ForCausalLM",
    "qwen3",
    {**LLAMA_FIXED, "ffn_bias": False, "qk_norm": True},
    {**LLAMA_RENAMES, "attn_bias": "attention_bias"},
    {**QWEN_DEFAULTS, "head_dim": 128},
    _qwen_in,
    _qwen_out,
    _llama_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len"),
)

# ---- Phi-3 ----------------------------------------------------------------------------------------------------------


def fused_rows(sizes: list[int]) -> Transform:
    """Tensors stacked along their first dimension in one checkpoint tensor, split back by `sizes`."""
    return Transform(lambda ours: torch.cat(ours), lambda t: list(t.split(sizes)))


def _phi3_in(hf: HFFields) -> dict[str, Any]:
    params = _rope_parameters(hf)
    if params["rope_type"] not in ("default", "linear", "dynamic", "yarn", "llama3"):
        raise UnsupportedHFConfig(
            f"rope_type {params['rope_type']!r} (Phi-3's long-context RoPE with per-pair factors) has no tformer "
            "equivalent; tformer reads Phi-3 checkpoints with the default RoPE (the 4k-context models)"
        )
    return _decoder_in(hf)


def _phi3_out(config: ModelConfig) -> dict[str, Any]:
    return {**_decoder_out(config), "original_max_position_embeddings": config.max_seq_len}


def _phi3_tensors(config: ModelConfig) -> tuple[Table, Table]:
    """LLaMA's tensors with q, k, v in one qkv_proj and the gate before the up projection in one gate_up_proj."""
    q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    layer = {
        "self_attn.qkv_proj.weight": (
            tuple(f"self_attn.{x}_proj.weight" for x in "qkv"),
            fused_rows([q_rows, kv_rows, kv_rows]),
        ),
        "self_attn.o_proj.weight": "self_attn.out_proj.weight",
        "mlp.gate_up_proj.weight": (("ffn.gate_proj.weight", "ffn.up_proj.weight"), fused_rows([config.d_ff] * 2)),
        "mlp.down_proj.weight": "ffn.down_proj.weight",
        "input_layernorm.weight": "norm_attn.norm.weight",
        "post_attention_layernorm.weight": "norm_ffn.norm.weight",
    }
    base = {**LLAMA_GLOBAL, **per_layer(layer, config.n_decoder_layers, "layers.{i}.", "decoder.layers.{i}.")}
    return base, {} if config.tie_embeddings else {"lm_head.weight": "lm_head.weight"}


PHI3 = Family(  # one window for every layer (sliding_window), or none
    "Phi3ForCausalLM",
    "phi3",
    {**LLAMA_FIXED, "attn_bias": False, "ffn_bias": False},
    {**LLAMA_RENAMES, "sliding_window": "sliding_window"},
    {
        **LLAMA_DEFAULTS,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "partial_rotary_factor": 1.0,
    },
    _phi3_in,
    _phi3_out,
    _phi3_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len"),
)
