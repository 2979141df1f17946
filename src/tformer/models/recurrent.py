"""The recurrent baseline: an LSTM encoder-decoder with Luong attention (Luong, Pham and Manning, 2015).

- Encoder: a stack of bidirectional LSTM layers; each direction has lstm_hidden / 2 units and a layer reads the
  concatenated outputs of the layer below. The backward direction reads each row's real tokens reversed, so
  right padding never reaches a real token's state.
- Decoder: a unidirectional stacked LSTM over the target embeddings (no input feeding, so teacher forcing runs
  the whole target through the LSTM in one call), then Luong's global attention with the "general" score
  score(h_t, m_s) = h_t^T W_a m_s, context c_t = sum_s a_ts m_s, and the attentional state
  h~_t = tanh(W_c [c_t; h_t]), which the (tied) output projection turns into logits.

The model has the encoder-decoder interface (`forward`, `encode`, `decode(..., cache=, start=)`, `new_cache`),
so the trainer, greedy and beam search, `tformer translate` and `tformer eval` use it as they use the Transformer.
The Transformer-only config keys (heads, d_ff, positions, norms) do not apply to it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.models.base import TransformerModel


def reversal_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, S) indices that reverse each row's real tokens (mask 1) in place and leave the right padding where it is.

    Gathering with it twice is the identity, so the same index also puts a reversed output back in order.
    """
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    lengths = mask.sum(1, keepdim=True)
    return torch.where(positions < lengths, lengths - 1 - positions, positions)


def _gather_time(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, S, D) reordered along time by index (B, S)."""
    return x.gather(1, index[..., None].expand_as(x))


class BiLSTMEncoder(nn.Module):
    """Stacked bidirectional LSTM: embeddings (B, S, E) -> memory (B, S, H), H = both directions' outputs."""

    def __init__(self, input_size: int, hidden: int, n_layers: int, dropout: float) -> None:
        super().__init__()
        sizes = [input_size] + [hidden] * (n_layers - 1)
        self.forward_lstms = nn.ModuleList(nn.LSTM(size, hidden // 2, batch_first=True) for size in sizes)
        self.backward_lstms = nn.ModuleList(nn.LSTM(size, hidden // 2, batch_first=True) for size in sizes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, S, E), mask (B, S) with 1 on real tokens -> (B, S, H); outputs at padding are not meaningful."""
        reverse = reversal_index(mask)
        for i, (forward_lstm, backward_lstm) in enumerate(zip(self.forward_lstms, self.backward_lstms, strict=True)):
            if i:
                x = self.dropout(x)
            ahead, _ = forward_lstm(x)  # (B, S, H/2): position s has read tokens 1..s
            behind, _ = backward_lstm(_gather_time(x, reverse))  # reversed rows: real tokens first
            x = torch.cat([ahead, _gather_time(behind, reverse)], -1)  # (B, S, H)
        return x


class LuongAttention(nn.Module):
    """Global attention with the general score: a_ts = softmax_s(h_t^T W_a m_s), h~_t = tanh(W_c [c_t; h_t])."""

    def __init__(self, hidden: int, out_size: int) -> None:
        super().__init__()
        self.score_proj = nn.Linear(hidden, hidden, bias=False)  # W_a^T: projects the query h_t
        self.combine = nn.Linear(2 * hidden, out_size, bias=False)  # W_c

    def forward(self, query: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor | None) -> torch.Tensor:
        """query (B, T, H), memory (B, S, H), memory_mask (B, S) 1 on real tokens -> h~ (B, T, out_size)."""
        scores = self.score_proj(query) @ memory.transpose(1, 2)  # (B, T, S)
        if memory_mask is not None:
            scores = scores.masked_fill(memory_mask[:, None, :] == 0, float("-inf"))
        weights = torch.softmax(scores.float(), -1).to(memory.dtype)
        context = weights @ memory  # (B, T, H)
        return torch.tanh(self.combine(torch.cat([context, query], -1)))


class RecurrentCache:
    """The decoder's state between incremental calls: each LSTM layer's (h, c) and the source memory.

    The LSTM's state replaces a KV cache: it is (n_layers, B, H) whatever the prefix length, so decoding a
    token costs the same at every step. `reorder` is the beam search's hook (decoding/search.py).
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None  # (h, c), each (n_layers, B, H)
        self.memory: torch.Tensor | None = None  # (B, S, H), kept from the first call
        self.length = 0  # target tokens read so far

    def reorder(self, index: torch.Tensor, shrinking: bool = True) -> None:
        """Row i takes the state of row index[i] (a beam its parent's). The memory is the same for all beams of
        a source, so it changes only when the batch drops sources (`shrinking`)."""
        if self.state is not None:
            self.state = (self.state[0][:, index], self.state[1][:, index])
        if shrinking and self.memory is not None:
            self.memory = self.memory[index]


class LSTMEncoderDecoder(TransformerModel):
    """The recurrent baseline with the encoder-decoder interface: p(y | x) = prod_t p(y_t | x, y_<t)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        hidden = config.lstm_hidden or config.d_model
        src_tokens = nn.Embedding(config.vocab_size, config.d_model)
        tgt_tokens = src_tokens if config.share_embeddings else nn.Embedding(config.tgt_vocab_size, config.d_model)
        self.src_tokens, self.tgt_tokens = src_tokens, tgt_tokens
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = BiLSTMEncoder(config.d_model, hidden, config.n_encoder_layers, config.dropout)
        between_layers = config.dropout if config.n_decoder_layers > 1 else 0.0
        self.decoder = nn.LSTM(
            config.d_model, hidden, config.n_decoder_layers, batch_first=True, dropout=between_layers
        )
        self.attention = LuongAttention(hidden, config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.tgt_vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = tgt_tokens.weight

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Source tokens (B, S) -> memory (B, S, H). src_mask is 1 for real tokens."""
        if src_mask is None:
            src_mask = torch.ones_like(src)
        return self.encoder(self.dropout(self.src_tokens(src) * self.embed_scale), src_mask)

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor | None,
        src_mask: torch.Tensor | None = None,
        tgt_mask: torch.Tensor | None = None,
        cache: RecurrentCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Target tokens (B, T) attending to memory -> next-token logits (B, T, V_tgt).

        The LSTM is causal by construction and the target is right-padded, so tgt_mask changes no real position.
        With a `cache` from `new_cache`, tgt holds the tokens after the `start` already read (start must be the
        cache's length: a recurrent state cannot skip or revisit positions); the memory is kept from the first
        call, so later calls may pass None.
        """
        state = None
        if cache is not None:
            if start != cache.length:
                raise ValueError(f"the recurrent cache has read {cache.length} tokens; decode from start={start}")
            if cache.memory is None:
                cache.memory = memory
            memory, state = cache.memory, cache.state
        x = self.dropout(self.tgt_tokens(tgt) * self.embed_scale)  # (B, T, E)
        hidden, new_state = self.decoder(x, state)  # (B, T, H)
        if cache is not None:
            cache.state, cache.length = new_state, cache.length + tgt.shape[1]
        attended = self.attention(hidden, memory, src_mask)  # (B, T, E)
        return self.lm_head(self.dropout(attended))

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> RecurrentCache:
        """An empty decoder state for `batch_size` sequences (its size does not depend on `max_len`)."""
        return RecurrentCache(batch_size)

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        tgt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher forcing: tgt is the target shifted right; returns logits (B, T, V_tgt)."""
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)
