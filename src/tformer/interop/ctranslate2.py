"""tformer encoder-decoders out to CTranslate2, the C++ engine people deploy Transformer translators with.

`to_ctranslate2(model, tokenizer, out)` fills a `ctranslate2.specs.TransformerSpec` with tformer's weights and
writes a model directory that `ctranslate2.Translator(out)` loads. What has to match for its outputs to be
tformer's:
- positions: tformer's sinusoidal table goes into the spec as it is. CTranslate2's own table puts the sines
  before the cosines and starts at position 1; tformer's interleaves them and starts at 0;
- the source ends with </s> (tformer's `translate_ids` appends it; here `add_source_eos`) and decoding starts
  from <s>;
- CTranslate2 takes token strings, so the vocabulary written is the tokenizer's tokens by id, and callers feed it
  `source_tokens(tokenizer, text)`. Decode with `min_decoding_length=0`: its default of 1 forbids an empty
  translation that tformer can produce.
Only this module knows CTranslate2's names; `ctranslate2` is imported when a conversion runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from tformer.data.tokenizer import Tokenizer
from tformer.errors import ConfigError
from tformer.layers.positions import sinusoidal_table

if TYPE_CHECKING:
    from tformer.models import EncoderDecoder

QUANTIZATIONS = ("float32", "int8", "int16", "int8_float32", "bfloat16", "int8_bfloat16", "float16")

# tformer's FFN activation -> the name of CTranslate2's Activation member (plain MLPs only)
_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "gelu-tanh": "GELUTanh", "silu": "SWISH"}


def _check_supported(config) -> None:
    """Raises a ConfigError naming the first setting CTranslate2's Transformer spec cannot express."""
    checks = [
        (config.family == "encoder-decoder", f"family '{config.family}' (only encoder-decoder Transformers)"),
        (config.attention == "softmax", f"attention '{config.attention}'"),
        (config.ffn in _ACTIVATIONS, f"ffn '{config.ffn}' (supported: {', '.join(_ACTIVATIONS)})"),
        (config.norm == "layernorm", f"norm '{config.norm}' (supported: layernorm)"),
        (config.norm_placement in ("pre", "post"), f"norm_placement '{config.norm_placement}' (pre or post)"),
        (config.position in ("sinusoidal", "learned"), f"position '{config.position}' (sinusoidal or learned)"),
        (config.n_kv_heads == config.n_heads, "grouped-query attention (n_kv_heads != n_heads)"),
        (config.head_dim * config.n_heads == config.d_model, "head_dim * n_heads != d_model"),
        (config.attn_bias and config.ffn_bias and config.norm_bias, "layers without biases"),
        (config.attn_out_bias in (None, True), "attn_out_bias false"),
        (config.scale_attention and config.attention_scale_dim is None, "a non-standard attention scale"),
        (not config.qk_norm, "qk_norm"),
        (config.sliding_window is None and config.layer_types is None, "sliding-window attention"),
        (config.final_logit_softcap is None and config.attn_logit_softcap is None, "soft-capped logits"),
        (not config.scale_decoder_output and not config.round_embed_scale, "T5/Gemma output or embedding scaling"),
        (config.n_experts == 0, "mixture-of-experts layers"),
        (config.tgt_vocab_size == config.vocab_size, "separate source and target vocabularies"),
    ]
    for ok, what in checks:
        if not ok:
            raise ConfigError(f"CTranslate2's Transformer spec cannot express {what}; convert a model without it")


def _np(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def _linear(spec, weights: dict[str, torch.Tensor], name: str) -> None:
    spec.weight = _np(weights[f"{name}.weight"])
    if f"{name}.bias" in weights:
        spec.bias = _np(weights[f"{name}.bias"])


def _fused(spec, weights: dict[str, torch.Tensor], names: Sequence[str]) -> None:
    """One linear layer whose output rows are the given projections' stacked (CTranslate2 fuses q, k, v)."""
    spec.weight = np.concatenate([_np(weights[f"{n}.weight"]) for n in names])
    spec.bias = np.concatenate([_np(weights[f"{n}.bias"]) for n in names])


def _norm(spec, weights: dict[str, torch.Tensor], name: str) -> None:
    spec.gamma = _np(weights[f"{name}.weight"])
    spec.beta = _np(weights[f"{name}.bias"])


def _attention(spec, weights: dict[str, torch.Tensor], prefix: str, norm: str, cross: bool) -> None:
    q, k, v, o = (f"{prefix}.{p}_proj" for p in "qkvo")
    o = f"{prefix}.out_proj"
    if cross:  # linear[0] projects the queries, linear[1] the memory's keys and values
        _linear(spec.linear[0], weights, q)
        _fused(spec.linear[1], weights, [k, v])
    else:
        _fused(spec.linear[0], weights, [q, k, v])
    _linear(spec.linear[-1], weights, o)
    _norm(spec.layer_norm, weights, norm)  # before the sublayer in pre-norm, after the residual in post-norm


def _positions(model: EncoderDecoder, stack: str) -> np.ndarray:
    """The position table that stack adds to its scaled token embeddings, row p for position p."""
    c = model.config
    if c.position == "sinusoidal":
        return _np(sinusoidal_table(c.max_seq_len, c.d_model, c.sinusoidal_base, c.sinusoidal_layout))
    table = model.state_dict()[f"{stack}.positions.embedding.weight"]
    return _np(table[c.position_offset :])


def vocabulary(tokenizer: Tokenizer, size: int) -> list[str]:
    """The token string of each id 0..size-1; ids the tokenizer lacks (a padded embedding table) get unique
    placeholders, since CTranslate2 maps strings to ids."""
    backend = tokenizer.backend
    tokens = [backend.id_to_token(i) for i in range(size)]
    return [token if token is not None else f"<tformer_unused_{i}>" for i, token in enumerate(tokens)]


def source_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    """A sentence as CTranslate2 takes it: tformer's token strings, without </s> (the model adds it)."""
    return [tokenizer.backend.id_to_token(i) for i in tokenizer.encode(text)]


def decode_tokens(tokenizer: Tokenizer, tokens: Sequence[str]) -> list[int]:
    """CTranslate2's output tokens back to tformer ids."""
    return [tokenizer.token_to_id(token) for token in tokens]


def build_spec(model: EncoderDecoder, tokenizer: Tokenizer):
    """A filled `ctranslate2.specs.TransformerSpec` (unvalidated, unquantized) for `model` and its tokenizer."""
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.config
    _check_supported(c)
    for role in ("bos", "eos"):
        if role not in tokenizer.special_tokens:
            raise ConfigError(f"the tokenizer has no {role} token, which CTranslate2 needs; train one with tformer")
    pre_norm = c.norm_placement == "pre"
    spec = transformer_spec.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers),
        c.n_heads,
        pre_norm=pre_norm,
        activation=getattr(common_spec.Activation, _ACTIVATIONS[c.ffn]),
        layernorm_embedding=c.embedding_norm,
    )
    weights = {k: v for k, v in model.state_dict().items()}
    for stack_name, stack in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        embeddings.weight = _np(weights[f"{stack_name}.tokens.weight"])
        stack.scale_embeddings = c.scale_embeddings
        stack.position_encodings.encodings = _positions(model, stack_name)
        if c.embedding_norm:
            _norm(stack.layernorm_embedding, weights, f"{stack_name}.embed_norm")
        if pre_norm:
            _norm(stack.layer_norm, weights, f"{stack_name}.final_norm")
        for i, layer in enumerate(stack.layer):
            p = f"{stack_name}.layers.{i}"
            _attention(layer.self_attention, weights, f"{p}.self_attn", f"{p}.norm_attn.norm", cross=False)
            if stack_name == "decoder":
                _attention(layer.attention, weights, f"{p}.cross_attn", f"{p}.norm_cross.norm", cross=True)
            _norm(layer.ffn.layer_norm, weights, f"{p}.norm_ffn.norm")
            _linear(layer.ffn.linear_0, weights, f"{p}.ffn.up_proj")
            _linear(layer.ffn.linear_1, weights, f"{p}.ffn.down_proj")
    _linear(spec.decoder.projection, weights, "lm_head")
    spec.config.layer_norm_epsilon = c.norm_eps
    spec.config.add_source_eos = True
    spec.config.bos_token = spec.config.decoder_start_token = tokenizer.bos_token
    spec.config.eos_token = tokenizer.eos_token
    spec.config.unk_token = tokenizer.special_tokens.get("unk", spec.config.unk_token)
    tokens = vocabulary(tokenizer, c.vocab_size)
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    return spec


def to_ctranslate2(
    model: EncoderDecoder, tokenizer: Tokenizer, out: str | os.PathLike[str], quantization: str = "float32"
) -> str:
    """Writes `model` as a CTranslate2 model directory at `out` (replacing it) with weights stored as
    `quantization`; returns the directory. Needs the `ctranslate2` package (`pip install ctranslate2`)."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization '{quantization}'; choose one of {', '.join(QUANTIZATIONS)}")
    try:
        from ctranslate2.converters import Converter
    except ImportError as err:
        raise ConfigError(
            "converting to CTranslate2 needs the ctranslate2 package: pip install ctranslate2 (or tformer[bench])"
        ) from err

    class _TformerConverter(Converter):
        def _load(self):
            return build_spec(model, tokenizer)

    return _TformerConverter().convert(os.fspath(out), quantization=quantization, force=True)
