"""The SSM family: a Mamba-style selective state-space language model, the Transformer LM's O(n) counterpart.

Token embedding, `n_decoder_layers` residual blocks `x = x + mixer(norm(x))` with RMSNorm, a final RMSNorm and
the output head tied to the embedding. No positions: the recurrence is ordered by itself. It trains with the
causal LM objective as the decoder family does; right padding (what `causal_lm` makes) cannot reach earlier
tokens, so the attention mask is not needed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tformer.config import ModelConfig
from tformer.layers.norms import RMSNorm
from tformer.layers.ssm import MambaMixer, SSMState
from tformer.models.base import TransformerModel


class MambaBlock(nn.Module):
    """One pre-norm residual block: x + MambaMixer(RMSNorm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.mixer = MambaMixer(config)

    def forward(self, x: torch.Tensor, state: SSMState | None = None) -> torch.Tensor:
        return x + self.mixer(self.norm(x), state)


class SSMLM(TransformerModel):
    """A Mamba language model: p(x) = prod_t p(x_t | x_<t), with a constant-size decoding state per layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(MambaBlock(config) for _ in range(config.n_decoder_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tokens.weight

    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None) -> list[SSMState]:
        """Empty decoding states, one per layer; their size does not grow with the sequence."""
        weight = self.tokens.weight
        return [layer.mixer.new_state(batch_size, dtype or weight.dtype, weight.device) for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: list[SSMState] | None = None,
    ) -> torch.Tensor:
        """Tokens (B, T) -> next-token logits (B, T, V).

        With a `cache` from `new_cache`, input_ids continue the sequences it holds and the cache is updated:
        a prompt runs through the chunked scan, a single token through the O(1) recurrent step.
        """
        x = self.tokens(input_ids)  # (B, T, d)
        for i, layer in enumerate(self.layers):
            state = None if cache is None else cache[i]
            if self.config.activation_checkpointing and self.training and state is None:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x, state)
        return self.lm_head(self.norm(x))
