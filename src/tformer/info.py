"""Model arithmetic without memory: parameter counts, FLOPs per token and KV-cache bytes.

FLOPs follow the PaLM paper's appendix B convention: a matmul with a (m x n) weight costs 2mn FLOPs per token
(a mixture of experts: the router and the n_experts_per_token chosen experts),
attention adds 2 * 2 * n_heads * head_dim * context per layer (QK^T and the weighted sum of V), and a training
step costs 3x the forward pass (backward is twice the forward).

The weights are counted from the config by formula (`counted_by_formula`), so that `tformer info` and `tformer
presets` never import torch, whose import alone is most of their time. A config the formula does not know (a family
without Transformer blocks) is built on the meta device and counted there (`counted_on_meta_model`), which costs
no memory even for a 175B config; that count is also the reference the tests hold the formula to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tformer.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from torch import nn

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
# Bytes stored beside each token's key or value vector of a KV head: the engine's int8 cache keeps a float32 scale
# there (`--kv-cache-dtype int8`, kernels/kv_int8.py), so that `info` counts what the engine allocates.
SCALE_BYTES = {"int8": 4}


@dataclass
class ModelInfo:
    """The figures `tformer info` prints. FLOPs are per token of each stack; KV bytes per decoded token."""

    n_params: int
    n_params_non_embedding: int
    encoder_flops_per_token: int  # forward, per source token; 0 without an encoder
    decoder_flops_per_token: int  # forward, per target token including the output head; 0 without a decoder
    context: int
    kv_dtype: str
    kv_bytes_per_token: int  # decoder self-attention K and V, all layers
    kv_cached_tokens: int  # tokens held at `context`: a sliding window caps it
    cross_kv_bytes_per_source_token: int  # encoder-decoder: cross-attention K/V, computed once per request

    @property
    def forward_flops_per_token(self) -> int:
        return self.encoder_flops_per_token + self.decoder_flops_per_token

    @property
    def training_flops_per_token(self) -> int:
        return 3 * self.forward_flops_per_token

    @property
    def kv_bytes_at_context(self) -> int:
        return self.kv_bytes_per_token * self.kv_cached_tokens


@dataclass(frozen=True)
class WeightCounts:
    """What `info` needs from a model's weights: its parameters (tied ones once), and the weights of the linear
    layers one token multiplies, 2 FLOPs each (in a mixture of experts the router and the chosen experts)."""

    n_params: int
    n_params_non_embedding: int  # without token, segment and position tables (a tied output head shares one)
    encoder_linear_weights: int  # the encoder's layers, per source token; 0 without an encoder
    decoder_linear_weights: int  # the decoder's layers, per target token; 0 without a decoder
    head_linear_weights: int  # the output head (an encoder's MLM head); 0 for a task head or none


def model_info(config: ModelConfig, context: int | None = None, kv_dtype: str = "fp16") -> ModelInfo:
    """Counts parameters, forward FLOPs per token at `context` and KV-cache bytes in `kv_dtype`."""
    if kv_dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype '{kv_dtype}'; choose one of: {', '.join(DTYPE_BYTES)}")
    context = config.max_seq_len if context is None else context
    if context < 1:
        raise ConfigError(f"context must be at least 1 token, got {context}")
    counts = weight_counts(config)
    encoder_flops = decoder_flops = 0
    if config.has_encoder:
        encoder_flops = 2 * counts.encoder_linear_weights + _attention_flops(config, False, context)
    if config.has_decoder:
        cross_context = context if config.has_encoder else 0
        decoder_flops = 2 * counts.decoder_linear_weights + _attention_flops(config, True, context, cross_context)
        decoder_flops += 2 * counts.head_linear_weights
    else:
        encoder_flops += 2 * counts.head_linear_weights
    per_head = config.head_dim * DTYPE_BYTES[kv_dtype] + SCALE_BYTES.get(kv_dtype, 0)
    kv_per_layer_token = 2 * config.n_kv_heads * per_head
    decoder_layers = config.n_decoder_layers if config.has_decoder else 0
    window = config.shared_window or context  # a layer that sees every key keeps every token, as the engine does
    return ModelInfo(
        n_params=counts.n_params,
        n_params_non_embedding=counts.n_params_non_embedding,
        encoder_flops_per_token=encoder_flops,
        decoder_flops_per_token=decoder_flops,
        context=context,
        kv_dtype=kv_dtype,
        kv_bytes_per_token=kv_per_layer_token * decoder_layers,
        kv_cached_tokens=min(context, window),
        cross_kv_bytes_per_source_token=kv_per_layer_token * decoder_layers if config.has_encoder else 0,
    )


def _attention_flops(config: ModelConfig, causal: bool, context: int, cross_context: int = 0) -> int:
    """QK^T and the weighted sum of V for one token of a stack: each layer reads `context` keys (its window's, if
    smaller), plus `cross_context` source tokens through cross-attention."""
    windows = config.layer_windows() if causal else [None] * config.n_encoder_layers  # Gemma: sliding and full
    keys = sum(min(context, window or context) + cross_context for window in windows)
    return 4 * config.n_heads * config.head_dim * keys


def weight_counts(config: ModelConfig) -> WeightCounts:
    """The config's weights, by formula where it applies, else counted on a model built on the meta device."""
    counts = counted_by_formula(config)
    return counts if counts is not None else counted_on_meta_model(config)


# ---- the formula: what each module of models/ and layers/ holds, for the choices listed here ----------------------
# A config with any other choice (a family without Transformer blocks, or a choice added later) goes to the meta
# model instead, so that a choice the formula does not know is never counted wrong.
FORMULA_CHOICES: dict[str, tuple[str, ...]] = {
    "family": ("encoder-decoder", "decoder", "encoder"),
    "ffn": ("relu", "gelu", "gelu-tanh", "silu", "swiglu", "geglu", "geglu-tanh"),
    "attention": ("softmax", "longformer", "performer", "strided", "fixed", "linear"),
    "norm": ("layernorm", "rmsnorm", "rmsnorm-plus-one"),
    "norm_placement": ("post", "pre", "sandwich", "deepnorm"),
    "position": ("sinusoidal", "learned", "rope", "alibi", "t5", "none"),
    "encoder_head": ("mlm", "none", "sequence-classification", "token-classification", "question-answering"),
}
GATED_FFNS = ("swiglu", "geglu", "geglu-tanh")  # gate, up and down projections; the others up and down


def counted_by_formula(config: ModelConfig) -> WeightCounts | None:
    """The weights of a Transformer config, without building it; None where the formula does not apply."""
    if any(getattr(config, key) not in choices for key, choices in FORMULA_CHOICES.items()):
        return None
    d = config.d_model
    tokens = config.vocab_size * d
    separate_target = config.family == "encoder-decoder" and not config.share_embeddings
    embeddings = tokens + (config.tgt_vocab_size * d if separate_target else 0)
    params = encoder_weights = decoder_weights = 0
    if config.has_encoder:
        stack_params, stack_embeddings, encoder_weights = _stack(config, causal=False)
        params, embeddings = params + stack_params, embeddings + stack_embeddings
    if config.has_decoder:
        stack_params, stack_embeddings, decoder_weights = _stack(config, causal=True)
        params, embeddings = params + stack_params, embeddings + stack_embeddings
    head_params, head_weights = _head(config)
    return WeightCounts(
        n_params=embeddings + params + head_params,
        n_params_non_embedding=params + head_params,
        encoder_linear_weights=encoder_weights,
        decoder_linear_weights=decoder_weights,
        head_linear_weights=head_weights,
    )


def _norm(config: ModelConfig, dim: int) -> int:
    return 2 * dim if config.norm == "layernorm" and config.norm_bias else dim  # gain, and LayerNorm's bias


def _stack(config: ModelConfig, causal: bool) -> tuple[int, int, int]:
    """(parameters other than tables, table parameters, linear weights per token) of a TransformerStack; the token
    table is the model's, shared."""
    n_layers = config.n_decoder_layers if causal else config.n_encoder_layers
    cross = causal and config.has_encoder
    tables = config.type_vocab_size * config.d_model
    if config.position == "learned":
        tables += (config.max_seq_len + config.position_offset) * config.d_model
    elif config.position == "t5":  # a bucket table per stack, or per layer (umT5)
        bucket_tables = n_layers if config.relative_attention_per_layer else 1
        tables += bucket_tables * config.relative_attention_buckets * config.n_heads
    params = _norm(config, config.d_model) * (config.embedding_norm + config.final_norm)
    weights = 0
    for layer in range(n_layers):
        block_params, block_weights = _block(config, cross, layer)
        params, weights = params + block_params, weights + block_weights
    return params, tables, weights


def _block(config: ModelConfig, cross: bool, layer: int) -> tuple[int, int]:
    """(parameters, linear weights per token) of one Block: attention, cross-attention, FFN, their residual norms."""
    residual = _norm(config, config.d_model) * (2 if config.norm_placement == "sandwich" else 1)
    params, weights = _attention(config, cross=False)
    params += residual
    if cross:
        cross_params, cross_weights = _attention(config, cross=True)
        params, weights = params + cross_params + residual, weights + cross_weights
    if config.n_experts and layer not in (config.moe_dense_layers or []):
        expert_params, expert_weights = _ffn(config, config.moe_d_ff)
        router = config.d_model * config.n_experts  # no bias
        ffn_params = router + config.n_experts * expert_params
        ffn_weights = router + config.n_experts_per_token * expert_weights
    else:
        ffn_params, ffn_weights = _ffn(config, config.d_ff)
    return params + ffn_params + residual, weights + ffn_weights


def _attention(config: ModelConfig, cross: bool) -> tuple[int, int]:
    """(parameters, linear weights) of the q, k, v and output projections, with query-key norms."""
    d, bias = config.d_model, config.attn_bias
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    weights = 2 * d * q + 2 * d * kv
    if config.attention == "longformer" and not cross:  # own q, k and v projections for the global tokens
        weights += d * q + 2 * d * kv
        return weights + bias * (2 * q + 4 * kv + d), weights
    out_bias = bias if config.attn_out_bias is None else config.attn_out_bias
    norms = 2 * _norm(config, config.head_dim) if config.qk_norm and not cross else 0
    return weights + bias * (q + 2 * kv) + out_bias * d + norms, weights


def _ffn(config: ModelConfig, d_ff: int) -> tuple[int, int]:
    """(parameters, linear weights) of one dense FFN of width d_ff."""
    inputs = 2 if config.ffn in GATED_FFNS else 1  # gate and up, or up
    weights = (inputs + 1) * config.d_model * d_ff
    return weights + config.ffn_bias * (inputs * d_ff + config.d_model), weights


def _head(config: ModelConfig) -> tuple[int, int]:
    """(parameters, linear weights) of what sits on the last hidden states; a tied projection holds no weight of
    its own."""
    d = config.d_model
    vocab = config.tgt_vocab_size if config.family == "encoder-decoder" else config.vocab_size
    projection = (0 if config.tie_embeddings else vocab * d) + config.lm_head_bias * vocab
    if config.has_decoder:
        return projection, vocab * d
    if config.encoder_head == "mlm":  # BERT's transform (dense with bias, activation, norm), then the projection
        return d * d + d + _norm(config, d) + projection, d * d + vocab * d
    labels = config.num_labels or 0
    task_heads = {
        "none": 0,
        "sequence-classification": d * d + d + d * labels + labels,  # pooler, classifier
        "token-classification": d * labels + labels,
        "question-answering": 2 * d + 2,  # start and end logits
    }
    return task_heads[config.encoder_head], 0  # a task head's FLOPs are left out, as the meta count leaves them


# ---- the reference: a model built on the meta device -------------------------------------------------------------
def counted_on_meta_model(config: ModelConfig) -> WeightCounts:
    """The weights of the model `config` builds, counted on the meta device (any family; imports torch)."""
    import torch

    from tformer.models import build_model

    with torch.device("meta"):
        model = build_model(config, initialize=False)
    head = model.mlm_head if config.family == "encoder" else model.lm_head
    return WeightCounts(
        n_params=model.num_parameters(),
        n_params_non_embedding=model.num_parameters(exclude_embeddings=True),
        encoder_linear_weights=_linear_weights(model.encoder) if config.has_encoder else 0,
        decoder_linear_weights=_linear_weights(model.decoder) if config.has_decoder else 0,
        head_linear_weights=_linear_weights(head),
    )


def _linear_weights(module: nn.Module) -> int:
    """The weights of every Linear a token goes through: in a mixture of experts, the router and only the
    n_experts_per_token experts it picks (the experts are alike), though the parameters count them all."""
    from torch import nn

    from tformer.layers.ffn import MixtureOfExperts

    moes = [m for m in module.modules() if isinstance(m, MixtureOfExperts)]
    in_experts = {id(linear) for moe in moes for linear in moe.experts.modules()}
    dense = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in in_experts)
    return dense + sum(moe.top_k * _linear_weights(moe.experts[0]) for moe in moes)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size // 2:
            return f"{n:,} B ({n / size:.2f} {unit})"
    return f"{n:,} B"


def format_info(name: str, config: ModelConfig, info: ModelInfo) -> str:
    """The human-readable report printed by `tformer info`."""
    lines = [
        f"model          {name} ({config.family}, d_model={config.d_model}, heads={config.n_heads}/"
        f"{config.n_kv_heads} kv, layers={config.n_encoder_layers if config.has_encoder else 0} enc + "
        f"{config.n_decoder_layers if config.has_decoder else 0} dec)",
        f"parameters     {info.n_params:,} ({info.n_params_non_embedding:,} without embedding tables)",
        f"forward FLOPs  {info.forward_flops_per_token:,} per token at context {info.context:,}",
    ]
    if config.family == "encoder-decoder":
        lines.append(
            f"               = {info.encoder_flops_per_token:,} per source token"
            f" + {info.decoder_flops_per_token:,} per target token"
        )
    lines.append(f"training FLOPs {info.training_flops_per_token:,} per token (3x forward)")
    if config.has_decoder:
        lines.append(f"KV cache       {format_bytes(info.kv_bytes_per_token)} per token in {info.kv_dtype}")
        capped = " (sliding window)" if info.kv_cached_tokens < info.context else ""
        lines.append(
            f"               {format_bytes(info.kv_bytes_at_context)} at context {info.context:,}: "
            f"{info.kv_cached_tokens:,} tokens cached{capped}"
        )
    if config.has_encoder and config.has_decoder:
        lines.append(
            f"cross-attn KV  {format_bytes(info.cross_kv_bytes_per_source_token)} per source token, once per request"
        )
    if not config.has_decoder:
        lines.append("KV cache       none: an encoder reads its whole input at once")
    return "\n".join(lines)
