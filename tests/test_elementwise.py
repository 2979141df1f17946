"""The fused elementwise kernels (RMSNorm, rotary, SiLU-gated product) against torch's formula they replace: on
strided inputs as the layers pass them, at the edges of SiLU's exponential, where they must not apply, on bad
input, and in a whole model and a served engine."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, tiny_config
from helpers import greedy_within_rounding

from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.kernels import elementwise
from tformer.kernels.quantize import set_precision
from tformer.layers.attention import Attention
from tformer.layers.ffn import GatedMLP
from tformer.layers.norms import RMSNorm
from tformer.layers.positions import apply_rotary

pytestmark = pytest.mark.skipif(elementwise.kernel() is None, reason="no C++ compiler to build the kernels with")

BF16_STEP = 2**-7  # bfloat16's spacing relative to a value: one rounding step


def rotary_angles(batch: int, length: int, head_dim: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, start + length)[None].expand(batch, length)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("batch,length", [(3, 128), (1, 1), (2, 37)])
def test_rotary_equals_the_formula_exactly(batch: int, length: int) -> None:
    """q and k as attention passes them (views of one projection's output, heads then tokens): every element
    equal, in the layout torch's ops give (tokens outermost after the batch); one angle row shared across a batch
    too."""
    torch.manual_seed(0)
    qkv = (torch.randn(batch, length, (9 + 3 + 3) * 64) * 4).bfloat16()
    q = qkv[..., : 9 * 64].view(batch, length, 9, 64).transpose(1, 2)
    k = qkv[..., 9 * 64 : 12 * 64].view(batch, length, 3, 64).transpose(1, 2)
    angles = rotary_angles(batch, length, 64, start=1000)
    for x in (q, k):
        out = elementwise.rotary(x, angles)
        expected = apply_rotary(x, angles)
        assert torch.equal(out, expected)
        assert out.transpose(1, 2).is_contiguous() and expected.transpose(1, 2).is_contiguous()
    shared = tuple(a[:1] for a in angles)
    assert torch.equal(elementwise.rotary(q, shared), apply_rotary(q, shared))


@pytest.mark.parametrize("dim", [576, 37])
def test_rms_norm_is_within_one_rounding_of_the_formula(dim: int) -> None:
    """The kernel sums a row's squares in another order than torch, so a value at a rounding boundary may land
    one bfloat16 step away; every other value is equal. 37: rows that end past the last 16 lanes."""
    torch.manual_seed(0)
    norm = RMSNorm(dim, eps=1e-5)
    norm.weight.data = torch.randn(dim)
    norm = norm.bfloat16()
    x = (torch.randn(4, 97, dim) * torch.logspace(-3, 3, 97)[:, None]).bfloat16()
    with torch.inference_mode():
        expected = norm(x)
        out = elementwise.rms_norm(x, norm.weight, norm.eps)
    assert out is not None and out.shape == x.shape
    assert (out != expected).float().mean() < 1e-3
    torch.testing.assert_close(out.float(), expected.float(), rtol=BF16_STEP, atol=0)


def test_silu_mul_is_within_one_rounding_of_the_formula() -> None:
    """gate and up as a fused projection gives them (the two halves of one output); SiLU's exponential is a
    polynomial within 2 ulp of exact, so a value at a rounding boundary may land one bfloat16 step away."""
    torch.manual_seed(0)
    gate, up = (torch.randn(5, 33, 2 * 1541) * 6).bfloat16().chunk(2, dim=-1)  # 1541: a tail past the lanes
    out = elementwise.silu_mul(gate, up)
    expected = F.silu(gate) * up
    assert (out != expected).float().mean() < 1e-3
    torch.testing.assert_close(out.float(), expected.float(), rtol=BF16_STEP, atol=0)


def test_silu_mul_at_the_edges_of_the_exponential() -> None:
    """Large and tiny gates, zero, infinities and NaN: the values torch gives, up to one bfloat16 step, and
    0 for gates so negative that e^-gate overflows (where torch's quotient is -0)."""
    gate = torch.tensor([[-1e4, -100.0, -88.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 5.0, 20.0, 88.0, 100.0, 1e4]])
    gate = gate.bfloat16()
    up = torch.ones_like(gate)
    out = elementwise.silu_mul(gate, up)
    torch.testing.assert_close(out.float(), (F.silu(gate) * up).float(), rtol=BF16_STEP, atol=1e-30)
    special = torch.tensor([[float("inf"), float("nan")]]).bfloat16()
    assert elementwise.silu_mul(special, torch.ones_like(special)).float().tolist()[0][0] == float("inf")
    assert elementwise.silu_mul(special, torch.ones_like(special)).float().isnan().tolist() == [[False, True]]


def test_the_kernels_decline_where_they_do_not_apply() -> None:
    """float32, gradients, torch.compile and a build without SiLU's vector lanes keep the formula (None), and the
    layers then compute it."""
    x = torch.randn(2, 8, 64)
    weight = torch.ones(64)
    assert elementwise.rms_norm(x, weight, 1e-5) is None  # float32
    trained = x.bfloat16().requires_grad_()
    assert elementwise.rms_norm(trained, weight.bfloat16(), 1e-5) is None
    with torch.no_grad():
        assert elementwise.rms_norm(trained, weight.bfloat16(), 1e-5) is not None
    gate = torch.randn(2, 8, 64).bfloat16()
    assert elementwise.silu_mul(gate, gate[..., :32]) is None  # shapes differ
    assert elementwise.instructions() in ("AVX-512", "AVX2", "portable")
    with mock.patch.object(elementwise, "_silu_vectorized", lambda: False):  # a build with the scalar loop alone
        assert elementwise.silu_mul(gate, gate) is None
    q = gate.view(2, 8, 4, 16).transpose(1, 2)
    wrong = tuple(a[:, :5] for a in rotary_angles(2, 8, 16))  # angles for 5 tokens, not 8
    assert elementwise.rotary(q, wrong) is None

    graphs = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(graph)
        return graph

    norm = RMSNorm(64).bfloat16()
    norm.fused = elementwise.rms_norm
    compiled = torch.compile(norm, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(gate), RMSNorm(64).bfloat16()(gate), rtol=0, atol=0)
    targets = [str(node.target) for node in graphs[0].graph.nodes]
    assert not any("tformer" in target for target in targets) and any("rsqrt" in target for target in targets)


def test_the_ops_reject_bad_input_with_a_message() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        torch.ops.tformer.rms_norm(x, torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="D even"):
        torch.ops.tformer.rotary(torch.zeros(1, 2, 3, 5).bfloat16(), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match="rows contiguous"):
        torch.ops.tformer.silu_mul(x.bfloat16().T, x.bfloat16().T)


def test_a_served_model_uses_them_and_stays_near_its_formula() -> None:
    """set_precision hands the kernels to every RMSNorm, rotary attention and SwiGLU MLP. A bf16 model's logits
    with them stay within two bf16 steps of its largest logit from the same model on its formula, and the
    engine's greedy tokens score within that margin of the best of the uncached forward (two paths of different
    shapes round differently in bf16)."""
    model = set_precision(make_model(tiny_config("tiny-llama", vocab_size=96)), "bfloat16")
    modules = [m for m in model.modules() if isinstance(m, (RMSNorm, Attention, GatedMLP))]
    hooks = {
        type(m): getattr(m, {RMSNorm: "fused", Attention: "fused_rotary", GatedMLP: "fused_gate"}[type(m)])
        for m in modules
    }
    assert hooks == {RMSNorm: elementwise.rms_norm, Attention: elementwise.rotary, GatedMLP: elementwise.silu_mul}
    ids = torch.randint(1, 96, (3, 40))
    with torch.inference_mode():
        fused = model(ids).float()
        with mock.patch.object(elementwise, "_applies", lambda *tensors: False):
            plain = model(ids).float()
    margin = 2 * 2.0 ** (math.floor(math.log2(plain.abs().max().item())) - 7)
    assert (fused - plain).abs().max() <= margin

    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(1, 18))]
    results = Engine(model, config=EngineConfig(block_size=4, num_blocks=32)).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0)
    )
    for result, prompt in zip(results, prompts, strict=True):
        assert len(result.token_ids) == 8 and greedy_within_rounding(model, prompt, result.token_ids, margin)
