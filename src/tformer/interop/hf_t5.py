"""T5 (`T5ForConditionalGeneration`, the original layout and v1.1), mT5 and umT5 as Hugging Face families (see
`hf_spec`).

T5 is tformer's encoder-decoder with position 't5' (a relative bias table per stack, in its first layer's
self-attention in the checkpoint), RMSNorm without bias, pre-norm, no biases anywhere, unscaled attention scores,
unscaled embeddings shared by both stacks, and a ReLU (original) or tanh-GELU-gated (v1.1) FFN.

The output head needs the checkpoint's tensors as well as config.json. The original T5 ties the head to the
embedding and scales the decoder output by d_model**-0.5; v1.1 has its own `lm_head.weight` and no scaling. Older
config.json files say both with `tie_word_embeddings`; transformers 5 writes `scale_decoder_outputs` for the
scaling and `tie_word_embeddings: true` for every T5, keeping an untied head as a separate `lm_head.weight`. So the
head is untied exactly when the checkpoint holds `lm_head.weight`, and the scaling is `scale_decoder_outputs` when
given, else `tie_word_embeddings`.
"""

from __future__ import annotations

from typing import Any

from tformer.config import ModelConfig
from tformer.interop.hf_spec import Family, HFFields, Table, lookup, per_layer

T5_FIXED = {
    "family": "encoder-decoder",
    "position": "t5",
    "norm": "rmsnorm",
    "norm_placement": "pre",
    "attn_bias": False,
    "ffn_bias": False,
    "lm_head_bias": False,
    "scale_embeddings": False,
    "scale_attention": False,
    "share_embeddings": True,
    "embedding_norm": False,
    "type_vocab_size": 0,
    "sliding_window": None,
    "init": "normal",
    "relative_attention_per_layer": False,
}
T5_RENAMES = {
    "vocab_size": "vocab_size",
    "d_model": "d_model",
    "head_dim": "d_kv",
    "n_heads": "num_heads",
    "d_ff": "d_ff",
    "n_encoder_layers": "num_layers",
    "norm_eps": "layer_norm_epsilon",
    "dropout": "dropout_rate",
    "relative_attention_buckets": "relative_attention_num_buckets",
    "relative_attention_max_distance": "relative_attention_max_distance",
}
T5_DEFAULTS = {  # T5Config's defaults (t5-small)
    "vocab_size": 32128,
    "d_model": 512,
    "d_kv": 64,
    "d_ff": 2048,
    "num_layers": 6,
    "num_heads": 8,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
}
# feed_forward_proj -> tformer FFN, and back; "gated-gelu" means the tanh approximation (transformers' gelu_new)
FFN_IN = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu-tanh",
    "silu": "silu",
    "gated-gelu": "geglu-tanh",
    "gated-gelu_new": "geglu-tanh",
    "gated-silu": "swiglu",
}
FFN_OUT = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu-tanh": "gelu_new",
    "silu": "silu",
    "geglu-tanh": "gated-gelu",
    "swiglu": "gated-silu",
}
UNTIED_HEAD = "lm_head.weight"


def _attention(theirs: str, ours: str) -> Table:
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
    return {f"{theirs}.{t}.weight": f"{ours}.{o}.weight" for t, o in names.items()}


def _ffn(config: ModelConfig, theirs: str) -> Table:
    if config.ffn in ("geglu-tanh", "swiglu"):
        names = {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}
    else:
        names = {"wi": "up_proj", "wo": "down_proj"}
    return {f"{theirs}.{t}.weight": f"ffn.{o}.weight" for t, o in names.items()}


def _t5_tensors(config: ModelConfig, relative_biases: Table | None = None) -> tuple[Table, Table]:
    encoder_layer = {
        **_attention("layer.0.SelfAttention", "self_attn"),
        "layer.0.layer_norm.weight": "norm_attn.norm.weight",
        **_ffn(config, "layer.1.DenseReluDense"),
        "layer.1.layer_norm.weight": "norm_ffn.norm.weight",
    }
    decoder_layer = {
        **_attention("layer.0.SelfAttention", "self_attn"),
        "layer.0.layer_norm.weight": "norm_attn.norm.weight",
        **_attention("layer.1.EncDecAttention", "cross_attn"),
        "layer.1.layer_norm.weight": "norm_cross.norm.weight",
        **_ffn(config, "layer.2.DenseReluDense"),
        "layer.2.layer_norm.weight": "norm_ffn.norm.weight",
    }
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"  # the first layer holds the stack's table
    if relative_biases is None:
        relative_biases = {
            f"encoder.{bias}": "encoder.positions.relative_bias.embedding.weight",
            f"decoder.{bias}": "decoder.positions.relative_bias.embedding.weight",
        }
    base = {
        "shared.weight": "encoder.tokens.weight",
        **relative_biases,
        **per_layer(encoder_layer, config.n_encoder_layers, "encoder.block.{i}.", "encoder.layers.{i}."),
        **per_layer(decoder_layer, config.n_decoder_layers, "decoder.block.{i}.", "decoder.layers.{i}."),
        "encoder.final_layer_norm.weight": "encoder.final_norm.weight",
        "decoder.final_layer_norm.weight": "decoder.final_norm.weight",
    }
    return base, ({} if config.tie_embeddings else {UNTIED_HEAD: "lm_head.weight"})


def _t5_in(hf: HFFields) -> dict[str, Any]:
    tied = hf["tie_word_embeddings"]
    return {
        "ffn": lookup(FFN_IN, hf["feed_forward_proj"], "feed_forward_proj"),
        "n_decoder_layers": hf.get("num_decoder_layers") or hf["num_layers"],
        "attn_dropout": hf["dropout_rate"],  # T5 drops attention weights at the same rate
        "max_seq_len": hf.get("n_positions") or 512,  # relative positions have no limit; this is tformer's cap
        "tie_embeddings": tied,
        "scale_decoder_output": hf.get("scale_decoder_outputs", tied is not False),
    }


def _t5_out(config: ModelConfig) -> dict[str, Any]:
    return {
        "feed_forward_proj": lookup(FFN_OUT, config.ffn, "ffn", "T5"),
        "num_decoder_layers": config.n_decoder_layers,
        "n_positions": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "scale_decoder_outputs": config.scale_decoder_output,
        "is_encoder_decoder": True,
        "decoder_start_token_id": config.pad_token_id,  # T5 starts decoding from the pad token
    }


def _head_from_weights(hf_config: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """config.json with the head settings the checkpoint implies (see the module docstring)."""
    tied = hf_config.get("tie_word_embeddings", True)
    scale = hf_config.get("scale_decoder_outputs", tied is not False)
    return {**hf_config, "scale_decoder_outputs": scale, "tie_word_embeddings": UNTIED_HEAD not in names}


T5 = Family(
    "T5ForConditionalGeneration",
    "t5",
    T5_FIXED,
    T5_RENAMES,
    T5_DEFAULTS,
    _t5_in,
    _t5_out,
    _t5_tensors,
    prefixes=("",),
    required={"is_decoder": False},
    # the stacks' copies of `shared`, and a cross-attention bias table that old checkpoints hold and T5 never reads
    ignored=(
        "encoder.embed_tokens.weight",
        "decoder.embed_tokens.weight",
        "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
    ),
    complete_config=_head_from_weights,
)


# ---- mT5 and umT5 ---------------------------------------------------------------------------------------------------
# mT5 is T5 v1.1 with a larger vocabulary: the same tensors; transformers 5 never scales its decoder output. It
# holds exactly what a T5ForConditionalGeneration holds, so to_hf writes it as one unless asked for
# architecture="MT5ForConditionalGeneration". umT5 gives every layer
# its own relative bias table (relative_attention_per_layer), in each layer's self-attention.


def _mt5_in(hf: HFFields) -> dict[str, Any]:
    return {**_t5_in(hf), "scale_decoder_output": False}


def _mt5_out(config: ModelConfig) -> dict[str, Any]:
    fields = _t5_out(config)
    del fields["scale_decoder_outputs"]
    return fields


def _umt5_tensors(config: ModelConfig) -> tuple[Table, Table]:
    bias = "layer.0.SelfAttention.relative_attention_bias.weight"
    stacks = (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers))
    tables = {
        f"{stack}.block.{i}.{bias}": f"{stack}.positions.relative_biases.{i}.embedding.weight"
        for stack, n_layers in stacks
        for i in range(n_layers)
    }
    return _t5_tensors(config, tables)


MT5 = Family(
    "MT5ForConditionalGeneration",
    "mt5",
    {**T5_FIXED, "scale_decoder_output": False},
    T5_RENAMES,
    {
        **T5_DEFAULTS,
        "vocab_size": 250112,
        "d_ff": 1024,
        "num_layers": 8,
        "num_heads": 6,
        "feed_forward_proj": "gated-gelu",
    },
    _mt5_in,
    _mt5_out,
    _t5_tensors,
    prefixes=("",),
    required={"is_decoder": False},
    ignored=T5.ignored,
    complete_config=_head_from_weights,
)
UMT5 = Family(
    "UMT5ForConditionalGeneration",
    "umt5",
    {**T5_FIXED, "relative_attention_per_layer": True},
    T5_RENAMES,
    MT5.defaults,
    _t5_in,
    _t5_out,
    _umt5_tensors,
    prefixes=("",),
    required={"is_decoder": False},
    ignored=("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"),
    complete_config=_head_from_weights,
)
