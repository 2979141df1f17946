"""The three Transformer families: encoder-decoder, decoder-only language model, encoder (with an MLM head or none)."""

from __future__ import annotations

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.layers import make_norm
from tformer.layers.ffn import ACTIVATIONS
from tformer.layers.kv_cache import CrossKV, LayerCache
from tformer.layers.masks import build_mask
from tformer.models.base import TransformerModel
from tformer.models.convolutional import ConvS2S
from tformer.models.heads import TASK_HEADS
from tformer.models.recurrent import LSTMEncoderDecoder
from tformer.models.ssm import SSMLM
from tformer.models.stack import StackInputs, TransformerStack


def _output_head(config: ModelConfig, tokens: nn.Embedding, vocab_size: int) -> nn.Linear:
    head = nn.Linear(config.d_model, vocab_size, bias=config.lm_head_bias)
    if config.tie_embeddings:
        head.weight = tokens.weight
    return head


class EncoderDecoder(TransformerModel):
    """The 2017 paper's model: p(y | x) = prod_t p(y_t | x, y_<t), for translation and other seq2seq tasks."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        src_tokens = nn.Embedding(config.vocab_size, config.d_model)
        tgt_tokens = src_tokens if config.share_embeddings else nn.Embedding(config.tgt_vocab_size, config.d_model)
        self.encoder = TransformerStack(config, "encoder", src_tokens)
        self.decoder = TransformerStack(config, "decoder", tgt_tokens, cross_attention=True)
        self.lm_head = _output_head(config, tgt_tokens, config.tgt_vocab_size)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Source tokens (B, S) -> memory (B, S, d). src_mask is 1 for real tokens."""
        return self.encoder(src, StackInputs.from_prefix(src, src_mask))

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        tgt_mask: torch.Tensor | None = None,
        cache: list[LayerCache] | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Target prefix (B, T) attending to memory -> next-token logits (B, T, V_tgt).

        With a `cache` from `new_cache`, tgt holds only the new tokens at positions start..start+T-1 and the
        memory's cross-attention keys and values are projected once, on the first call.
        """
        inputs = StackInputs.from_prefix(tgt, tgt_mask, start=start, first_key=self.decoder.first_visible(cache, start))
        hidden = self.decoder(tgt, inputs, memory=memory, memory_padding=src_mask, cache=cache)
        return self.lm_head(hidden)

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        memory: torch.Tensor | None = None,
        src_mask: torch.Tensor | None = None,
    ) -> list[LayerCache]:
        """Empty decoder caches for `batch_size` sequences of up to `max_len` target tokens.

        With `memory` (B, S, d) and its `src_mask`, the cross-attention keys and values are projected here, once per
        source, and the memory's mask built once: batch_size is then B * K for K beams per source (rows b * K + k),
        and `decode` takes memory=None and src_mask=None (CrossKV.beams).
        """
        caches = self.decoder.new_cache(batch_size, max_len, dtype)
        if memory is None:
            return caches
        if batch_size % memory.shape[0]:
            raise ValueError(f"a batch of {batch_size} rows cannot share the memory of {memory.shape[0]} sources")
        mask = build_mask(
            n_queries=1,
            n_keys=memory.shape[1],
            causal=False,
            dtype=memory.dtype,
            device=memory.device,
            key_padding=src_mask,
        )
        for block, layer_cache in zip(self.decoder.layers, caches, strict=True):
            k, v = block.cross_attn.project_kv(memory)  # (B, Hkv, S, D)
            layer_cache.cross_attn = CrossKV(k, v, beams=batch_size // memory.shape[0], mask=mask)
        return caches

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        tgt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher forcing: tgt is the target shifted right; returns logits (B, T, V_tgt)."""
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)


class DecoderLM(TransformerModel):
    """A decoder-only causal language model (GPT-2/3, LLaMA, Mistral): p(x) = prod_t p(x_t | x_<t)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.decoder = TransformerStack(config, "decoder", tokens)
        self.lm_head = _output_head(config, tokens, config.vocab_size)
        self.logit_softcap = config.final_logit_softcap

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., d) -> next-token logits (..., V): the output head, then Gemma 2's soft cap
        cap * tanh(logits / cap) when the config sets one. Every caller of the head (the engine too) comes here."""
        logits = self.lm_head(hidden)
        if self.logit_softcap is None:
            return logits
        return torch.tanh(logits / self.logit_softcap) * self.logit_softcap

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: list[LayerCache] | None = None,
        start: int = 0,
        prefix_lengths: torch.Tensor | None = None,
        inputs: StackInputs | None = None,
    ) -> torch.Tensor:
        """Tokens (B, T) -> next-token logits (B, T, V).

        With a `cache` from `new_cache`, input_ids are the new tokens after `start` cached ones and
        attention_mask (if any) covers all start+T positions; `positions` (B, start+T) overrides the position ids.
        With `prefix_lengths` (B,) the first tokens of each row form a bidirectional prefix (a prefix LM, as in
        UniLM and T5's prefix-LM objective). `inputs` replaces all of that (the engine's StackInputs.from_engine).
        """
        if inputs is None:
            first_key = self.decoder.first_visible(cache, start)
            inputs = StackInputs.from_prefix(input_ids, attention_mask, positions, start, first_key)
        hidden = self.decoder(input_ids, inputs, cache=cache, prefix_lengths=prefix_lengths)
        return self.output_logits(hidden)

    def new_cache(
        self, batch_size: int, max_len: int, dtype: torch.dtype | None = None, rolling: bool = True
    ) -> list[LayerCache]:
        """Empty KV caches for `batch_size` sequences of up to `max_len` tokens (rolling: see TransformerStack)."""
        return self.decoder.new_cache(batch_size, max_len, dtype, rolling)


class MLMHead(nn.Module):
    """BERT's masked-LM head: dense, activation, norm, then the (tied) vocabulary projection."""

    def __init__(self, config: ModelConfig, tokens: nn.Embedding) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.act = ACTIVATIONS[config.ffn]()
        self.norm = make_norm(config)
        self.lm_head = _output_head(config, tokens, config.vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.act(self.dense(hidden))))


# what an encoder puts on top of its hidden states; nn.Identity ignores the (config, tokens) arguments
ENCODER_HEADS: dict[str, type[nn.Module]] = {"mlm": MLMHead, "none": nn.Identity, **TASK_HEADS}


class EncoderMLM(TransformerModel):
    """A bidirectional encoder (BERT): with `encoder_head` "mlm" a masked-language-model head, with "none" none,
    with "sequence-classification" or "token-classification" a task head (models/heads.py)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = TransformerStack(config, "encoder", tokens)
        head = ENCODER_HEADS[config.encoder_head](config, tokens)
        # a task head has its own tensor names (task_head.*); the other of the two is an identity
        task = config.encoder_head in TASK_HEADS
        self.mlm_head = nn.Identity() if task else head
        self.task_head = head if task else nn.Identity()

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
        global_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens (B, T) -> contextual hidden states (B, T, d), e.g. for sentence embeddings.

        `global_tokens` (B, T), for attention 'longformer', marks the tokens with global attention.
        """
        inputs = StackInputs.from_prefix(input_ids, attention_mask)
        return self.encoder(input_ids, inputs, token_types=token_types, global_tokens=global_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
        global_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens (B, T) -> vocabulary logits (B, T, V) at every position; hidden states (B, T, d) without a head;
        with a task head, label logits (B, num_labels) per sequence or (B, T, num_labels) per token."""
        hidden = self.encode(input_ids, attention_mask, token_types, global_tokens)
        return self.task_head(self.mlm_head(hidden))


MODELS: dict[str, type[TransformerModel]] = {
    "encoder-decoder": EncoderDecoder,
    "decoder": DecoderLM,
    "encoder": EncoderMLM,
    "lstm-encoder-decoder": LSTMEncoderDecoder,  # the recurrent baseline with Luong attention (models/recurrent.py)
    "conv-encoder-decoder": ConvS2S,  # the convolutional baseline, ConvS2S (models/convolutional.py)
    "ssm": SSMLM,  # a Mamba LM, the Transformer LM's O(n) counterpart (models/ssm.py)
}
