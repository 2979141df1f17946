"""`tformer viz attention`: the cross-attention map of a translation against an explicit math-attention forward of the
same model on the same tokens, and the figure's panels against the map."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_model, tiny_config, with_config
from helpers import assert_png

from tformer.data import Tokenizer
from tformer.decoding import translate_ids
from tformer.decoding.attention_map import CrossAttentionMap, cross_attention_map
from tformer.errors import ConfigError
from tformer.models import EncoderDecoder
from tformer.viz import attention_figure, plot_cross_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads would only wait on each other

SENTENCE = "In the beginning God created the heaven and the earth."
TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "Im Anfang schuf Gott die Himmel und die Erde.",
    "And God said, Let there be light: and there was light.",
    "Und Gott sprach: Es werde Licht! und es ward Licht.",
] * 5


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(TEXTS, vocab_size=300)


def translation_model(tokenizer: Tokenizer, **overrides: object) -> EncoderDecoder:
    """A random tiny translator; its 48-position context caps a search that never emits </s> at 48 tokens."""
    vocab = len(tokenizer)
    config = tiny_config("tiny-transformer", vocab_size=vocab, tgt_vocab_size=vocab, max_seq_len=48, **overrides)
    return make_model(config, seed=2)


def ending_early(model: EncoderDecoder, tokenizer: Tokenizer) -> EncoderDecoder:
    """The model with the output embedding of </s> set to twice that of the token greedy search emits third, so
    that </s> wins by the third step (a random model never ends by itself). Target embeddings must not be shared
    with the source, which then keeps its </s>."""
    source = tokenizer.encode(SENTENCE)
    third = translate_ids(model, [source], tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, beam_size=1)[0][2]
    with torch.no_grad():
        model.decoder.tokens.weight[tokenizer.eos_id] = 2 * model.decoder.tokens.weight[third]
    return model


def explicit_weights(model: EncoderDecoder, attention: CrossAttentionMap, bos_id: int) -> tuple[torch.Tensor, ...]:
    """(weights (layers, heads, out_len, src_len), logits (out_len, vocab)) of one teacher-forced forward of the
    same weights on the math backend over the map's tokens."""
    reference = with_config(model, attention_backend="math").eval()
    for block in reference.decoder.layers:
        block.cross_attn.keep_weights = True
    src = torch.tensor([attention.source_ids])
    tgt_in = torch.tensor([[bos_id, *attention.output_ids[:-1]]])
    with torch.no_grad():
        logits = reference(src, tgt_in, torch.ones_like(src), torch.ones_like(tgt_in))[0]
    weights = torch.stack([block.cross_attn.last_weights[0] for block in reference.decoder.layers])
    return weights, logits


def check_against_explicit_forward(model: EncoderDecoder, tokenizer: Tokenizer, attention: CrossAttentionMap) -> None:
    n_layers, n_heads = model.config.n_decoder_layers, model.config.n_heads
    assert attention.weights.shape == (n_layers, n_heads, len(attention.output_ids), len(attention.source_ids))
    torch.testing.assert_close(attention.weights.sum(-1), torch.ones(attention.weights.shape[:-1]))
    weights, logits = explicit_weights(model, attention, tokenizer.bos_id)
    torch.testing.assert_close(attention.weights, weights, atol=1e-5, rtol=0)
    assert attention.source_ids == [*tokenizer.encode(SENTENCE), tokenizer.eos_id]
    labels = [tokenizer.decode([i], skip_special_tokens=False) for i in attention.source_ids + attention.output_ids]
    assert attention.source_tokens + attention.output_tokens == labels
    for block in model.decoder.layers:  # the capture put the backend back
        assert block.cross_attn.backend.__name__ == "sdpa_attention" and not block.cross_attn.keep_weights


@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("ends", ["at </s>", "at the length limit"])
def test_greedy_map_equals_the_explicit_forward_and_its_argmax_is_the_output(
    tokenizer: Tokenizer, n_kv_heads: int, ends: str
) -> None:
    model = translation_model(tokenizer, n_kv_heads=n_kv_heads, share_embeddings=False)
    if ends == "at </s>":
        model = ending_early(model, tokenizer)
    attention = cross_attention_map(model, tokenizer, SENTENCE, beam_size=1)
    check_against_explicit_forward(model, tokenizer, attention)
    _, logits = explicit_weights(model, attention, tokenizer.bos_id)
    assert logits.argmax(-1).tolist() == attention.output_ids  # row t is the step that chose output t
    greedy = translate_ids(model, [tokenizer.encode(SENTENCE)], tokenizer.bos_id, tokenizer.eos_id, 0, beam_size=1)[0]
    if ends == "at </s>":
        assert attention.output_ids == [*greedy, tokenizer.eos_id] and attention.output_tokens[-1] == "</s>"
        assert len(greedy) <= 2
    else:  # the search stopped at len(source) + 50 tokens, capped by max_seq_len, without emitting </s>
        assert attention.output_ids == greedy and tokenizer.eos_id not in greedy
        assert len(greedy) == min(len(attention.source_ids) + 50, model.config.max_seq_len)


def test_beam_search_map_is_that_of_the_hypothesis_it_returned(tokenizer: Tokenizer) -> None:
    model = ending_early(translation_model(tokenizer, share_embeddings=False), tokenizer)
    attention = cross_attention_map(model, tokenizer, SENTENCE, beam_size=3)
    check_against_explicit_forward(model, tokenizer, attention)
    best = translate_ids(model, [tokenizer.encode(SENTENCE)], tokenizer.bos_id, tokenizer.eos_id, 0, beam_size=3)[0]
    assert attention.output_ids == [*best, tokenizer.eos_id]


def test_the_figure_draws_every_layer_and_head_and_the_means(tokenizer: Tokenizer, tmp_path: Path) -> None:
    model = ending_early(translation_model(tokenizer, share_embeddings=False), tokenizer)
    attention = cross_attention_map(model, tokenizer, SENTENCE)
    figure = attention_figure(attention)
    panels = {ax.get_title(): np.asarray(ax.images[0].get_array()) for ax in figure.axes if ax.get_visible()}
    n_layers, n_heads = attention.weights.shape[:2]
    assert len(panels) == n_layers * (n_heads + 1) + 1
    for layer in range(n_layers):
        for head in range(n_heads):
            np.testing.assert_array_equal(panels[f"layer {layer} head {head}"], attention.weights[layer, head].numpy())
        mean = attention.weights[layer].mean(0).numpy()
        np.testing.assert_allclose(panels[f"layer {layer}, mean of heads"], mean, rtol=1e-6)
    overall = panels["mean of all layers and heads"]
    np.testing.assert_allclose(overall, attention.weights.mean(dim=(0, 1)).numpy(), rtol=1e-6)
    np.testing.assert_allclose(overall.sum(-1), 1.0, rtol=1e-5)
    bottom_left = next(ax for ax in figure.axes if ax.get_title() == "mean of all layers and heads")
    assert [t.get_text() for t in bottom_left.get_xticklabels()] == attention.source_tokens
    assert [t.get_text() for t in bottom_left.get_yticklabels()] == attention.output_tokens
    assert_png(plot_cross_attention(attention, tmp_path / "attention.png"))
    web = json.loads(json.dumps(attention.to_dict()))
    assert np.allclose(web["weights"], attention.weights.numpy()) and web["source_tokens"] == attention.source_tokens


def test_a_model_without_cross_attention_and_a_sentence_beyond_the_context_are_refused(tokenizer: Tokenizer) -> None:
    model = make_model(tiny_config("tiny-gpt2", vocab_size=len(tokenizer)))
    with pytest.raises(ConfigError, match="encoder-decoder"):
        cross_attention_map(model, tokenizer, SENTENCE)
    with pytest.raises(ConfigError, match=r"\d+ tokens.*max_seq_len of 48"):
        cross_attention_map(translation_model(tokenizer), tokenizer, SENTENCE + " " + SENTENCE)
