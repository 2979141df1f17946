"""Model arithmetic without memory: parameter counts, FLOPs per token and KV-cache bytes.

The model is built on the meta device, so even a 175B config costs nothing to inspect.
FLOPs follow the PaLM paper's appendix B convention: a matmul with a (m x n) weight costs 2mn FLOPs per token
(a mixture of experts: the router and the n_experts_per_token chosen experts),
attention adds 2 * 2 * n_heads * head_dim * context per layer (QK^T and the weighted sum of V), and a training
step costs 3x the forward pass (backward is twice the forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tformer.config import ConfigError, ModelConfig
from tformer.layers.ffn import MixtureOfExperts
from tformer.models import build_model

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


def _linear_flops(module: nn.Module) -> int:
    """2 FLOPs per weight of every Linear a token goes through: in a mixture of experts, the router and only the
    n_experts_per_token experts it picks (the experts are alike), though the parameters count them all."""
    moes = [m for m in module.modules() if isinstance(m, MixtureOfExperts)]
    in_experts = {id(linear) for moe in moes for linear in moe.experts.modules()}
    dense = sum(2 * m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in in_experts)
    return dense + sum(moe.top_k * _linear_flops(moe.experts[0]) for moe in moes)


def _stack_flops(config: ModelConfig, stack: nn.Module, context: int, cross_context: int = 0) -> int:
    """Forward FLOPs per token of one stack; `cross_context` source tokens are read by cross-attention."""
    windows = config.layer_windows() if stack.causal else [None] * len(stack.layers)  # Gemma: sliding and full
    keys = sum(min(context, window or context) + cross_context for window in windows)
    return _linear_flops(stack) + 4 * config.n_heads * config.head_dim * keys


def model_info(config: ModelConfig, context: int | None = None, kv_dtype: str = "fp16") -> ModelInfo:
    """Counts parameters, forward FLOPs per token at `context` and KV-cache bytes in `kv_dtype`."""
    if kv_dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype '{kv_dtype}'; choose one of: {', '.join(DTYPE_BYTES)}")
    context = config.max_seq_len if context is None else context
    if context < 1:
        raise ConfigError(f"context must be at least 1 token, got {context}")
    with torch.device("meta"):
        model = build_model(config, initialize=False)
    head = model.mlm_head if config.family == "encoder" else model.lm_head
    encoder_flops = decoder_flops = 0
    if config.has_encoder:
        encoder_flops = _stack_flops(config, model.encoder, context)
    if config.has_decoder:
        cross_context = context if config.has_encoder else 0
        decoder_flops = _stack_flops(config, model.decoder, context, cross_context)
        decoder_flops += _linear_flops(head)
    else:
        encoder_flops += _linear_flops(head)
    per_head = config.head_dim * DTYPE_BYTES[kv_dtype] + SCALE_BYTES.get(kv_dtype, 0)
    kv_per_layer_token = 2 * config.n_kv_heads * per_head
    decoder_layers = config.n_decoder_layers if config.has_decoder else 0
    window = config.shared_window or context  # a layer that sees every key keeps every token, as the engine does
    return ModelInfo(
        n_params=model.num_parameters(),
        n_params_non_embedding=model.num_parameters(exclude_embeddings=True),
        encoder_flops_per_token=encoder_flops,
        decoder_flops_per_token=decoder_flops,
        context=context,
        kv_dtype=kv_dtype,
        kv_bytes_per_token=kv_per_layer_token * decoder_layers,
        kv_cached_tokens=min(context, window),
        cross_kv_bytes_per_source_token=kv_per_layer_token * decoder_layers if config.has_encoder else 0,
    )


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
