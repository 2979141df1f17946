"""Performer's FAVOR+ attention: the linear forms against the quadratic form of the same kernel, the kernel against
softmax attention as features grow, and a decoder LM built with attention 'performer'."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import make_model, tiny_config, tokens, train_next_token
from helpers import prompts_of_mixed_lengths, reference_greedy

import tformer
from tformer import ModelConfig
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import SamplingParams
from tformer.errors import ConfigError
from tformer.layers.linear_attention import (
    CHUNK,
    PerformerAttention,
    favor_attention,
    kernel_attention_quadratic,
    orthogonal_random_features,
)
from tformer.layers.masks import AttentionMask

pytestmark = pytest.mark.usefixtures("one_thread")


def qkv(
    batch: int, heads: int, kv_heads: int, n_queries: int, n_keys: int, dim: int, seed: int = 0, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n_queries, dim, generator=generator) * scale
    k = torch.randn(batch, kv_heads, n_keys, dim, generator=generator) * scale
    v = torch.randn(batch, kv_heads, n_keys, dim, generator=generator)
    return q, k, v


def padding(batch: int, n_keys: int) -> torch.Tensor:
    """Row b has its last 3 * b keys padded (row 0 none)."""
    return torch.arange(n_keys)[None] < (n_keys - 3 * torch.arange(batch))[:, None]


# ---- the linear forms against the quadratic form of the same kernel ---------------------------------------------

N = 2 * CHUNK + 22  # two whole chunks and a partial one
SHAPES = {  # (n_queries, n_keys)
    "T=1": (1, 1),
    "part of a chunk": (CHUNK // 2, CHUNK // 2),
    "one chunk": (CHUNK, CHUNK),
    "chunks and a part": (N, N),
    "cached step of 1": (1, N),
    "cached step of a chunk and a part": (CHUNK + 12, N),
}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_forms_equal_the_quadratic_form(shape: str, causal: bool, padded: bool) -> None:
    n_queries, n_keys = SHAPES[shape]
    q, k, v = qkv(3, 4, 2, n_queries, n_keys, 16)  # GQA: 2 query heads per KV head
    features = orthogonal_random_features(32, 16, seed=1)
    key_padding = padding(3, n_keys) if padded and n_keys > 6 else None
    linear = favor_attention(q, k, v, features, causal, key_padding)
    quadratic = kernel_attention_quadratic(q, k, v, features, causal, key_padding)
    torch.testing.assert_close(linear, quadratic, rtol=1e-5, atol=1e-6)


def test_queries_at_their_own_slots_see_their_row_up_to_that_slot() -> None:
    """An engine batch: each row's queries sit at their own slots; keys after a row's last slot are stale."""
    q, k, v = qkv(3, 4, 2, 3, 30, 16)
    features = orthogonal_random_features(32, 16, seed=1)
    slots = torch.tensor([[27, 28, 29], [12, 0, 0], [20, 21, 22]])  # row 1: one real query, two padding ones
    out = favor_attention(q, k, v, features, True, query_slots=slots)
    for b, i in [(0, 0), (0, 2), (1, 0), (2, 0), (2, 1), (2, 2)]:
        end = int(slots[b, i]) + 1
        alone = favor_attention(
            q[b : b + 1, :, i : i + 1], k[b : b + 1, :, :end], v[b : b + 1, :, :end], features, True
        )
        torch.testing.assert_close(out[b : b + 1, :, i : i + 1], alone, rtol=1e-5, atol=1e-6)


def test_causal_form_sees_no_future_key() -> None:
    """Changing keys and values after slot t leaves outputs up to t unchanged; earlier keys do change them."""
    q, k, v = qkv(1, 2, 2, 130, 130, 16)
    features = orthogonal_random_features(32, 16, seed=1)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 100:] += 1.0
    v2[:, :, 100:] += 1.0
    before, after = favor_attention(q, k, v, features, True), favor_attention(q, k2, v2, features, True)
    torch.testing.assert_close(after[:, :, :100], before[:, :, :100], rtol=1e-5, atol=1e-6)
    assert (after - before)[:, :, 100:].norm(dim=-1).amin() > 1e-3  # every later query moves


# ---- FAVOR+ against softmax attention ---------------------------------------------------------------------------

FEATURE_COUNTS = (16, 64, 256, 1024)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def favor_errors(causal: bool, scale: float = 0.5, seeds: range = range(8)) -> list[float]:
    """RMS error of FAVOR+ against softmax attention at each feature count, averaged over feature draws.

    Values are unit Gaussians, so the error is in units of their standard deviation. `scale` sets the queries'
    and keys' standard deviation (head_dim 16: attention logits have standard deviation scale^2).
    """
    q, k, v = qkv(2, 2, 2, 128, 128, 16, scale=scale)
    reference = softmax_attention(q, k, v, causal)
    errors = []
    for m in FEATURE_COUNTS:
        per_seed = [
            float(
                (favor_attention(q, k, v, orthogonal_random_features(m, 16, seed), causal) - reference).square().mean()
            )
            ** 0.5
            for seed in seeds
        ]
        errors.append(sum(per_seed) / len(per_seed))
    return errors


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_favor_error_shrinks_as_features_grow(causal: bool) -> None:
    """Monte Carlo error falls like 1 / sqrt(m), so each 4x more features about halves it (measured: 0.5-0.65x);
    each step must cut it by a fifth, and 64x more features by two thirds."""
    errors = favor_errors(causal)
    for fewer, more in zip(errors, errors[1:], strict=False):
        assert more < 0.8 * fewer, errors
    assert errors[-1] < errors[0] / 3, errors


# ---- the attention module ----------------------------------------------------------------------------------------


def performer_config(**overrides: object) -> ModelConfig:
    return tiny_config("tiny-llama", attention="performer", performer_features=64, **overrides)


def test_left_padded_keys_are_ignored_by_causal_attention() -> None:
    """Row 1's first 5 keys are padding with random contents: its real queries see only its real keys."""
    q, k, v = qkv(2, 4, 2, 20, 20, 16)
    features = orthogonal_random_features(32, 16, seed=1)
    key_padding = torch.ones(2, 20, dtype=torch.bool)
    key_padding[1, :5] = False
    padded = favor_attention(q, k, v, features, True, key_padding)
    alone = favor_attention(q[1:, :, 5:], k[1:, :, 5:], v[1:, :, 5:], features, True)
    torch.testing.assert_close(padded[1:, :, 5:], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded[:1], favor_attention(q[:1], k[:1], v[:1], features, True), rtol=0, atol=0)


def test_cross_attention_ignores_padded_memory() -> None:
    """A cross-attention layer over memory whose last 4 slots are padding (random contents) equals one over the
    real slots alone."""
    config = performer_config()
    attention = PerformerAttention(config, cross=True).eval()
    x, memory = torch.randn(2, 9, config.d_model), torch.randn(2, 12, config.d_model)
    key_padding = (torch.arange(12) < 8)[None].expand(2, -1)
    with torch.no_grad():
        padded = attention(x, AttentionMask(key_padding=key_padding), context=memory)
        real = attention(x, AttentionMask(), context=memory[:, :8])
        unmasked = attention(x, AttentionMask(), context=memory)
    torch.testing.assert_close(padded, real, rtol=1e-5, atol=1e-6)
    assert (unmasked - real).abs().max() > 1e-3  # the padded slots would have mattered


def test_performer_encoder_ignores_padding() -> None:
    """An encoder (non-causal self-attention): a right-padded row gives the logits of that row alone."""
    model = make_model(tiny_config("tiny-bert", attention="performer", performer_features=64))
    ids = tokens(2, 12, model.config.vocab_size)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    with torch.no_grad():
        padded = model(ids, mask)
        alone = model(ids[1:, :8])
    torch.testing.assert_close(padded[1:, :8], alone, rtol=1e-5, atol=1e-5)


def test_features_are_a_seeded_buffer_outside_the_state_dict() -> None:
    """Softmax weights load into a Performer layer; redraws change outputs and are reproducible by seed."""
    config = performer_config()
    softmax = make_model(tiny_config("tiny-llama"))
    performer = make_model(config)
    performer.load_state_dict(softmax.state_dict())  # strict: the same tensors
    layer = performer.decoder.layers[0].self_attn
    assert "features" not in dict(layer.named_buffers(recurse=False)).keys() & layer.state_dict().keys()
    ids = tokens(2, 20, config.vocab_size)
    with torch.no_grad():
        first = performer(ids)
        seed = layer.redraw_features()
        redrawn = performer(ids)
        layer.redraw_features(seed)
        again = performer(ids)
    assert (redrawn - first).abs().max() > 1e-4
    torch.testing.assert_close(again, redrawn, rtol=0, atol=0)
    with torch.no_grad():
        rebuilt = make_model(config)  # a fresh build (as `load` does) starts from the same default draw
        rebuilt.load_state_dict(softmax.state_dict())
        torch.testing.assert_close(rebuilt(ids), first, rtol=0, atol=0)


def test_a_saved_performer_loads_with_the_same_features(tmp_path: Path) -> None:
    model = make_model(performer_config())
    model.save(tmp_path)
    ids = tokens(2, 20, model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(tformer.load(tmp_path)(ids), model(ids), rtol=0, atol=0)


def test_performer_with_alibi_or_a_sliding_window_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="performer"):
        tiny_config("tiny-gpt2", attention="performer", position="alibi")
    with pytest.raises(ConfigError, match="performer"):
        tiny_config("tiny-llama", attention="performer", sliding_window=8)
    with pytest.raises(ConfigError, match="performer_features"):
        tiny_config("tiny-llama", attention="performer", performer_features=0)
    with pytest.raises(ConfigError, match="attn_dropout"):
        tiny_config("tiny-llama", attention="performer", attn_dropout=0.1)


# ---- a decoder LM with attention 'performer' ---------------------------------------------------------------------


def test_performer_decoder_lm_trains() -> None:
    model = make_model(performer_config()).train()
    ids = tokens(4, 24, model.config.vocab_size)
    losses = train_next_token(model, ids, steps=25)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_performer_decoder_is_causal() -> None:
    model = make_model(performer_config())
    ids = tokens(2, 16, model.config.vocab_size)
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3


def left_padding_mask(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):
        mask[b, : 2 * b] = 0
    return mask


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_cached_logits_equal_the_full_forward(padded: bool) -> None:
    """Prefill, then chunks of 3 and single tokens on the KV cache: the logits of one full forward."""
    model = make_model(performer_config())
    ids = tokens(3, 14, model.config.vocab_size)
    mask = left_padding_mask(3, 14) if padded else None
    steps = [(0, 4), (4, 7)] + [(t, t + 1) for t in range(7, 14)]
    cache = model.new_cache(3, 14)
    with torch.no_grad():
        full = model(ids, mask)
        cached = torch.cat(
            [model(ids[:, a:b], None if mask is None else mask[:, :b], cache=cache, start=a) for a, b in steps], 1
        )
    real = torch.ones(3, 14, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(cached[real], full[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "engine_config",
    [
        EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=256),  # paged, whole prompts at once
        EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=8),  # chunked prefill
    ],
    ids=["paged", "chunked-prefill"],
)
def test_engine_greedy_equals_the_uncached_forward(engine_config: EngineConfig) -> None:
    """The engine batches sequences at different lengths (each row's queries at their own slots)."""
    model = make_model(performer_config())
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    results = Engine(model, config=engine_config).generate(prompts, greedy)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(model, prompt, greedy.max_tokens)


def test_a_prefix_lm_is_a_config_error() -> None:
    model = make_model(performer_config())
    with pytest.raises(ConfigError, match="prefix"):
        model(tokens(2, 8, model.config.vocab_size), prefix_lengths=torch.tensor([3, 4]))


def test_bf16_autocast_keeps_the_kernel_in_fp32() -> None:
    q, k, v = qkv(1, 2, 2, 40, 40, 16)
    features = orthogonal_random_features(32, 16, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = favor_attention(q, k, v, features, True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, favor_attention(q, k, v, features, True), rtol=0, atol=0)
