"""Long inputs: chunked attention equals the dense masked reference, its memory grows linearly with length, and
positions past max_seq_len extend (sinusoidal) or fail clearly (learned)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_config, tokens

from tformer.errors import RequestError
from tformer.layers import attention, masks
from tformer.layers.attention import causal_suffix_attention, chunked_attention, long_attention, math_attention
from tformer.layers.masks import AttentionMask
from tformer.layers.positions import ALiBiPositions, sinusoidal_table
from tformer.training.memory import LiveTensorTracker

CPU = torch.device("cpu")


def _mask(name: str, n_queries: int, n_keys: int) -> AttentionMask:
    """One kind of mask over a batch of 2 rows."""
    padding = torch.ones(2, n_keys, dtype=torch.bool)
    padding[0, :3] = False  # left padding in row 0
    padding[1, -4:] = False  # right padding in row 1
    positions = torch.arange(n_keys)[None]
    alibi = ALiBiPositions(tiny_config(position="alibi", n_heads=4))
    cases = {
        "encoder padding": dict(is_causal=False, key_padding=padding),
        "causal padding": dict(is_causal=True, key_padding=padding),
        "causal over a cache": dict(is_causal=True),
        "alibi": dict(
            is_causal=True,
            position_bias=alibi.attention_bias,
            query_positions=positions[:, n_keys - n_queries :],
            key_positions=positions,
        ),
        "window": dict(is_causal=True, window=5),
        "window and padding": dict(is_causal=True, window=4, key_padding=padding),
        "prefix": dict(is_causal=True, prefix_lengths=torch.tensor([6, 0])),
        "engine slots": dict(is_causal=True, query_slots=torch.tensor([[3, 9, 12, 2], [0, 1, 2, 3]])[:, :n_queries]),
    }
    return AttentionMask(**cases[name])


def _seen_rows(mask: AttentionMask, n_queries: int, n_keys: int) -> torch.Tensor:
    """(B|1, 1, Tq) True for queries that may attend to at least one key (fully masked rows are padding)."""
    bias = mask.bias_block(0, n_queries, 0, n_keys, n_queries, n_keys, torch.float32, CPU)
    return (bias > torch.finfo(torch.float32).min).any(-1)[:, :1]


@pytest.mark.parametrize(
    "name",
    [
        "encoder padding",
        "causal padding",
        "causal over a cache",
        "alibi",
        "window",
        "window and padding",
        "prefix",
        "engine slots",
    ],
)
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_chunked_attention_equals_the_dense_reference(
    name: str, n_kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 4 queries: output and gradients within 1e-5 of softmax(QK^T/sqrt(d) + dense bias) V (fp32)."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 4)
    n_keys = 14
    n_queries = 4 if name == "engine slots" else (6 if name == "causal over a cache" else n_keys)
    mask = _mask(name, n_queries, n_keys)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, n_queries, 8, generator=generator, requires_grad=True)
    k = torch.randn(2, n_kv_heads, n_keys, 8, generator=generator, requires_grad=True)
    v = torch.randn(2, n_kv_heads, n_keys, 8, generator=generator, requires_grad=True)
    grad_out = torch.randn(2, 4, n_queries, 8, generator=generator)
    seen = _seen_rows(mask, n_queries, n_keys)[..., None].float()  # compare the rows that attend to something
    dense = math_attention(q, k, v, mask, 0.0)[0]
    chunked = chunked_attention(q, k, v, mask, 0.0)
    torch.testing.assert_close(chunked * seen, dense * seen, atol=1e-5, rtol=1e-5)
    expected = torch.autograd.grad(dense, (q, k, v), grad_out * seen)
    actual = torch.autograd.grad(chunked, (q, k, v), grad_out * seen)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(chunked).all()


@pytest.mark.parametrize("n_queries", [1, 5, 13])
@pytest.mark.parametrize("n_kv_heads", [6, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_suffix_attention_equals_the_dense_reference(
    n_queries: int, n_kv_heads: int, dtype: torch.dtype
) -> None:
    """Queries at the last slots of 14 keys (a prompt's later chunk), without a bias: within 1e-5 of
    softmax(QK^T/sqrt(d) + causal bias) V in fp32, within bf16's rounding (2^-7 of the largest output) in bf16;
    `long_attention` takes this path for such a mask when no gradient is needed, and the blocks otherwise."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, n_queries, 16, generator=generator)
    k = torch.randn(2, n_kv_heads, 14, 16, generator=generator) * 3  # peaked softmaxes as well as flat ones
    v = torch.randn(2, n_kv_heads, 14, 16, generator=generator)
    mask = AttentionMask(is_causal=True)
    assert mask.causal_suffix()
    expected = math_attention(q, k, v, mask, 0.0)[0]
    out = causal_suffix_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7 * expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0)
    with torch.no_grad():
        assert torch.equal(long_attention(q, k, v, mask, 0.0), causal_suffix_attention(q, k, v))
    q.requires_grad_(True)
    torch.testing.assert_close(long_attention(q, k, v, mask, 0.0), expected, atol=1e-5, rtol=1e-5)


MODEL_CASES = {  # preset, config overrides, left padding too (right padding alone takes SDPA's causal kernel)
    "decoder, alibi, window, padding": ("tiny-llama", dict(position="alibi", sliding_window=24), False),
    "decoder, rope, right padding": ("tiny-llama", {}, False),
    "decoder, rope, left padding": ("tiny-llama", {}, True),
    "encoder, learned, padding": ("tiny-bert", {}, True),
    "encoder-decoder, sinusoidal": ("tiny-transformer", {}, False),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_a_model_gives_the_same_outputs_with_chunked_attention(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model with the dense bias (short inputs) and with blocks of 16 queries agree within 1e-5."""
    preset, overrides, left_padding = MODEL_CASES[case]
    model = make_model(tiny_config(preset, max_seq_len=64, **overrides))
    ids = tokens(2, 40, model.config.vocab_size)
    padding = torch.ones(2, 40, dtype=torch.long)
    padding[1, 33:] = 0
    if left_padding:
        padding[0, :5] = 0
    args = (ids, ids[:, :30], padding, padding[:, :30]) if model.config.family == "encoder-decoder" else (ids, padding)
    with torch.no_grad():
        dense = model(*args)
        monkeypatch.setattr(masks, "DENSE_BIAS_MAX_ENTRIES", 0)
        monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
        chunked = model(*args)
    real = padding[:, : dense.shape[1], None].bool()
    torch.testing.assert_close(chunked * real, dense * real, atol=1e-5, rtol=1e-5)


def _training_peak(model: torch.nn.Module, length: int) -> int:
    """Live-tensor peak (bytes) of forward + backward on 2 padded rows of `length` tokens, weights excluded."""
    ids = tokens(2, length, model.config.vocab_size)
    padding = torch.ones(2, length, dtype=torch.long)
    padding[1, length // 2 :] = 0
    with LiveTensorTracker() as tracker:
        model(ids, padding).float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak


@pytest.mark.parametrize("position", ["alibi", "rope"])
def test_training_memory_grows_linearly_with_length(position: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Doubling the length of a padded (and ALiBi) batch about doubles the training peak with chunked attention,
    while the dense bias makes it grow faster (the control, which shows the measurement can tell them apart)."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 64)
    config = tiny_config("tiny-llama", position=position, max_seq_len=1024, vocab_size=64, sliding_window=None)
    model = make_model(config).train()
    monkeypatch.setattr(masks, "DENSE_BIAS_MAX_ENTRIES", 0)
    chunked = [_training_peak(model, n) for n in (512, 1024)]
    monkeypatch.setattr(masks, "DENSE_BIAS_MAX_ENTRIES", 1024 * 1024)
    dense = [_training_peak(model, n) for n in (512, 1024)]
    assert chunked[1] / chunked[0] < 2.1, chunked  # measured 1.99 for both schemes
    assert dense[1] / dense[0] > 2.3, dense  # measured 2.47 (RoPE: one mask) and 3.98 (ALiBi: one per head)
    assert chunked[1] < dense[1]


def test_sinusoidal_positions_extend_past_max_seq_len() -> None:
    model = make_model(tiny_config("tiny-transformer", max_seq_len=16))
    positions = torch.arange(40)[None]
    expected = sinusoidal_table(40, model.config.d_model)[None]
    torch.testing.assert_close(model.encoder.positions.embed(positions), expected)
    with torch.no_grad():
        logits = model(tokens(1, 40, model.config.vocab_size), tokens(1, 30, model.config.vocab_size))
    assert torch.isfinite(logits).all()


def test_learned_positions_past_max_seq_len_say_what_to_do() -> None:
    model = make_model(tiny_config("tiny-gpt2", max_seq_len=16))
    with pytest.raises(RequestError, match="max_seq_len 16.*at most 16 tokens.*'sinusoidal'"):
        model(tokens(1, 17, model.config.vocab_size))
