"""Hugging Face families with an encoder, as data: BERT, RoBERTa, BART and Marian (see `hf_spec`)."""

from __future__ import annotations

from typing import Any

from tformer.config import ModelConfig
from tformer.interop.hf_spec import (
    COPY,
    MLP_IN,
    MLP_OUT,
    OFFSET_2,
    ROW,
    Family,
    HFFields,
    Table,
    UnsupportedHFConfig,
    lookup,
    per_layer,
    same_value,
    weight_bias,
)

# ---- BERT -----------------------------------------------------------------------------------------------------------

BERT_FIXED = {
    "family": "encoder",
    "n_decoder_layers": 0,
    "position": "learned",
    "norm": "layernorm",
    "norm_bias": True,
    "norm_placement": "post",
    "embedding_norm": True,
    "scale_embeddings": False,
    "attn_bias": True,
    "ffn_bias": True,
    "init": "normal",
    "position_offset": 0,
}
BERT_RENAMES = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_encoder_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "norm_eps": "layer_norm_eps",
    "dropout": "hidden_dropout_prob",
    "attn_dropout": "attention_probs_dropout_prob",
    "init_std": "initializer_range",
}
BERT_DEFAULTS = {
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "initializer_range": 0.02,
    "hidden_act": "gelu",
    "tie_word_embeddings": True,
}
BERT_REQUIRED = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}
BERT_GLOBAL: Table = {
    "embeddings.word_embeddings.weight": "encoder.tokens.weight",
    "embeddings.position_embeddings.weight": "encoder.positions.embedding.weight",
    **weight_bias("embeddings.LayerNorm", "encoder.embed_norm"),
}
BERT_LAYER: Table = {
    **weight_bias("attention.self.query", "self_attn.q_proj"),
    **weight_bias("attention.self.key", "self_attn.k_proj"),
    **weight_bias("attention.self.value", "self_attn.v_proj"),
    **weight_bias("attention.output.dense", "self_attn.out_proj"),
    **weight_bias("attention.output.LayerNorm", "norm_attn.norm"),
    **weight_bias("intermediate.dense", "ffn.up_proj"),
    **weight_bias("output.dense", "ffn.down_proj"),
    **weight_bias("output.LayerNorm", "norm_ffn.norm"),
}
BERT_MLM_HEAD: Table = {
    **weight_bias("cls.predictions.transform.dense", "mlm_head.dense"),
    **weight_bias("cls.predictions.transform.LayerNorm", "mlm_head.norm"),
    "cls.predictions.bias": "mlm_head.lm_head.bias",
}
BERT_IGNORED = ("*embeddings.position_ids", "*embeddings.token_type_ids", "cls.predictions.decoder.*")
POOLER_NOTE = (
    "BERT's pooler (a dense layer and tanh over the first token, trained for next-sentence prediction) and its "
    "next-sentence head have no place in tformer's encoder. Hidden states and mean-pooled sentence embeddings "
    "do not use them; a classifier built on the pooled [CLS] output would"
)


def _bert_in(hf: HFFields) -> dict[str, Any]:
    return {"ffn": lookup(MLP_IN, hf["hidden_act"], "hidden_act")}


def _bert_out(config: ModelConfig) -> dict[str, Any]:
    return {"hidden_act": lookup(MLP_OUT, config.ffn, "ffn", "Hugging Face")}


def _bert_base(config: ModelConfig) -> Table:
    types = {"embeddings.token_type_embeddings.weight": "encoder.token_types.weight"} if config.type_vocab_size else {}
    return {
        **BERT_GLOBAL,
        **types,
        **per_layer(BERT_LAYER, config.n_encoder_layers, "encoder.layer.{i}.", "encoder.layers.{i}."),
    }


BERT_MLM_UNTIED: Table = {  # transformers 5 unties the output bias too and keeps cls.predictions.bias unused
    "cls.predictions.decoder.weight": "mlm_head.lm_head.weight",
    "cls.predictions.decoder.bias": "mlm_head.lm_head.bias",
    "cls.predictions.bias": (("mlm_head.lm_head.bias",), COPY),
}


def _bert_mlm_tensors(config: ModelConfig) -> tuple[Table, Table]:
    return _bert_base(config), {**BERT_MLM_HEAD, **({} if config.tie_embeddings else BERT_MLM_UNTIED)}


BERT_MLM = Family(
    "BertForMaskedLM",
    "bert",
    {**BERT_FIXED, "encoder_head": "mlm", "lm_head_bias": True},
    {**BERT_RENAMES, "tie_embeddings": "tie_word_embeddings"},
    BERT_DEFAULTS,
    _bert_in,
    _bert_out,
    _bert_mlm_tensors,
    prefixes=("bert.", ""),
    required=BERT_REQUIRED,
    ignored=BERT_IGNORED,
    dropped=("*pooler.dense.*", "cls.seq_relationship.*"),
    dropped_note=POOLER_NOTE,
    loose=("n_decoder_layers",),
)
BERT_MODEL = Family(
    "BertModel",
    "bert",
    {**BERT_FIXED, "encoder_head": "none"},
    BERT_RENAMES,
    BERT_DEFAULTS,
    _bert_in,
    _bert_out,
    lambda config: (_bert_base(config), {}),
    prefixes=("", "bert."),
    required=BERT_REQUIRED,
    ignored=BERT_IGNORED,
    dropped=("*pooler.dense.*",),
    dropped_note=POOLER_NOTE,
    loose=("n_decoder_layers",),
)

# BertForSequenceClassification and BertForTokenClassification: the base model under bert., a task head on top
BERT_SEQUENCE_HEAD: Table = {
    **weight_bias("bert.pooler.dense", "task_head.pooler"),
    **weight_bias("classifier", "task_head.classifier"),
}
BERT_TOKEN_HEAD: Table = weight_bias("classifier", "task_head.classifier")


def _labels_in(hf: HFFields) -> dict[str, Any]:
    """num_labels and label_names from config.json's id2label (transformers' default: 2 labels LABEL_0, LABEL_1)."""
    id2label = hf.get("id2label") or {}
    names = [str(id2label[key]) for key in sorted(id2label, key=int)] or None
    count = len(names) if names else hf.get("num_labels", 2)
    default = [f"LABEL_{i}" for i in range(count)]
    return {"num_labels": count, "label_names": None if names == default else names}


def _labels_out(config: ModelConfig) -> dict[str, Any]:
    """id2label / label2id of a classifier; none for a config without labels (to_hf then tries the next family)."""
    if config.num_labels is None:
        return {}
    names = config.label_names or [f"LABEL_{i}" for i in range(config.num_labels)]
    return {"id2label": dict(enumerate(names)), "label2id": {name: i for i, name in enumerate(names)}}


def _bert_classifier(architecture: str, head: str, table: Table) -> Family:
    return Family(
        architecture,
        "bert",
        {**BERT_FIXED, "encoder_head": head},
        BERT_RENAMES,
        BERT_DEFAULTS,
        lambda hf: {**_bert_in(hf), **_labels_in(hf)},
        lambda config: {**_bert_out(config), **_labels_out(config)},
        lambda config: (_bert_base(config), table),
        prefixes=("bert.",),
        required=BERT_REQUIRED,
        ignored=BERT_IGNORED,
        dropped=("bert.pooler.dense.*",) if head == "token-classification" else (),
        dropped_note=POOLER_NOTE,
        loose=("n_decoder_layers",),
    )


BERT_SEQUENCE = _bert_classifier("BertForSequenceClassification", "sequence-classification", BERT_SEQUENCE_HEAD)
BERT_TOKEN = _bert_classifier("BertForTokenClassification", "token-classification", BERT_TOKEN_HEAD)

# BertForQuestionAnswering: the base model under bert. (no pooler), qa_outputs giving start and end logits
QA_HEAD: Table = weight_bias("qa_outputs", "task_head.span")


def _qa_in(hf: HFFields) -> dict[str, Any]:
    if hf.get("num_labels", 2) != 2 or len(hf.get("id2label") or {0: 0, 1: 1}) != 2:
        raise UnsupportedHFConfig("a question-answering head has 2 outputs (start and end logits); set num_labels 2")
    return {}


BERT_QA = Family(
    "BertForQuestionAnswering",
    "bert",
    {**BERT_FIXED, "encoder_head": "question-answering"},
    BERT_RENAMES,
    BERT_DEFAULTS,
    lambda hf: {**_bert_in(hf), **_qa_in(hf)},
    _bert_out,
    lambda config: (_bert_base(config), QA_HEAD),
    prefixes=("bert.",),
    required=BERT_REQUIRED,
    ignored=BERT_IGNORED,
    loose=("n_decoder_layers",),
)

# ---- RoBERTa --------------------------------------------------------------------------------------------------------
# BERT's layers and names under roberta., with fairseq's positions: real token p reads row p + pad_token_id + 1 of
# the position table (transformers' create_position_ids_from_input_ids), so tformer keeps the whole table and reads
# it with position_offset pad_token_id + 1. Positions in transformers count the tokens that differ from
# pad_token_id; tformer counts those its attention_mask marks real: the same on every real token when padding is
# pad_token_id and masked. The MLM head applies GELU whatever hidden_act says.

ROBERTA_RENAMES = {ours: theirs for ours, theirs in BERT_RENAMES.items() if ours != "max_seq_len"}
ROBERTA_DEFAULTS = {**BERT_DEFAULTS, "pad_token_id": 1}
ROBERTA_MLM_HEAD: Table = {
    **weight_bias("lm_head.dense", "mlm_head.dense"),
    **weight_bias("lm_head.layer_norm", "mlm_head.norm"),
    "lm_head.bias": "mlm_head.lm_head.bias",
}
ROBERTA_MLM_UNTIED: Table = {  # as BERT's: untied, transformers 5 keeps lm_head.bias as an unused copy
    "lm_head.decoder.weight": "mlm_head.lm_head.weight",
    "lm_head.decoder.bias": "mlm_head.lm_head.bias",
    "lm_head.bias": (("mlm_head.lm_head.bias",), COPY),
}
ROBERTA_SEQUENCE_HEAD: Table = {  # RobertaClassificationHead: dense and tanh on <s>, then out_proj (no pooler)
    **weight_bias("classifier.dense", "task_head.pooler"),
    **weight_bias("classifier.out_proj", "task_head.classifier"),
}


def _roberta_in(hf: HFFields) -> dict[str, Any]:
    pad = hf["pad_token_id"]
    if not isinstance(pad, int) or pad < 0:
        raise UnsupportedHFConfig(f"pad_token_id {pad!r}: RoBERTa numbers positions from it, so it must be an id")
    offset = pad + 1
    if hf["max_position_embeddings"] <= offset:
        raise UnsupportedHFConfig(
            f"max_position_embeddings ({hf['max_position_embeddings']}) leaves no position after the "
            f"pad_token_id + 1 = {offset} rows RoBERTa skips"
        )
    return {
        **_bert_in(hf),
        "pad_token_id": pad,
        "position_offset": offset,
        "max_seq_len": hf["max_position_embeddings"] - offset,
    }


def _roberta_out(config: ModelConfig) -> dict[str, Any]:
    return {**_bert_out(config), "max_position_embeddings": config.max_seq_len + config.position_offset}


def _roberta_mlm_in(hf: HFFields) -> dict[str, Any]:
    if hf["hidden_act"] != "gelu":
        raise UnsupportedHFConfig(
            f"hidden_act {hf['hidden_act']!r}: RoBERTa's masked-LM head applies GELU whatever hidden_act says, and "
            "tformer's applies the FFN's activation; only 'gelu' gives both the same"
        )
    return _roberta_in(hf)


def _roberta_mlm_tensors(config: ModelConfig) -> tuple[Table, Table]:
    return _bert_base(config), {**ROBERTA_MLM_HEAD, **({} if config.tie_embeddings else ROBERTA_MLM_UNTIED)}


def _roberta(
    architecture: str,
    head: str,
    extra_in: Any,
    extra_out: Any,
    tensors: Any,
    prefixes: tuple[str, ...] = ("roberta.",),
    renames: dict[str, str] = ROBERTA_RENAMES,
    dropped: tuple[str, ...] = (),
    fixed: dict[str, Any] | None = None,
) -> Family:
    return Family(
        architecture,
        "roberta",
        {**BERT_FIXED, "encoder_head": head, **(fixed or {})},
        renames,
        ROBERTA_DEFAULTS,
        extra_in,
        extra_out,
        tensors,
        prefixes=prefixes,
        required=BERT_REQUIRED,
        ignored=BERT_IGNORED,
        dropped=dropped,
        dropped_note=POOLER_NOTE,
        loose=("n_decoder_layers",),
    )


ROBERTA_MLM = _roberta(
    "RobertaForMaskedLM",
    "mlm",
    _roberta_mlm_in,
    _roberta_out,
    _roberta_mlm_tensors,
    prefixes=("roberta.", ""),
    renames={**ROBERTA_RENAMES, "tie_embeddings": "tie_word_embeddings"},
    fixed={"lm_head_bias": True},
)
ROBERTA_MODEL = _roberta(
    "RobertaModel",
    "none",
    _roberta_in,
    _roberta_out,
    lambda config: (_bert_base(config), {}),
    prefixes=("", "roberta."),
    dropped=("*pooler.dense.*",),
)
ROBERTA_SEQUENCE = _roberta(
    "RobertaForSequenceClassification",
    "sequence-classification",
    lambda hf: {**_roberta_in(hf), **_labels_in(hf)},
    lambda config: {**_roberta_out(config), **_labels_out(config)},
    lambda config: (_bert_base(config), ROBERTA_SEQUENCE_HEAD),
)
ROBERTA_TOKEN = _roberta(
    "RobertaForTokenClassification",
    "token-classification",
    lambda hf: {**_roberta_in(hf), **_labels_in(hf)},
    lambda config: {**_roberta_out(config), **_labels_out(config)},
    lambda config: (_bert_base(config), BERT_TOKEN_HEAD),
)
ROBERTA_QA = _roberta(
    "RobertaForQuestionAnswering",
    "question-answering",
    lambda hf: {**_roberta_in(hf), **_qa_in(hf)},
    _roberta_out,
    lambda config: (_bert_base(config), QA_HEAD),
)

# ---- BART and Marian ------------------------------------------------------------------------------------------------

SEQ2SEQ_FIXED = {
    "family": "encoder-decoder",
    "norm": "layernorm",
    "norm_bias": True,
    "norm_eps": 1e-5,
    "norm_placement": "post",
    "type_vocab_size": 0,
    "attn_bias": True,
    "ffn_bias": True,
    "lm_head_bias": True,
    "sliding_window": None,
    "init": "normal",
}
SEQ2SEQ_RENAMES = {
    "vocab_size": "vocab_size",
    "d_model": "d_model",
    "n_encoder_layers": "encoder_layers",
    "n_decoder_layers": "decoder_layers",
    "n_heads": "encoder_attention_heads",
    "d_ff": "encoder_ffn_dim",
    "max_seq_len": "max_position_embeddings",
    "scale_embeddings": "scale_embedding",
    "tie_embeddings": "tie_word_embeddings",
    "dropout": "dropout",
    "attn_dropout": "attention_dropout",
    "init_std": "init_std",
}
SEQ2SEQ_DEFAULTS = {
    "max_position_embeddings": 1024,
    "scale_embedding": False,
    "tie_word_embeddings": True,
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "init_std": 0.02,
    "activation_function": "gelu",
    "decoder_vocab_size": None,
    "share_encoder_decoder_embeddings": True,
}
# keys of older BART/Marian configs that switched variants on (mBART's pre-norm, ...)
BART_REQUIRED = {
    "normalize_before": False,
    "add_final_layer_norm": False,
    "normalize_embedding": True,
    "static_position_embeddings": False,
    "add_bias_logits": False,
}
MARIAN_REQUIRED = {**BART_REQUIRED, "normalize_embedding": False, "static_position_embeddings": True}
SEQ2SEQ_LAYER: Table = {
    **weight_bias("self_attn.q_proj", "self_attn.q_proj"),
    **weight_bias("self_attn.k_proj", "self_attn.k_proj"),
    **weight_bias("self_attn.v_proj", "self_attn.v_proj"),
    **weight_bias("self_attn.out_proj", "self_attn.out_proj"),
    **weight_bias("self_attn_layer_norm", "norm_attn.norm"),
    **weight_bias("fc1", "ffn.up_proj"),
    **weight_bias("fc2", "ffn.down_proj"),
    **weight_bias("final_layer_norm", "norm_ffn.norm"),
}
SEQ2SEQ_CROSS: Table = {
    **weight_bias("encoder_attn.q_proj", "cross_attn.q_proj"),
    **weight_bias("encoder_attn.k_proj", "cross_attn.k_proj"),
    **weight_bias("encoder_attn.v_proj", "cross_attn.v_proj"),
    **weight_bias("encoder_attn.out_proj", "cross_attn.out_proj"),
    **weight_bias("encoder_attn_layer_norm", "norm_cross.norm"),
}
SEQ2SEQ_HEAD: Table = {"final_logits_bias": (("lm_head.bias",), ROW)}
SEQ2SEQ_EMBEDDINGS: dict[tuple[bool, bool], Table] = {  # (share_embeddings, tie_embeddings) -> token tables
    (True, True): {"shared.weight": "encoder.tokens.weight"},  # one table for source, target and output
    (False, True): {
        "encoder.embed_tokens.weight": "encoder.tokens.weight",
        "decoder.embed_tokens.weight": "decoder.tokens.weight",
    },
    (False, False): {
        "encoder.embed_tokens.weight": "encoder.tokens.weight",
        "decoder.embed_tokens.weight": "decoder.tokens.weight",
    },
}
SEQ2SEQ_IGNORED = (
    "model.shared.weight",
    "model.encoder.embed_tokens.weight",
    "model.decoder.embed_tokens.weight",
    "lm_head.weight",
)


def _seq2seq_in(hf: HFFields) -> dict[str, Any]:
    same_value(hf, "decoder_attention_heads", "encoder_attention_heads")
    same_value(hf, "decoder_ffn_dim", "encoder_ffn_dim")
    # transformers 5 unties every embedding when tie_word_embeddings is false, the shared one included
    share = hf["share_encoder_decoder_embeddings"] and hf["tie_word_embeddings"]
    target_vocab = hf["vocab_size"] if share else hf["decoder_vocab_size"] or hf["vocab_size"]
    return {
        "ffn": lookup(MLP_IN, hf["activation_function"], "activation_function"),
        "share_embeddings": share,
        "tgt_vocab_size": target_vocab,
    }


def _seq2seq_out(config: ModelConfig) -> dict[str, Any]:
    return {
        "activation_function": lookup(MLP_OUT, config.ffn, "ffn", "Hugging Face"),
        "decoder_attention_heads": config.n_heads,
        "decoder_ffn_dim": config.d_ff,
        "is_encoder_decoder": True,
    }


def _seq2seq_tensors(config: ModelConfig, positions: Table) -> tuple[Table, Table]:
    embeddings = SEQ2SEQ_EMBEDDINGS.get((config.share_embeddings, config.tie_embeddings), {})
    base = {
        **embeddings,
        **positions,
        **per_layer(SEQ2SEQ_LAYER, config.n_encoder_layers, "encoder.layers.{i}.", "encoder.layers.{i}."),
        **per_layer(
            {**SEQ2SEQ_LAYER, **SEQ2SEQ_CROSS}, config.n_decoder_layers, "decoder.layers.{i}.", "decoder.layers.{i}."
        ),
    }
    return base, {**SEQ2SEQ_HEAD, **({} if config.tie_embeddings else {"lm_head.weight": "lm_head.weight"})}


BART_POSITIONS: Table = {
    "encoder.embed_positions.weight": (("encoder.positions.embedding.weight",), OFFSET_2),
    "decoder.embed_positions.weight": (("decoder.positions.embedding.weight",), OFFSET_2),
    **weight_bias("encoder.layernorm_embedding", "encoder.embed_norm"),
    **weight_bias("decoder.layernorm_embedding", "decoder.embed_norm"),
}


def _bart_in(hf: HFFields) -> dict[str, Any]:
    fields = _seq2seq_in(hf)
    return {**fields, "share_embeddings": hf["tie_word_embeddings"], "tgt_vocab_size": hf["vocab_size"]}


def _bart_tensors(config: ModelConfig) -> tuple[Table, Table]:
    base, head = _seq2seq_tensors(config, BART_POSITIONS)
    if not config.tie_embeddings:  # BartModel always has `shared`; untied, it is an unused copy
        base["shared.weight"] = (("encoder.tokens.weight",), COPY)
    return base, head


def _marian_out(config: ModelConfig) -> dict[str, Any]:
    return {
        **_seq2seq_out(config),
        "decoder_vocab_size": config.tgt_vocab_size,
        "share_encoder_decoder_embeddings": config.share_embeddings,
        "decoder_start_token_id": config.pad_token_id,
    }  # Marian starts decoding from the pad token


BART = Family(
    "BartForConditionalGeneration",
    "bart",
    {**SEQ2SEQ_FIXED, "position": "learned", "embedding_norm": True},
    SEQ2SEQ_RENAMES,
    SEQ2SEQ_DEFAULTS,
    _bart_in,
    _seq2seq_out,
    _bart_tensors,
    prefixes=("model.",),
    required=BART_REQUIRED,
    ignored=SEQ2SEQ_IGNORED,
    optional=("final_logits_bias",),
)
MARIAN = Family(
    "MarianMTModel",
    "marian",
    {
        **SEQ2SEQ_FIXED,
        "position": "sinusoidal",
        "sinusoidal_layout": "split",
        "sinusoidal_base": 10000.0,
        "embedding_norm": False,
    },
    SEQ2SEQ_RENAMES,
    SEQ2SEQ_DEFAULTS,
    _seq2seq_in,
    _marian_out,
    lambda config: _seq2seq_tensors(config, {}),
    prefixes=("model.",),
    required=MARIAN_REQUIRED,
    # the sinusoidal tables are not weights: transformers recomputes them and skips them on save
    ignored=(*SEQ2SEQ_IGNORED, "model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"),
    optional=("final_logits_bias",),
)
