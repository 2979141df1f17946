"""Hugging Face's Longformer (LongformerModel, LongformerForMaskedLM) as data (see `hf_spec`).

Longformer is RoBERTa with tformer's attention 'longformer': each layer adds query_global, key_global and
value_global projections for its global tokens. Two differences from BERT's tables:
- RoBERTa numbers positions from pad_token_id + 1 (fairseq's make_positions): real token p reads row
  p + pad_token_id + 1 of the position table, so tformer keeps the rows from there on, and max_seq_len is
  max_position_embeddings - pad_token_id - 1. The rows before it serve only padding tokens; export writes zeros.
- transformers saves attention_window as one value per layer; tformer has one window for every layer.

Positions in Hugging Face count the tokens that differ from pad_token_id; tformer counts the tokens its
attention_mask marks real. They agree on every real token when padding tokens are pad_token_id and masked.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from tformer.config import ModelConfig
from tformer.interop.hf_encoders import BERT_FIXED, BERT_LAYER, BERT_RENAMES
from tformer.interop.hf_spec import (
    COPY,
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

LONGFORMER_FIXED = {**BERT_FIXED, "attention": "longformer"}
LONGFORMER_RENAMES = {ours: theirs for ours, theirs in BERT_RENAMES.items() if ours != "max_seq_len"}
LONGFORMER_DEFAULTS = {  # LongformerConfig's defaults
    "attention_window": 512,
    "pad_token_id": 1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "initializer_range": 0.02,
    "hidden_act": "gelu",
    "tie_word_embeddings": True,
}
LONGFORMER_REQUIRED = {"is_decoder": False, "add_cross_attention": False}
LONGFORMER_LAYER: Table = {
    **BERT_LAYER,
    **weight_bias("attention.self.query_global", "self_attn.q_global_proj"),
    **weight_bias("attention.self.key_global", "self_attn.k_global_proj"),
    **weight_bias("attention.self.value_global", "self_attn.v_global_proj"),
}
LONGFORMER_MLM_HEAD: Table = {
    **weight_bias("lm_head.dense", "mlm_head.dense"),
    **weight_bias("lm_head.layer_norm", "mlm_head.norm"),
    "lm_head.bias": "mlm_head.lm_head.bias",
}
LONGFORMER_MLM_UNTIED: Table = {
    "lm_head.decoder.weight": "mlm_head.lm_head.weight",
    "lm_head.decoder.bias": "mlm_head.lm_head.bias",
    "lm_head.bias": (("mlm_head.lm_head.bias",), COPY),
}
LONGFORMER_IGNORED = ("*embeddings.position_ids", "*embeddings.token_type_ids")
POOLER_NOTE = (
    "LongformerModel's pooler (a dense layer and tanh over the first token) has no place in tformer's encoder; "
    "the hidden states do not use it, a classifier built on the pooled first token would"
)


def position_offset(rows: int) -> Transform:
    """A position table whose first `rows` rows tformer does not use (RoBERTa's pad_token_id + 1)."""
    return Transform(lambda ours: F.pad(ours[0], (0, 0, rows, 0)), lambda t: [t[rows:]])


def _one_window(windows: Any) -> int:
    if isinstance(windows, int):
        return windows
    if not isinstance(windows, list) or not windows or len(set(windows)) != 1:
        raise UnsupportedHFConfig(
            f"attention_window {windows!r} differs between layers (or is empty); tformer uses one window for every "
            f"layer"
        )
    return windows[0]


def _longformer_in(hf: HFFields) -> dict[str, Any]:
    pad = hf["pad_token_id"]
    if not isinstance(pad, int) or pad < 0:
        raise UnsupportedHFConfig(f"pad_token_id {pad!r}: Longformer numbers positions from it, so it must be an id")
    return {
        "ffn": lookup(MLP_IN, hf["hidden_act"], "hidden_act"),
        "attention_window": _one_window(hf["attention_window"]),
        "max_seq_len": hf["max_position_embeddings"] - pad - 1,
        "pad_token_id": pad,
    }


def _longformer_out(config: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_act": lookup(MLP_OUT, config.ffn, "ffn", "Hugging Face"),
        "attention_window": config.attention_window,
        "max_position_embeddings": config.max_seq_len + config.pad_token_id + 1,
    }


def _mlm_in(hf: HFFields) -> dict[str, Any]:
    fields = _longformer_in(hf)
    if fields["ffn"] != "gelu":  # tformer's MLM head uses the FFN's activation, Longformer's head always GELU
        raise UnsupportedHFConfig(
            f"hidden_act {hf['hidden_act']!r} with LongformerForMaskedLM: its head always applies GELU, and "
            f"tformer's masked-LM head uses the FFN's activation; only hidden_act 'gelu' is supported"
        )
    return fields


def _mlm_out(config: ModelConfig) -> dict[str, Any]:
    if config.ffn != "gelu":
        raise UnsupportedHFConfig(f"ffn is '{config.ffn}', but LongformerForMaskedLM's head always applies GELU")
    return _longformer_out(config)


def _longformer_base(config: ModelConfig) -> Table:
    types = {"embeddings.token_type_embeddings.weight": "encoder.token_types.weight"} if config.type_vocab_size else {}
    positions = (("encoder.positions.embedding.weight",), position_offset(config.pad_token_id + 1))
    return {
        "embeddings.word_embeddings.weight": "encoder.tokens.weight",
        "embeddings.position_embeddings.weight": positions,
        **weight_bias("embeddings.LayerNorm", "encoder.embed_norm"),
        **types,
        **per_layer(LONGFORMER_LAYER, config.n_encoder_layers, "encoder.layer.{i}.", "encoder.layers.{i}."),
    }


def _mlm_tensors(config: ModelConfig) -> tuple[Table, Table]:
    return _longformer_base(config), {**LONGFORMER_MLM_HEAD, **({} if config.tie_embeddings else LONGFORMER_MLM_UNTIED)}


LONGFORMER_MLM = Family(
    "LongformerForMaskedLM",
    "longformer",
    {**LONGFORMER_FIXED, "encoder_head": "mlm", "lm_head_bias": True},
    {**LONGFORMER_RENAMES, "tie_embeddings": "tie_word_embeddings"},
    LONGFORMER_DEFAULTS,
    _mlm_in,
    _mlm_out,
    _mlm_tensors,
    prefixes=("longformer.",),
    required=LONGFORMER_REQUIRED,
    ignored=(*LONGFORMER_IGNORED, "lm_head.decoder.*"),
    loose=("n_decoder_layers",),
)
LONGFORMER_MODEL = Family(
    "LongformerModel",
    "longformer",
    {**LONGFORMER_FIXED, "encoder_head": "none"},
    LONGFORMER_RENAMES,
    LONGFORMER_DEFAULTS,
    _longformer_in,
    _longformer_out,
    lambda config: (_longformer_base(config), {}),
    prefixes=("", "longformer."),
    required=LONGFORMER_REQUIRED,
    ignored=LONGFORMER_IGNORED,
    dropped=("*pooler.dense.*",),
    dropped_note=POOLER_NOTE,
    loose=("n_decoder_layers",),
)
