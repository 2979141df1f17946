"""The convolutional baseline: ConvS2S (Gehring et al., 2017), a convolutional encoder-decoder with gated linear
units and an attention in every decoder layer, as fairseq's `fconv` builds it.

- Embeddings: token plus learned position embeddings (e = w + p), each E = d_model wide, for source and target.
- Encoder: a linear map E -> C, n_encoder_layers residual blocks x <- (GLUConv(x) + x) * sqrt(0.5) with a centred
  kernel of width conv_kernel, padding zeroed before each convolution, and a linear map back C -> E: the outputs
  z_j. Attention reads z_j as keys and (z_j + e_j) * sqrt(0.5) as values. The gradient into z is scaled by
  1 / (2 n_decoder_layers), since every decoder layer's attention adds one.
- Decoder: the same over the target embeddings g_i with causal convolutions; after each convolution the layer's
  attention (layers/convolution.py: ConvAttention) adds its context, then the residual. A linear map C -> E and
  the (tied) output projection give the logits.

Each layer sees conv_kernel positions of the layer below, so a stack of L layers sees 1 + L (k - 1) tokens (its
receptive field), and all positions of a sequence are computed at once in training, as in a Transformer.

The model has the encoder-decoder interface (`forward`, `encode`, `decode(..., cache=, start=)`, `new_cache`), so
the trainer, greedy and beam search, `tformer translate` and `tformer eval` use it as they use the Transformer.
Its decoding state (`ConvCache`) is each decoder layer's last k - 1 inputs: constant in size, as an LSTM's state.
Not in this model: the paper's weight normalization (the trainer's optimizer and gradient clipping stand in).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.layers.convolution import SQRT_HALF, ConvAttention, GLUConv, GradScale
from tformer.models.base import TransformerModel
from tformer.models.recurrent import RecurrentCache


class ConvCache(RecurrentCache):
    """The conv decoder's state between incremental calls: each layer's last k - 1 inputs and the source memory.

    A causal convolution of width k reads only the k - 1 inputs before a position, so this replaces a KV cache at
    a size that does not grow with the output. It is a `RecurrentCache` because beam search reorders it the same
    way (row i takes row index[i]'s state; the memory changes only when sources leave the batch).
    """

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        self.history: list[torch.Tensor] | None = None  # per decoder layer (B, k - 1, C), zeros before the first

    def reorder(self, index: torch.Tensor, shrinking: bool = True) -> None:
        if self.history is not None:
            self.history = [h[index] for h in self.history]
        if shrinking and self.memory is not None:
            self.memory = self.memory[index]


def _zero_padding(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x.masked_fill(mask[..., None] == 0, 0.0)


class ConvEncoder(nn.Module):
    """Source embeddings e (B, S, E) -> encoder outputs z (B, S, E)."""

    def __init__(self, config: ModelConfig, channels: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(config.d_model, channels)
        self.convs = nn.ModuleList(
            GLUConv(channels, config.conv_kernel, causal=False, dropout=config.dropout)
            for _ in range(config.n_encoder_layers)
        )
        self.out_proj = nn.Linear(channels, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, embedded: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.in_proj(embedded)  # (B, S, C)
        for conv in self.convs:
            # padding reads as zeros, as beyond the sequence's ends: a batch row equals the sentence encoded alone
            x = (conv(self.dropout(_zero_padding(x, mask))) + x) * SQRT_HALF
        return _zero_padding(self.out_proj(x), mask)  # (B, S, E)


class ConvDecoderLayer(nn.Module):
    """A causal gated convolution, then its attention over the encoder (which adds the residual inside), then
    the block's residual."""

    def __init__(self, config: ModelConfig, channels: int) -> None:
        super().__init__()
        self.conv = GLUConv(channels, config.conv_kernel, causal=True, dropout=config.dropout)
        self.attention = ConvAttention(channels, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        target_embedding: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        src_mask: torch.Tensor | None,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.conv(self.dropout(x), history)  # (B, T, C)
        h = self.attention(h, target_embedding, keys, values, src_mask)
        return (h + x) * SQRT_HALF


class ConvS2S(TransformerModel):
    """The convolutional baseline with the encoder-decoder interface: p(y | x) = prod_t p(y_t | x, y_<t)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        channels = config.conv_hidden or config.d_model
        src_tokens = nn.Embedding(config.vocab_size, config.d_model)
        tgt_tokens = src_tokens if config.share_embeddings else nn.Embedding(config.tgt_vocab_size, config.d_model)
        self.src_tokens, self.tgt_tokens = src_tokens, tgt_tokens
        self.src_positions = nn.Embedding(config.max_seq_len, config.d_model)
        self.tgt_positions = nn.Embedding(config.max_seq_len, config.d_model)
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = ConvEncoder(config, channels)
        self.in_proj = nn.Linear(config.d_model, channels)
        self.layers = nn.ModuleList(ConvDecoderLayer(config, channels) for _ in range(config.n_decoder_layers))
        self.out_proj = nn.Linear(channels, config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.tgt_vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = tgt_tokens.weight

    def _embed(self, tokens: torch.Tensor, table: nn.Embedding, positions: nn.Embedding, start: int) -> torch.Tensor:
        end = start + tokens.shape[1]
        if end > self.config.max_seq_len:
            raise ValueError(
                f"position {end - 1} is beyond the learned position table (max_seq_len {self.config.max_seq_len}); "
                "shorten the input or train with a larger max_seq_len"
            )
        index = torch.arange(start, end, device=tokens.device)
        return self.dropout(table(tokens) * self.embed_scale + positions(index))  # (B, T, E)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Source tokens (B, S) -> memory (B, S, 2E): the keys z and the values (z + e) * sqrt(0.5), side by side
        (one tensor, so that searches can repeat and reorder it by rows)."""
        embedded = self._embed(src, self.src_tokens, self.src_positions, 0)
        z = self.encoder(embedded, src_mask)
        values = (z + embedded) * SQRT_HALF
        z = GradScale.apply(z, 1.0 / (2 * len(self.layers)))
        return torch.cat([z, values], -1)

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor | None,
        src_mask: torch.Tensor | None = None,
        tgt_mask: torch.Tensor | None = None,
        cache: ConvCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Target tokens (B, T) attending to memory -> next-token logits (B, T, V_tgt).

        The convolutions are causal and the target right-padded, so tgt_mask changes no real position. With a
        `cache` from `new_cache`, tgt holds the tokens after the `start` already read (start must be the cache's
        length); the memory is kept from the first call, so later calls may pass None.
        """
        if cache is not None:
            if start != cache.length:
                raise ValueError(f"the convolutional cache has read {cache.length} tokens; decode from start={start}")
            if cache.memory is None:
                cache.memory = memory
            memory = cache.memory
        elif start:
            raise ValueError(f"decoding from start={start} needs the cache of the tokens before it (new_cache)")
        keys, values = memory.chunk(2, -1)  # (B, S, E) each
        target_embedding = self._embed(tgt, self.tgt_tokens, self.tgt_positions, start)
        x = self.in_proj(target_embedding)  # (B, T, C)
        if cache is not None and cache.history is None:  # positions before the first read zeros
            width = self.config.conv_kernel - 1
            cache.history = [x.new_zeros(x.shape[0], width, x.shape[2]) for _ in self.layers]
        for i, layer in enumerate(self.layers):
            history = None
            if cache is not None:
                history = cache.history[i]
                cache.history[i] = torch.cat([history, x], 1)[:, x.shape[1] :]  # the last k - 1 inputs
            x = layer(x, target_embedding, keys, values, src_mask, history)
        if cache is not None:
            cache.length += tgt.shape[1]
        return self.lm_head(self.dropout(self.out_proj(x)))

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> ConvCache:
        """An empty decoder state for `batch_size` sequences (its size does not depend on `max_len`)."""
        return ConvCache(batch_size)

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        tgt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher forcing: tgt is the target shifted right; returns logits (B, T, V_tgt)."""
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)
