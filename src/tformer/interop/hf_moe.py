"""Hugging Face mixture-of-experts decoders as data: Mixtral and Qwen3-MoE (see `hf_spec`).

Both are LLaMA-shaped decoders whose FFNs are routed experts. Their checkpoints keep each expert's SwiGLU as three
matrices (Mixtral's w1 / w3 / w2 are gate / up / down) and the router as `gate`; tformer's `MixtureOfExperts`
holds the same tensors as `ffn.router` and `ffn.experts.{j}.{gate,up,down}_proj`.
"""

from __future__ import annotations

from typing import Any

from tformer.config import ModelConfig
from tformer.interop.hf_decoders import LLAMA_DEFAULTS, LLAMA_FIXED, LLAMA_GLOBAL, LLAMA_IGNORED, LLAMA_RENAMES
from tformer.interop.hf_decoders import _decoder_in as decoder_in
from tformer.interop.hf_decoders import _decoder_out as decoder_out
from tformer.interop.hf_spec import Family, HFFields, Table, UnsupportedHFConfig

ATTENTION: Table = {
    **{f"self_attn.{x}_proj.weight": f"self_attn.{x}_proj.weight" for x in "qkv"},
    "self_attn.o_proj.weight": "self_attn.out_proj.weight",
    "input_layernorm.weight": "norm_attn.norm.weight",
    "post_attention_layernorm.weight": "norm_ffn.norm.weight",
}
ATTENTION_BIAS: Table = {f"self_attn.{x}_proj.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
DENSE_MLP: Table = {f"mlp.{x}_proj.weight": f"ffn.{x}_proj.weight" for x in ("gate", "up", "down")}
MOE_FIXED = {**LLAMA_FIXED, "ffn_bias": False}


def _experts(theirs: str, names: dict[str, str], n_experts: int) -> Table:
    """Each expert's three matrices: `names` maps tformer's gate/up/down to the checkpoint's names."""
    return {
        f"{theirs}.experts.{j}.{names[ours]}.weight": f"ffn.experts.{j}.{ours}_proj.weight"
        for j in range(n_experts)
        for ours in ("gate", "up", "down")
    }


def _layers(config: ModelConfig, layer: Table, dense: Table) -> Table:
    """`layer` for each block, with `dense` instead for the blocks in moe_dense_layers; 'ffn.' is the block's."""
    dense_layers = set(config.moe_dense_layers or [])
    return {
        f"layers.{i}.{theirs}": f"decoder.layers.{i}.{ours}"
        for i in range(config.n_decoder_layers)
        for theirs, ours in (dense if i in dense_layers else layer).items()
    }


def _n_experts(hf: HFFields, key: str) -> int:
    n_experts = hf[key]
    if not isinstance(n_experts, int) or n_experts < 1:
        raise UnsupportedHFConfig(f"{key}={n_experts!r}: a mixture of experts needs at least one expert")
    return n_experts


# ---- Mixtral --------------------------------------------------------------------------------------------------------

MIXTRAL_EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


def _mixtral_in(hf: HFFields) -> dict[str, Any]:
    return {**decoder_in(hf), "n_experts": _n_experts(hf, "num_local_experts")}


def _mixtral_out(config: ModelConfig) -> dict[str, Any]:
    return {**decoder_out(config), "num_local_experts": config.n_experts}


def _mixtral_tensors(config: ModelConfig) -> tuple[Table, Table]:
    moe = {
        "block_sparse_moe.gate.weight": "ffn.router.weight",
        **_experts("block_sparse_moe", MIXTRAL_EXPERT_NAMES, config.n_experts),
    }
    base = {**LLAMA_GLOBAL, **_layers(config, {**ATTENTION, **moe}, {})}
    return base, {} if config.tie_embeddings else {"lm_head.weight": "lm_head.weight"}


MIXTRAL = Family(  # every layer a mixture: MixtralConfig has no dense layers, no biases, one expert width
    "MixtralForCausalLM",
    "mixtral",
    {**MOE_FIXED, "attn_bias": False, "moe_router": "topk-softmax", "moe_d_ff": None, "moe_dense_layers": None},
    {
        **LLAMA_RENAMES,
        "sliding_window": "sliding_window",
        "n_experts_per_token": "num_experts_per_tok",
        "router_aux_loss_coef": "router_aux_loss_coef",
    },
    {
        **LLAMA_DEFAULTS,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    },
    _mixtral_in,
    _mixtral_out,
    _mixtral_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len", "router_aux_loss_coef"),
)

# ---- Qwen3-MoE ------------------------------------------------------------------------------------------------------

QWEN3_EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
QK_NORM: Table = {f"self_attn.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}


def _dense_layers(hf: HFFields) -> list[int] | None:
    """Qwen's two ways of keeping some layers dense, as one list: mlp_only_layers, and every layer whose number
    (from 1) decoder_sparse_step does not divide."""
    step, only = hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or [])
    if not isinstance(step, int) or step < 1:
        raise UnsupportedHFConfig(f"decoder_sparse_step={step!r} must be a positive integer")
    dense = sorted(i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step)
    return dense or None


def _qwen3_moe_in(hf: HFFields) -> dict[str, Any]:
    if hf["use_sliding_window"]:
        raise UnsupportedHFConfig("use_sliding_window=true (Qwen's windowed layers) has no tformer equivalent")
    key = "num_experts" if "num_experts" in hf else "num_local_experts"  # transformers 5 writes the second
    return {
        **decoder_in(hf),
        "n_experts": _n_experts(hf, key),
        "moe_router": "topk-softmax" if hf["norm_topk_prob"] else "softmax-topk",
        "moe_dense_layers": _dense_layers(hf),
    }


def _qwen3_moe_out(config: ModelConfig) -> dict[str, Any]:
    return {
        **decoder_out(config),
        "num_experts": config.n_experts,
        "norm_topk_prob": config.moe_router == "topk-softmax",
        "mlp_only_layers": list(config.moe_dense_layers or []),
        "decoder_sparse_step": 1,
        "use_sliding_window": False,
    }


def _qwen3_moe_tensors(config: ModelConfig) -> tuple[Table, Table]:
    moe = {"mlp.gate.weight": "ffn.router.weight", **_experts("mlp", QWEN3_EXPERT_NAMES, config.n_experts)}
    attention = {**ATTENTION, **QK_NORM, **(ATTENTION_BIAS if config.attn_bias else {})}
    if config.attn_bias:
        attention["self_attn.o_proj.bias"] = "self_attn.out_proj.bias"
    base = {**LLAMA_GLOBAL, **_layers(config, {**attention, **moe}, {**attention, **DENSE_MLP})}
    return base, {} if config.tie_embeddings else {"lm_head.weight": "lm_head.weight"}


QWEN3_MOE = Family(
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    {**MOE_FIXED, "sliding_window": None, "qk_norm": True},  # RMSNorm on each head's queries and keys
    {
        **LLAMA_RENAMES,
        "attn_bias": "attention_bias",
        "n_experts_per_token": "num_experts_per_tok",
        "moe_d_ff": "moe_intermediate_size",
        "router_aux_loss_coef": "router_aux_loss_coef",
    },
    {
        **LLAMA_DEFAULTS,
        "max_position_embeddings": 32768,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "router_aux_loss_coef": 0.001,
    },
    _qwen3_moe_in,
    _qwen3_moe_out,
    _qwen3_moe_tensors,
    prefixes=("model.",),
    ignored=LLAMA_IGNORED,
    loose=("n_encoder_layers", "max_seq_len", "router_aux_loss_coef"),
)
