"""A stack of Transformer blocks with its embeddings: the shared body of encoders and decoders."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tformer.config import ModelConfig
from tformer.layers import AttentionMask, Block, Dropout, build_mask, make_norm, make_positions
from tformer.layers.kv_cache import KVCache, LayerCache


def default_positions(n_keys: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens, so left and right padding leave real positions unchanged.

    Returns (B, n_keys) from a (B, n_keys) mask, or (1, n_keys) without one.
    """
    if attention_mask is None:
        return torch.arange(n_keys, device=device)[None]
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _key_count(cache: list[LayerCache], positions: torch.Tensor) -> int:
    """How many key positions a cached step attends over: the largest position plus one.

    A cache that already knows it (the engine's paged view, `key_count`) says so, which spares reading a
    tensor value back, a graph break under torch.compile.
    """
    known = getattr(cache[0].self_attn, "key_count", None)
    return known if known is not None else int(positions.max()) + 1


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention will run in: the autocast dtype when autocast is on, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class TransformerStack(nn.Module):
    """Embeddings (tokens * scale + positions [+ segments], norm, dropout), N blocks, final norm.

    `stack` is 'encoder' (bidirectional) or 'decoder' (causal, with cross-attention when
    `cross_attention` is set). The token embedding is passed in so that models can share it.
    """

    def __init__(self, config: ModelConfig, stack: str, tokens: nn.Embedding, cross_attention: bool = False) -> None:
        super().__init__()
        self.config = config
        self.causal = stack == "decoder"
        self.window = config.sliding_window if self.causal else None
        n_layers = config.n_decoder_layers if self.causal else config.n_encoder_layers
        self.tokens = tokens
        self.token_types = nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        self.positions = make_positions(config)
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.embed_norm = make_norm(config) if config.embedding_norm else None
        self.dropout = Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config, stack, cross_attention) for _ in range(n_layers))
        self.final_norm = make_norm(config) if config.final_norm else nn.Identity()

    def embed(
        self, tokens: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.tokens(tokens) * self.embed_scale  # (B, T, d)
        position_embedding = self.positions.embed(positions)
        if position_embedding is not None:
            x = x + position_embedding
        if self.token_types is not None:
            x = x + self.token_types(torch.zeros_like(tokens) if token_types is None else token_types)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return self.dropout(x)

    def forward(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_padding: torch.Tensor | None = None,
        cache: list[LayerCache] | None = None,
        start: int = 0,
        prefix_lengths: torch.Tensor | None = None,
        global_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> hidden states (B, T, d). Masks are 1 for real tokens.

        `global_tokens` (B, T) marks the tokens a Longformer attention layer attends to (and from) everywhere.

        `prefix_lengths` (B,) turns a causal stack into a prefix LM: each row's first slots attend both ways.

        Without a cache, attention_mask and positions are (B, T). With a `cache` (incremental decoding):
        - either `tokens` sit at positions start..start+T-1 after the cached ones, and attention_mask (if any)
          covers all start+T keys (left padding shifts the positions it derives);
        - or `positions` (B, T) place each row's tokens itself (an engine batch of sequences at different
          lengths, -1 marking padding), and there is no attention_mask.
        With cached cross-attention keys and values, `memory` may be None if memory_padding is given.
        """
        query_slots = None
        if cache is not None and positions is not None:
            if attention_mask is not None:
                raise ValueError("pass either positions or attention_mask with a cache, not both")
            query_slots, n_keys = positions.clamp(min=0), _key_count(cache, positions)
            cache_positions, positions = positions, query_slots
            key_positions = torch.arange(n_keys, device=tokens.device)[None]
        else:
            T = tokens.shape[1]
            n_keys = start + T
            key_positions = default_positions(n_keys, attention_mask, tokens.device) if positions is None else positions
            positions = key_positions[:, start:].expand(tokens.shape[0], T)
            cache_positions = torch.arange(start, n_keys, device=tokens.device)[None]
        x = self.embed(tokens, positions, token_types)
        dtype, device = compute_dtype(x), x.device
        position_bias = self.positions.attention_bias(positions, key_positions)
        mask = build_mask(
            tokens.shape[1],
            attention_mask,
            n_keys,
            self.causal,
            dtype,
            device,
            self.window,
            position_bias,
            query_slots,
            prefix_lengths,
        )
        if attention_mask is not None:
            mask.key_padding = attention_mask.bool()
        if global_tokens is not None:
            mask.global_tokens = global_tokens.bool()
        rotary = self.positions.rotary(positions)
        memory_mask = None
        if memory is not None or memory_padding is not None:
            n_memory = memory.shape[1] if memory is not None else memory_padding.shape[1]
            memory_mask = build_mask(tokens.shape[1], memory_padding, n_memory, False, dtype, device)
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache[i]
            x = self._run_layer(layer, x, mask, rotary, memory, memory_mask, layer_cache, cache_positions)
        return self.final_norm(x)

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> list[LayerCache]:
        """Empty per-layer caches for decoding up to `max_len` positions."""
        weight = self.tokens.weight
        heads, head_dim = self.config.n_kv_heads, self.config.head_dim
        return [
            LayerCache(KVCache(batch_size, heads, head_dim, max_len, dtype or weight.dtype, weight.device))
            for _ in self.layers
        ]

    def _run_layer(self, layer: Block, x: torch.Tensor, mask: AttentionMask, *rest: object) -> torch.Tensor:
        if self.config.activation_checkpointing and self.training:
            return checkpoint(layer, x, mask, *rest, use_reentrant=False)
        return layer(x, mask, *rest)
