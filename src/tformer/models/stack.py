"""A stack of Transformer blocks with its embeddings: the shared body of encoders and decoders."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tformer.config import ModelConfig
from tformer.layers import AttentionMask, Block, Dropout, make_norm, make_positions
from tformer.layers.kv_cache import KVCache, LayerCache
from tformer.layers.masks import build_mask
from tformer.layers.positions import Rotary, local_rotary_positions


def default_positions(n_keys: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens, so left and right padding leave real positions unchanged.

    Returns (B, n_keys) from a (B, n_keys) mask, or (1, n_keys) without one.
    """
    if attention_mask is None:
        return torch.arange(n_keys, device=device)[None]
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class StackInputs:
    """Where one forward's T tokens sit among the Tk keys they attend over: the stack's single way in.

    Built by `from_prefix` (a batch of sequences, maybe after `start` cached tokens; training and simple decoding)
    or `from_engine` (the engine's batch, each row at its own positions).
    """

    positions: torch.Tensor  # (B|1, T) position ids of the tokens: embeddings, rotary and position bias read them
    key_positions: torch.Tensor  # (B|1, Tk) position ids of every key, cached ones included
    cache_slots: torch.Tensor  # (B|1, T) where the tokens' keys and values go in a cache
    n_keys: int
    query_slots: torch.Tensor | None = None  # (B|1, T) each token's slot among the keys; None: the last T
    key_padding: torch.Tensor | None = None  # (B, Tk) True for real tokens
    # the (cos, sin) of `positions` when computed ahead (a compiled step's caller does: see `CompiledDecode`);
    # None: the stack computes them
    rotary: Rotary | None = None

    @classmethod
    def from_prefix(
        cls,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        start: int = 0,
        first_key: int = 0,
    ) -> StackInputs:
        """`tokens` (B, T) at slots start..start+T-1 after `start` cached ones.

        `attention_mask` (B, start + T), 1 for real tokens, covers every key; left padding shifts the positions it
        derives. `positions` (B, start + T) overrides them (context parallelism passes a shard's global positions).
        `first_key` > 0 when the cache returns keys from there on only (a rolling sliding-window buffer).
        """
        batch, n_new = tokens.shape
        end = start + n_new
        key_positions = default_positions(end, attention_mask, tokens.device) if positions is None else positions
        return cls(
            positions=key_positions[:, start:].expand(batch, n_new),
            key_positions=key_positions[:, first_key:],
            cache_slots=torch.arange(start, end, device=tokens.device)[None],
            n_keys=end - first_key,
            key_padding=None if attention_mask is None else attention_mask[:, first_key:].bool(),
        )

    @classmethod
    def from_engine(
        cls, positions: torch.Tensor, n_keys: int, key_starts: torch.Tensor | None = None, last_slots: bool = False
    ) -> StackInputs:
        """The engine's batch: `positions` (B, T) places each row's tokens (-1 marks padding) over `n_keys` keys.

        Row b's keys are positions key_starts[b] .. key_starts[b] + n_keys - 1 (`key_starts` (B, 1), for a sliding
        window; None: from 0). The engine's sequences start at position 0, with no padding inside. `last_slots`:
        every row starts at one position, padded on the right, so column t is slot n_keys - T + t in every row
        and causality alone masks (a padding query's output is never read): attention needs no dense mask, whose
        cost showed in SmolLM2's prefill (docs/design-notes.md, "models/stack.py").
        """
        real_positions = positions.clamp(min=0)
        key_positions = torch.arange(n_keys, device=positions.device)[None]
        query_slots = None if last_slots and key_starts is None else real_positions
        if key_starts is not None:
            key_positions = key_positions + key_starts
            query_slots = (real_positions - key_starts).clamp(min=0)
        return cls(
            positions=real_positions,
            key_positions=key_positions,
            cache_slots=positions,
            n_keys=n_keys,
            query_slots=query_slots,
        )


def engine_key_count(cache: list[LayerCache], positions: torch.Tensor) -> int:
    """How many key slots an engine step attends over: the largest position plus one.

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
        n_layers = config.n_decoder_layers if self.causal else config.n_encoder_layers
        # each layer's sliding window (Gemma alternates windowed and full layers); `window` is the one all layers
        # share (rolling caches rely on it), None when they differ
        self.windows = config.layer_windows() if self.causal else [None] * n_layers
        self.window = config.shared_window if self.causal else None
        self.tokens = tokens
        self.token_types = nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        self.positions = make_positions(config, causal=self.causal)
        # Gemma 3: windowed layers rotate by a RoPE of their own base (None: they share `positions`)
        self.local_positions = local_rotary_positions(config) if any(self.windows) else None
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.embed_norm = make_norm(config) if config.embedding_norm else None
        self.dropout = Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config, stack, cross_attention, i) for i in range(n_layers))
        self.final_norm = make_norm(config) if config.final_norm else nn.Identity()
        # T5 with a tied head scales the decoder's output, here so that every caller of lm_head gets it
        self.output_scale = config.d_model**-0.5 if self.causal and config.scale_decoder_output else 1.0

    def embed(
        self, tokens: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.config.round_embed_scale:  # Gemma rounds the scale to the weights' dtype first
            x = self.tokens(tokens) * torch.tensor(self.embed_scale, dtype=self.tokens.weight.dtype)  # (B, T, d)
        else:
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
        inputs: StackInputs | None = None,
        *,
        token_types: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_padding: torch.Tensor | None = None,
        cache: list[LayerCache] | None = None,
        prefix_lengths: torch.Tensor | None = None,
        global_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> hidden states (B, T, d), placed by `inputs` (default: a fresh unpadded batch).

        `cache` holds the keys and values of earlier slots (incremental decoding); `memory` (B, S, d) is the
        encoder output for cross-attention, `memory_padding` (B, S) its real tokens (with cached cross-attention
        keys and values, memory may be None). `prefix_lengths` (B,) turns a causal stack into a prefix LM: each
        row's first slots attend both ways. `global_tokens` (B, T) marks a Longformer layer's global tokens.
        """
        inputs = StackInputs.from_prefix(tokens) if inputs is None else inputs
        x = self.embed(tokens, inputs.positions, token_types)
        dtype, device, n_queries = compute_dtype(x), x.device, tokens.shape[1]
        # each layer's (window, position bias): umT5 gives every layer a bias table of its own
        rules = [(window, self.positions.layer_attention_bias(i)) for i, window in enumerate(self.windows)]
        masks = {  # one mask per distinct rule, each built once a forward
            (window, bias): build_mask(
                n_queries=n_queries,
                n_keys=inputs.n_keys,
                causal=self.causal,
                dtype=dtype,
                device=device,
                key_padding=inputs.key_padding,
                window=window,
                position_bias=bias,
                query_positions=inputs.positions,
                key_positions=inputs.key_positions,
                query_slots=inputs.query_slots,
                prefix_lengths=prefix_lengths,
                global_tokens=global_tokens,
            )
            for window, bias in dict.fromkeys(rules)
        }
        rotary = inputs.rotary if inputs.rotary is not None else self.positions.rotary(inputs.positions)
        local_rotary = rotary if self.local_positions is None else self.local_positions.rotary(inputs.positions)
        memory_mask = None
        if memory is not None or memory_padding is not None:
            n_memory = memory.shape[1] if memory is not None else memory_padding.shape[1]
            memory_mask = build_mask(
                n_queries=n_queries,
                n_keys=n_memory,
                causal=False,
                dtype=dtype,
                device=device,
                key_padding=memory_padding,
            )
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache[i]
            window = self.windows[i]
            layer_rotary = rotary if window is None else local_rotary
            x = self._run_layer(
                layer, x, masks[rules[i]], layer_rotary, memory, memory_mask, layer_cache, inputs.cache_slots
            )
        x = self.final_norm(x)
        return x if self.output_scale == 1.0 else x * self.output_scale

    def new_cache(
        self, batch_size: int, max_len: int, dtype: torch.dtype | None = None, rolling: bool = True
    ) -> list[LayerCache]:
        """Empty per-layer caches for decoding up to `max_len` positions.

        Under a sliding window each is a rolling buffer of the window's size when `rolling` (rows must then share
        their positions: batched decoding from one start); rolling=False keeps every position.
        """
        weight = self.tokens.weight
        heads, head_dim = self.config.n_kv_heads, self.config.head_dim
        window = self.window if rolling else None
        return [
            LayerCache(KVCache(batch_size, heads, head_dim, max_len, dtype or weight.dtype, weight.device, window))
            for _ in self.layers
        ]

    def first_visible(self, cache: list[LayerCache] | None, start: int) -> int:
        """The first key position a cached step from `start` sees: above 0 only in a rolling window buffer."""
        first_visible = getattr(cache[0].self_attn, "first_visible", None) if cache else None
        return 0 if first_visible is None else first_visible(start)

    def _run_layer(self, layer: Block, x: torch.Tensor, mask: AttentionMask, *rest: object) -> torch.Tensor:
        if self.config.activation_checkpointing and self.training:
            return checkpoint(layer, x, mask, *rest, use_reentrant=False)
        return layer(x, mask, *rest)
