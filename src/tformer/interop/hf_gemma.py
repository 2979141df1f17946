"""Hugging Face Gemma 2 and Gemma 3 (text) as data (see `hf_spec`).

Both are LLaMA's decoder with: token embeddings times sqrt(d_model) (rounded to the weights' dtype), RMSNorms that
scale by (1 + weight), a norm before and after each sublayer (tformer's 'sandwich' placement), GeGLU with the tanh
GELU, scores scaled by query_pre_attn_scalar**-0.5, and sliding-window layers among full ones (`layer_types`).
Gemma 2 adds tanh soft caps on the attention scores and the final logits; Gemma 3 adds a per-head RMSNorm on
queries and keys and a RoPE base of its own for the sliding-window layers.
"""

from __future__ import annotations

from typing import Any

from tformer.config import ModelConfig
from tformer.interop.hf_decoders import (
    LLAMA_DEFAULTS,
    LLAMA_FIXED,
    LLAMA_GLOBAL,
    LLAMA_IGNORED,
    LLAMA_RENAMES,
    QK_NORMS,
    _rope_in,
    _rope_out,
    windows_in,
    windows_out,
)
from tformer.interop.hf_spec import GATED_IN, GATED_OUT, Family, HFFields, Table, UnsupportedHFConfig, lookup, per_layer

# Gemma names its activation hidden_activation; gelu_pytorch_tanh is the tanh approximation (geglu-tanh)
GEMMA_ACT_IN = {**GATED_IN, "gelu_pytorch_tanh": "geglu-tanh"}
GEMMA_ACT_OUT = {**GATED_OUT, "geglu-tanh": "gelu_pytorch_tanh"}

GEMMA_FIXED = {
    **LLAMA_FIXED,
    "norm": "rmsnorm-plus-one",
    "norm_placement": "sandwich",
    "scale_embeddings": True,
    "round_embed_scale": True,
    "ffn_bias": False,
}
GEMMA_RENAMES = {
    **LLAMA_RENAMES,
    "attn_bias": "attention_bias",
    "attention_scale_dim": "query_pre_attn_scalar",
    "final_logit_softcap": "final_logit_softcapping",
}
GEMMA_DEFAULTS = {
    **LLAMA_DEFAULTS,
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 256,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": None,
    "use_bidirectional_attention": None,
}
GEMMA_LAYER: Table = {
    **{f"self_attn.{x}_proj.weight": f"self_attn.{x}_proj.weight" for x in "qkv"},
    "self_attn.o_proj.weight": "self_attn.out_proj.weight",
    **{f"mlp.{x}_proj.weight": f"ffn.{x}_proj.weight" for x in ("gate", "up", "down")},
    "input_layernorm.weight": "norm_attn.norm_in.weight",
    "post_attention_layernorm.weight": "norm_attn.norm_out.weight",
    "pre_feedforward_layernorm.weight": "norm_ffn.norm_in.weight",
    "post_feedforward_layernorm.weight": "norm_ffn.norm_out.weight",
}
GEMMA_ATTN_BIAS: Table = {
    **{f"self_attn.{x}_proj.bias": f"self_attn.{x}_proj.bias" for x in "qkv"},
    "self_attn.o_proj.bias": "self_attn.out_proj.bias",
}


def _common_in(hf: HFFields, default_types: list[str]) -> dict[str, Any]:
    if hf["use_bidirectional_attention"]:
        raise UnsupportedHFConfig("use_bidirectional_attention=true (Gemma as an encoder) has no tformer equivalent")
    return {
        "ffn": lookup(GEMMA_ACT_IN, hf["hidden_activation"], "hidden_activation"),
        "n_kv_heads": hf["num_key_value_heads"],
        "head_dim": hf["head_dim"],
        **windows_in(hf, hf["sliding_window"], default_types),
    }


def _common_out(config: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_activation": lookup(GEMMA_ACT_OUT, config.ffn, "ffn", "Hugging Face"),
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "use_bidirectional_attention": False,
        **windows_out(config),
    }


def _gemma2_in(hf: HFFields) -> dict[str, Any]:
    """Every other layer, from the first, has the sliding window."""
    n_layers = hf["num_hidden_layers"]
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    return {**_common_in(hf, default), **_rope_in(hf), "attn_logit_softcap": hf["attn_logit_softcapping"]}


def _gemma2_out(config: ModelConfig) -> dict[str, Any]:
    return {**_common_out(config), **_rope_out(config), "attn_logit_softcapping": config.attn_logit_softcap}


def _gemma3_in(hf: HFFields) -> dict[str, Any]:
    """Layers 6k + 5 are full (sliding_window_pattern 6) unless layer_types says otherwise; rope_parameters holds
    one entry per layer type, and the sliding layers' must be the plain RoPE."""
    pattern = hf.get("sliding_window_pattern") or 6
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(hf["num_hidden_layers"])]
    params = hf.get("rope_parameters") or {}
    full, local = params.get("full_attention", {}), params.get("sliding_attention", {})
    if local.get("rope_type", "default") != "default":
        raise UnsupportedHFConfig(
            f"rope_parameters.sliding_attention.rope_type {local['rope_type']!r}: tformer scales only the full "
            "layers' RoPE (the local one is plain, as in Gemma 3's releases)"
        )
    full_hf = HFFields({**hf, "rope_parameters": {"rope_theta": hf.get("rope_theta", 1_000_000.0), **full}})
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    return {**_common_in(hf, default), **_rope_in(full_hf), "rope_local_theta": local_theta}


def _gemma3_out(config: ModelConfig) -> dict[str, Any]:
    local_theta = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
    rope = {
        "full_attention": _rope_out(config)["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
    }
    return {**_common_out(config), "rope_parameters": rope}


def _gemma_tensors(config: ModelConfig) -> tuple[Table, Table]:
    layer = {
        **GEMMA_LAYER,
        **(GEMMA_ATTN_BIAS if config.attn_bias else {}),
        **(QK_NORMS if config.qk_norm else {}),
    }
    base = {**LLAMA_GLOBAL, **per_layer(layer, config.n_decoder_layers, "layers.{i}.", "decoder.layers.{i}.")}
    return base, {} if config.tie_embeddings else {"lm_head.weight": "lm_head.weight"}


GEMMA2 = Family(
    "Gemma2ForCausalLM",
    "gemma2",
    {**GEMMA_FIXED, "qk_norm": False, "rope_local_theta": None},
    GEMMA_RENAMES,
    {**GEMMA_DEFAULTS, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    _gemma2_in,
    _gemma2_out,
    _gemma_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len"),
)
GEMMA3 = Family(  # transformers' Gemma 3 attention ignores attn_logit_softcapping, and so does tformer
    "Gemma3ForCausalLM",
    "gemma3_text",
    {**GEMMA_FIXED, "qk_norm": True, "attn_logit_softcap": None},
    GEMMA_RENAMES,
    {**GEMMA_DEFAULTS, "max_position_embeddings": 131072, "final_logit_softcapping": None},
    _gemma3_in,
    _gemma3_out,
    _gemma_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len"),
)


def _text_config(hf_config: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A multimodal Gemma 3's text model: its text_config, with the head tying the outer config sets."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedHFConfig("has no text_config, which Gemma3ForConditionalGeneration keeps its text model in")
    return {**text, "tie_word_embeddings": hf_config.get("tie_word_embeddings", True)}


def _multimodal_tensors(config: ModelConfig) -> tuple[Table, Table]:
    base, head = _gemma_tensors(config)
    return base, {f"language_model.{name}": entry for name, entry in head.items()}


GEMMA3_MULTIMODAL = Family(  # read only (to_hf writes the text model as Gemma3ForCausalLM)
    "Gemma3ForConditionalGeneration",
    "gemma3",
    {**GEMMA3.fixed, "final_logit_softcap": None},  # transformers applies no final cap here (the releases set none)
    {ours: theirs for ours, theirs in GEMMA3.renames.items() if ours != "final_logit_softcap"},
    GEMMA3.defaults,
    _gemma3_in,
    _gemma3_out,
    _multimodal_tensors,
    prefixes=("language_model.model.", "model.language_model."),
    ignored=(*LLAMA_IGNORED, "language_model.lm_head.weight"),
    dropped=("vision_tower.*", "multi_modal_projector.*"),
    dropped_note="tformer reads Gemma 3's text model; the vision tower and its projector are left out.",
    loose=GEMMA3.loose,
    complete_config=_text_config,
)
