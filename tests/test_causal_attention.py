"""The causal attention kernel for prompt chunks against the softmax formula, where it declines, and in the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import greedy_within_rounding, prompts_of_mixed_lengths

from tformer.engine import packing
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import SamplingParams
from tformer.kernels import causal_attention as module
from tformer.kernels.causal_attention import causal_attention, kernel, lane_width

pytestmark = pytest.mark.skipif(kernel() is None or lane_width() == 0, reason="no C++ compiler or vector lanes")


def formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V in float64, queries at the last T of Tk slots, each seeing keys up to its own."""
    T, Tk = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    visible = torch.ones(T, Tk, dtype=torch.bool).tril(Tk - T)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize(
    "batch, heads, kv_heads, queries, keys, head_dim",
    [
        (1, 9, 3, 100, 100, 64),  # SmolLM2's heads, a whole prompt
        (2, 4, 4, 37, 53, 32),  # a chunk after 16 cached tokens, two rows, no grouping
        (1, 8, 2, 5, 300, 128),  # a short chunk over many keys
        (1, 6, 1, 1, 17, 64),  # one query (multi-query attention)
        (1, 3, 3, 33, 33, 64),  # query blocks of 16 with a remainder
    ],
)
def test_the_kernel_gives_the_formula_within_one_bf16_rounding(
    batch: int, heads: int, kv_heads: int, queries: int, keys: int, head_dim: int
) -> None:
    if head_dim % lane_width():
        pytest.skip(f"head_dim {head_dim} is not a multiple of this build's {lane_width()} lanes")
    generator = torch.Generator().manual_seed(queries)
    q = torch.randn(batch, heads, queries, head_dim, generator=generator).bfloat16()
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=generator).mul(2).bfloat16()
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=generator).bfloat16()
    out = causal_attention(q, k, v)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = formula(q, k, v)
    # the output is rounded to bf16 once (8 bits of mantissa); the sums in between are fp32
    assert ((out.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()


def test_strided_views_read_as_their_values() -> None:
    """The attention layer hands over q, k, v as transposed views of (B, T, H, D) projections."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 20, 6, 64, generator=generator).bfloat16().transpose(1, 2)  # (B, H, T, D), not contiguous
    k = torch.randn(2, 30, 2, 64, generator=generator).bfloat16().transpose(1, 2)
    v = torch.randn(2, 30, 2, 64, generator=generator).bfloat16().transpose(1, 2)
    assert torch.equal(causal_attention(q, k, v), causal_attention(q.contiguous(), k.contiguous(), v.contiguous()))


def test_the_kernel_declines_where_it_does_not_apply() -> None:
    q, k = torch.randn(1, 2, 4, 64).bfloat16(), torch.randn(1, 2, 4, 64).bfloat16()
    assert causal_attention(q.float(), k.float(), k.float()) is None  # fp32 keeps SDPA, exactly as uncached
    assert causal_attention(q, k[:, :, :3], k[:, :, :3]) is None  # more queries than keys
    long = torch.randn(1, 2, module.MAX_KEYS + 1, 64).bfloat16()
    assert causal_attention(q, long, long) is None  # torch's flash kernel is faster there
    odd = torch.randn(1, 2, 4, lane_width() + 1).bfloat16()
    assert causal_attention(odd, odd, odd) is None
    with torch.enable_grad():
        assert causal_attention(q.requires_grad_(), k, k) is None


def test_bad_input_to_the_op_raises_a_value_error() -> None:
    q = torch.randn(1, 4, 8, 64).bfloat16()
    with pytest.raises(ValueError, match="multiple of Hkv"):
        torch.ops.tformer.causal_attention(q, torch.randn(1, 3, 8, 64).bfloat16(), torch.randn(1, 3, 8, 64).bfloat16())
    with pytest.raises(ValueError, match="one shape"):
        torch.ops.tformer.causal_attention(q, torch.randn(1, 2, 8, 64).bfloat16(), torch.randn(1, 2, 9, 64).bfloat16())
    with pytest.raises(ValueError, match="share one dtype"):
        torch.ops.tformer.causal_attention(q, q.float(), q.float())


def test_packed_bf16_steps_attend_through_the_kernel_and_decode_within_rounding(monkeypatch) -> None:
    """A bf16 LLaMA's packed prompt steps (whole prompts and chunks after cached tokens) run the kernel, and every
    request's tokens stay within a bf16 margin of the uncached forward's best logit."""
    calls: list[tuple[int, int]] = []

    def spy(q, k, v):
        out = causal_attention(q, k, v)
        if out is not None:
            calls.append((q.shape[2], k.shape[2]))
        return out

    monkeypatch.setattr(packing, "causal_attention", spy)
    model = make_model(tiny_config("tiny-llama", head_dim=lane_width() * 2, n_heads=4, n_kv_heads=2)).bfloat16()
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=16))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    results = engine.generate(prompts, params)
    assert any(queries == keys for queries, keys in calls) and any(queries < keys for queries, keys in calls)
    for prompt, result in zip(prompts, results, strict=True):
        assert greedy_within_rounding(model, prompt, result.token_ids, margin=0.05)
