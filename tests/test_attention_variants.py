"""The strided and fixed Sparse Transformer (Child et al., 2019) and the elu + 1 Linear Transformer (Katharopoulos
et al., 2020): each against its plain formula, cached against uncached, and a tiny model of each trains."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, tiny_config, tokens, train_next_token
from helpers import prompts_of_mixed_lengths, reference_greedy

from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import SamplingParams
from tformer.errors import ConfigError
from tformer.layers.linear_attention import CHUNK, elu_linear_attention, elu_linear_attention_recurrent
from tformer.layers.sparse_attention import fixed_attention, strided_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def qkv(batch: int, heads: int, kv_heads: int, n_queries: int, n_keys: int, dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n_queries, dim, generator=generator)
    k = torch.randn(batch, kv_heads, n_keys, dim, generator=generator)
    v = torch.randn(batch, kv_heads, n_keys, dim, generator=generator)
    return q, k, v


def padding(batch: int, n_keys: int) -> torch.Tensor:
    """Row b has its first 2 * b keys padded (left padding; row 0 none)."""
    return torch.arange(n_keys)[None] >= 2 * torch.arange(batch)[:, None]


# ---- strided: a dense softmax under the pattern's mask, built by hand --------------------------------------------


def strided_reference(q, k, v, stride, key_padding=None):
    """Dense softmax(q k^T / sqrt(D)) V with the pattern written out pair by pair; queries at the last Tq slots."""
    B, H, Tq, D = q.shape
    n_keys = k.shape[2]
    allowed = torch.zeros(B, Tq, n_keys, dtype=torch.bool)
    for b in range(B):
        for a in range(Tq):
            i = n_keys - Tq + a
            for j in range(i + 1):
                in_pattern = i - j < stride or (i - j) % stride == 0
                allowed[b, a, j] = in_pattern and (key_padding is None or bool(key_padding[b, j]))
    n_rep = H // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed[:, None], -1e30)
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("stride", [1, 3, 5, 40])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("n_queries", [23, 1, 6], ids=["full", "cached step of 1", "cached chunk of 6"])
def test_strided_equals_dense_softmax_under_the_pattern(stride: int, padded: bool, n_queries: int) -> None:
    q, k, v = qkv(3, 4, 2, n_queries, 23)
    key_padding = padding(3, 23) if padded else None
    out = strided_attention(q, k, v, stride, key_padding=key_padding)
    ref = strided_reference(q, k, v, stride, key_padding)
    real = slice(None) if key_padding is None else key_padding[:, -n_queries:]  # a padded query's output is unread
    torch.testing.assert_close(out.transpose(1, 2)[real], ref.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)


def test_strided_queries_at_their_own_slots() -> None:
    """An engine batch: row b's single query sits at slot s_b; keys after it (stale slots) are not its own."""
    q, k, v = qkv(2, 2, 2, 1, 20)
    slots = torch.tensor([[9], [19]])
    out = strided_attention(q, k, v, 4, query_slots=slots)
    for b, s in enumerate((9, 19)):
        ref = strided_reference(q[b : b + 1], k[b : b + 1, :, : s + 1], v[b : b + 1, :, : s + 1], 4)
        torch.testing.assert_close(out[b : b + 1], ref, rtol=1e-5, atol=1e-5)


# ---- fixed: blocks of l keys, the last c of each block seen by every later block -----------------------------------


def fixed_reference(q, k, v, block, summary, key_padding=None):
    """Dense softmax under the fixed pattern written pair by pair from the paper's definition: A1 = {j : floor(j / l)
    = floor(i / l)}, A2 = {j : j mod l in {l - c, ..., l - 1}}, each restricted to j <= i; queries at the last Tq."""
    B, H, Tq, D = q.shape
    n_keys = k.shape[2]
    allowed = torch.zeros(B, Tq, n_keys, dtype=torch.bool)
    for b in range(B):
        for a in range(Tq):
            i = n_keys - Tq + a
            for j in range(i + 1):
                in_pattern = j // block == i // block or j % block >= block - summary
                allowed[b, a, j] = in_pattern and (key_padding is None or bool(key_padding[b, j]))
    n_rep = H // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed[:, None], -1e30)
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize(("block", "summary"), [(1, 1), (4, 1), (5, 2), (6, 6), (40, 3)])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("n_queries", [23, 1, 6], ids=["full", "cached step of 1", "cached chunk of 6"])
def test_fixed_equals_dense_softmax_under_the_pattern(block: int, summary: int, padded: bool, n_queries: int) -> None:
    q, k, v = qkv(3, 4, 2, n_queries, 23)
    key_padding = padding(3, 23) if padded else None
    out = fixed_attention(q, k, v, block, summary, key_padding=key_padding)
    ref = fixed_reference(q, k, v, block, summary, key_padding)
    real = slice(None) if key_padding is None else key_padding[:, -n_queries:]  # a padded query's output is unread
    torch.testing.assert_close(out.transpose(1, 2)[real], ref.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)


def test_fixed_queries_at_their_own_slots() -> None:
    q, k, v = qkv(2, 2, 2, 1, 20)
    slots = torch.tensor([[9], [19]])
    out = fixed_attention(q, k, v, 4, 2, query_slots=slots)
    for b, s in enumerate((9, 19)):
        ref = fixed_reference(q[b : b + 1], k[b : b + 1, :, : s + 1], v[b : b + 1, :, : s + 1], 4, 2)
        torch.testing.assert_close(out[b : b + 1], ref, rtol=1e-5, atol=1e-5)


def test_fixed_pattern_hides_keys_outside_it() -> None:
    """Blocks of 4, the last 1 of each summarizes it: position 11 (block 2) sees 8..11 and 3, 7, not 5 or 6."""
    config = tiny_config("tiny-llama", attention="fixed", sparse_stride=4, sparse_summary=1, n_decoder_layers=1)
    model = make_model(config)
    ids = tokens(1, 12, model.config.vocab_size)
    changed, seen = ids.clone(), ids.clone()
    changed[0, 6] = (changed[0, 6] + 1) % model.config.vocab_size  # block 1, not its last slot
    seen[0, 7] = (seen[0, 7] + 1) % model.config.vocab_size  # block 1's summary slot
    with torch.no_grad():
        base, a, b = model(ids)[0, -1], model(changed)[0, -1], model(seen)[0, -1]
    torch.testing.assert_close(a, base, rtol=0, atol=1e-6)
    assert (b - base).abs().max() > 1e-4


# ---- linear: the quadratic form phi(Q) phi(K)^T V, normalized ----------------------------------------------------


def linear_reference(q, k, v, causal, key_padding=None):
    """(A V) / (A 1) with A = phi(Q) phi(K)^T, phi = elu + 1, masked causally (queries at the last Tq slots)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    scores = phi(q) @ phi(k).transpose(-1, -2)  # (B, H, Tq, Tk)
    n_queries, n_keys = scores.shape[-2:]
    if causal:
        scores = scores * torch.ones(n_queries, n_keys).tril(n_keys - n_queries)
    if key_padding is not None:
        scores = scores * key_padding[:, None, None, :]
    return (scores @ v) / scores.sum(dim=-1, keepdim=True)


N = 2 * CHUNK + 22  # two whole chunks and a partial one
SHAPES = {"T=1": (1, 1), "chunks and a part": (N, N), "cached step of 1": (1, N), "cached chunk": (CHUNK + 12, N)}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_equals_the_quadratic_form(shape: str, causal: bool, padded: bool) -> None:
    n_queries, n_keys = SHAPES[shape]
    q, k, v = qkv(3, 4, 2, n_queries, n_keys, dim=16)
    key_padding = padding(3, n_keys) if padded and n_keys > 4 else None
    out = elu_linear_attention(q, k, v, causal, key_padding)
    ref = linear_reference(q.double(), k.double(), v.double(), causal, key_padding).float()
    real = slice(None) if key_padding is None else key_padding[:, -n_queries:]  # a query with no real key: 0
    torch.testing.assert_close(out.transpose(1, 2)[real], ref.transpose(1, 2)[real], rtol=1e-4, atol=1e-5)


def test_linear_recurrent_form_equals_the_parallel_form() -> None:
    q, k, v = qkv(2, 3, 3, 2 * CHUNK + 5, 2 * CHUNK + 5, dim=8)
    parallel = elu_linear_attention(q, k, v, causal=True)
    torch.testing.assert_close(elu_linear_attention_recurrent(q, k, v), parallel, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parallel, linear_reference(q, k, v, causal=True), rtol=1e-4, atol=1e-5)


# ---- models: cached equals uncached, the engine, training --------------------------------------------------------


def variant_config(attention: str):
    return tiny_config("tiny-llama", attention=attention, sparse_stride=3, sparse_summary=2)


@pytest.mark.parametrize("attention", ["strided", "fixed", "linear"])
def test_cached_logits_equal_the_full_forward(attention: str) -> None:
    """Prefill, then a chunk of 3 and single tokens on the KV cache: the logits of one full forward."""
    model = make_model(variant_config(attention))
    ids = tokens(3, 14, model.config.vocab_size)
    steps = [(0, 4), (4, 7)] + [(t, t + 1) for t in range(7, 14)]
    cache = model.new_cache(3, 14)
    with torch.no_grad():
        full = model(ids)
        cached = torch.cat([model(ids[:, a:b], cache=cache, start=a) for a, b in steps], 1)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ["strided", "fixed", "linear"])
def test_engine_greedy_equals_the_uncached_forward(attention: str) -> None:
    """The engine's paged cache with chunked prefill: each row's queries at their own slots."""
    model = make_model(variant_config(attention))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    config = EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=8)
    results = Engine(model, config=config).generate(prompts, greedy)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(model, prompt, greedy.max_tokens)


def test_strided_pattern_hides_keys_outside_it() -> None:
    """Changing a token the last position's pattern skips (distance 4, stride 3) leaves a 1-layer model's logit."""
    model = make_model(tiny_config("tiny-llama", attention="strided", sparse_stride=3, n_decoder_layers=1))
    ids = tokens(1, 12, model.config.vocab_size)
    changed, seen = ids.clone(), ids.clone()
    changed[0, 7] = (changed[0, 7] + 1) % model.config.vocab_size  # 11 - 7 = 4: outside both parts
    seen[0, 5] = (seen[0, 5] + 1) % model.config.vocab_size  # 11 - 5 = 6: a multiple of 3
    with torch.no_grad():
        base, a, b = model(ids)[0, -1], model(changed)[0, -1], model(seen)[0, -1]
    torch.testing.assert_close(a, base, rtol=0, atol=1e-6)
    assert (b - base).abs().max() > 1e-4


@pytest.mark.parametrize("attention", ["strided", "fixed", "linear"])
def test_tiny_model_trains(attention: str) -> None:
    model = make_model(variant_config(attention)).train()
    ids = tokens(4, 24, model.config.vocab_size)
    losses = train_next_token(model, ids, steps=25)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.6 * losses[0], losses


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="family 'decoder'"):
        tiny_config("tiny-bert", attention="strided")
    with pytest.raises(ConfigError, match="sparse_stride"):
        tiny_config("tiny-llama", attention="strided", sparse_stride=0)
    with pytest.raises(ConfigError, match="attention 'fixed' .* family 'decoder'"):
        tiny_config("tiny-bert", attention="fixed")
    with pytest.raises(ConfigError, match="1 <= sparse_summary <= sparse_stride"):
        tiny_config("tiny-llama", attention="fixed", sparse_stride=4, sparse_summary=5)
    with pytest.raises(ConfigError, match="ALiBi"):
        tiny_config("tiny-llama", attention="linear", position="alibi")
    with pytest.raises(ConfigError, match="attn_dropout"):
        tiny_config("tiny-llama", attention="linear", attn_dropout=0.1)
