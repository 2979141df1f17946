"""The cross-attention map of a translation: which source token each output token attended to, per layer and head.

`cross_attention_map` translates a sentence as `tformer translate` does (greedy or beam search), then runs the
decoder once more over the output the search returned, one token at a time on the KV cache as the search did, with
the cross-attention layers on the math backend, which returns its softmax weights. The decoder is causal, so the
weights of step t depend only on the output before t: they are the weights the search computed along the
hypothesis it returned. The result is plain data (a tensor and token texts) for a figure or a web page.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from tformer.decoding.search import translate_ids
from tformer.errors import ConfigError
from tformer.layers import Attention
from tformer.layers.attention import math_attention
from tformer.models import EncoderDecoder

EXTRA_LEN = 50  # the most output tokens beyond the source's length, as in `translate_ids`


class MapTokenizer(Protocol):
    """What the map needs from a tokenizer (tformer's `Tokenizer` has it)."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class CrossAttentionMap:
    """Cross-attention weights of one translation, with the tokens that label their axes."""

    weights: torch.Tensor  # (layers, heads, out_len, src_len) float32; each row is a softmax and sums to 1
    source_ids: list[int]  # src_len: the source as the encoder saw it, </s> included
    output_ids: list[int]  # out_len: what each decoding step chose, ending with </s> when the search emitted it
    source_tokens: list[str]  # each source id's text
    output_tokens: list[str]  # each output id's text

    def mean(self) -> torch.Tensor:
        """The weights averaged over layers and heads: (out_len, src_len), rows still summing to 1."""
        return self.weights.mean(dim=(0, 1))

    def to_dict(self) -> dict:
        """JSON-ready lists, for a web page."""
        return {
            "source_tokens": self.source_tokens,
            "output_tokens": self.output_tokens,
            "weights": self.weights.tolist(),  # [layer][head][output token][source token]
        }


@contextmanager
def capture_cross_attention(model: EncoderDecoder) -> Iterator[list[list[torch.Tensor]]]:
    """Within the block, every decoder cross-attention call appends its weights (B, H, Tq, S) to its layer's list.

    The cross-attention layers run on the math backend meanwhile (the only one that returns weights); their
    backend and `keep_weights` are restored on leaving.
    """
    layers: list[Attention] = [block.cross_attn for block in model.decoder.layers]
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    saved = [(layer.backend, layer.keep_weights) for layer in layers]

    def keep(index: int):
        def hook(module: Attention, args: tuple, output: torch.Tensor) -> None:
            captured[index].append(module.last_weights.float())

        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    for layer in layers:
        layer.backend, layer.keep_weights = math_attention, True
    try:
        yield captured
    finally:
        for layer, (backend, keep_weights), handle in zip(layers, saved, handles, strict=True):
            layer.backend, layer.keep_weights, layer.last_weights = backend, keep_weights, None
            handle.remove()


@torch.no_grad()
def replay_cross_attention(
    model: EncoderDecoder, source_ids: Sequence[int], output_ids: Sequence[int], bos_id: int
) -> torch.Tensor:
    """The cross-attention weights (layers, heads, out_len, src_len) of decoding `output_ids` from `source_ids`.

    The decoder is fed `bos_id` and then each output token but the last, one per step on a fresh KV cache, as a
    search does; step t's weights are those that chose output_ids[t].
    """
    model.eval()
    device = next(model.parameters()).device
    src = torch.tensor([list(source_ids)], device=device)  # (1, S)
    src_mask = torch.ones_like(src)
    inputs = [bos_id, *output_ids[:-1]]
    memory = model.encode(src, src_mask)  # (1, S, d)
    cache = model.new_cache(1, len(inputs))
    with capture_cross_attention(model) as captured:
        for t, token in enumerate(inputs):
            model.decode(torch.tensor([[token]], device=device), memory, src_mask, cache=cache, start=t)
    # per layer: out_len steps of (1, H, 1, S) -> (H, out_len, S)
    return torch.stack([torch.cat(steps, dim=2)[0] for steps in captured])  # (L, H, out_len, S)


def cross_attention_map(
    model: EncoderDecoder, tokenizer: MapTokenizer, sentence: str, beam_size: int = 1, alpha: float = 0.6
) -> CrossAttentionMap:
    """Translates `sentence` (greedy when beam_size is 1) and returns the cross-attention weights of its output."""
    if not isinstance(model, EncoderDecoder):
        raise ConfigError(
            f"a cross-attention map needs an encoder-decoder (translation) model, got a '{model.config.family}' one"
        )
    bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    encoded = tokenizer.encode(sentence)
    if not encoded:
        raise ConfigError("the sentence is empty; give the source sentence to translate")
    source_ids = [*encoded, eos]  # translate_ids ends every source with </s>
    if len(source_ids) > model.config.max_seq_len:
        raise ConfigError(
            f"the sentence has {len(source_ids)} tokens with </s>, beyond the model's max_seq_len of "
            f"{model.config.max_seq_len}; shorten it"
        )
    output = translate_ids(model, [encoded], bos, eos, pad, beam_size, alpha, extra_len=EXTRA_LEN)[0]
    limit = min(len(source_ids) + EXTRA_LEN, model.config.max_seq_len)
    output_ids = output + [eos] if len(output) < limit else output  # a search stopped at its limit emitted no </s>
    return attention_of(model, tokenizer, source_ids, output_ids)


def attention_of(
    model: EncoderDecoder, tokenizer: MapTokenizer, source_ids: Sequence[int], output_ids: Sequence[int]
) -> CrossAttentionMap:
    """The map of a translation already made (`output_ids` ending with </s> where the search emitted it), from the
    source as the encoder read it (`source_ids`, with its </s>)."""
    weights = replay_cross_attention(model, source_ids, output_ids, tokenizer.bos_id)
    labels = [tokenizer.decode([i], skip_special_tokens=False) for i in (*source_ids, *output_ids)]
    return CrossAttentionMap(
        weights, list(source_ids), list(output_ids), labels[: len(source_ids)], labels[len(source_ids) :]
    )
