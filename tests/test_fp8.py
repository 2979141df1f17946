"""FP8 (e4m3) weights against torch's float8 conversion, the plain formula, the float layer and the uncached forward."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import greedy_within_rounding
from torch import nn

from tformer.kernels.fp8 import Fp8Linear, e4m3_bits_as, fp8_matmul, to_e4m3
from tformer.kernels.quantize import dequantize_linear, model_bytes, set_precision

ALL_BYTES = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
FINITE = ~ALL_BYTES.float().isnan()  # e4m3fn has no infinities; bytes 0x7f and 0xff are NaN


@pytest.mark.parametrize("dtype, factor", [(torch.float16, 2.0**8), (torch.bfloat16, 2.0**120)])
def test_every_e4m3_byte_becomes_the_16_bit_float_torch_converts_it_to(dtype: torch.dtype, factor: float) -> None:
    converted = e4m3_bits_as(ALL_BYTES, dtype).float() * factor
    assert torch.equal(converted[FINITE], ALL_BYTES.float()[FINITE])  # subnormals and -0 included


def test_to_e4m3_rounds_to_the_nearest_normal_e4m3_or_zero_and_round_trips() -> None:
    normal_or_zero = ALL_BYTES.float()[FINITE]
    normal_or_zero = normal_or_zero[(normal_or_zero.abs() >= 2.0**-6) | (normal_or_zero == 0)].unique()
    values = torch.cat([torch.randn(2000) * 40, torch.randn(500) * 0.02, torch.tensor([448.0, -448.0, 0.0])])
    rounded = to_e4m3(values).float()
    assert set(rounded.unique().tolist()) <= set(normal_or_zero.tolist())
    nearest = (values[:, None] - normal_or_zero[None]).abs().amin(1)  # brute force over every candidate
    torch.testing.assert_close((values - rounded).abs(), nearest, atol=0, rtol=0)
    assert torch.equal(to_e4m3(normal_or_zero).float(), normal_or_zero)  # representable values stay as they are


@pytest.mark.parametrize("rows", [1, 5])  # one row multiplies in fp16, more rows in bf16
def test_fp8_linear_matches_the_dequantized_formula_and_stays_near_the_float_layer(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    layer = Fp8Linear(linear)
    scales = linear.weight.detach().abs().amax(1) / 448
    assert torch.equal(layer.scales, scales) and layer.qweight.dtype == torch.float8_e4m3fn
    expected_weight = to_e4m3(linear.weight.detach() / scales[:, None]).float() * scales[:, None]
    assert torch.equal(layer.dequantized(), expected_weight) and torch.equal(dequantize_linear(layer), expected_weight)
    x = torch.randn(rows, 96) * torch.logspace(-3, 3, rows)[:, None]  # rows of very different sizes
    with torch.no_grad():
        out, formula, float_out = layer(x), x @ expected_weight.T + linear.bias, linear(x)
    row_max = (formula - linear.bias).abs().amax(-1, keepdim=True)  # the largest product of each row
    # x and the products rounded to fp16 (1 row: 11 bits, seen up to 2^-11.2 of the row's largest product) or
    # bf16 (5 rows: 8 bits, seen up to 2^-7.9), with a factor of 2 to spare
    assert ((out - formula).abs() <= row_max * (2.0**-10 if rows == 1 else 2.0**-7)).all()
    # e4m3 keeps 3 mantissa bits, each weight within 2^-4 of itself: seen up to 0.035 of the row's largest product
    assert ((float_out - formula).abs() <= row_max * 2.0**-4).all()


def test_a_cast_model_keeps_the_e4m3_weight_and_fp32_scales() -> None:
    layer = Fp8Linear(nn.Linear(64, 32))
    x = torch.randn(3, 64)
    expected = layer(x.bfloat16().float())
    layer.to(torch.bfloat16)  # Module.to casts float8 tensors too, unless the layer keeps them
    assert layer.qweight.dtype == torch.float8_e4m3fn and layer.scales.dtype == torch.float32
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=expected.abs().max().item() / 64, rtol=0)


def test_the_reused_buffer_serves_calls_in_and_out_of_inference_mode() -> None:
    """The engine runs under inference_mode and the perplexity forward does not: a buffer made in the first
    must still be writable in the second (a new thread starts without a buffer)."""
    layer = Fp8Linear(nn.Linear(64, 32))
    x = torch.randn(3, 64)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            inside = layer(x)
        return inside, layer(x)

    inside, outside = ThreadPoolExecutor(1).submit(both).result()
    assert torch.equal(inside, outside)


def test_the_matmul_is_one_op_for_torch_compile() -> None:
    layer = Fp8Linear(nn.Linear(64, 48))
    compiled = torch.compile(layer, fullgraph=True, backend="eager")  # fullgraph: a graph break would raise
    for rows in (1, 4):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(compiled(x), layer(x))
    torch.library.opcheck(fp8_matmul, (torch.randn(3, 64), layer.qweight, layer.scales), test_utils="test_faketensor")


def test_set_precision_fp8_replaces_every_linear_and_shrinks_the_model() -> None:
    from tformer.models.base import CheckpointError

    model = make_model(tiny_config("tiny-llama", d_model=64, n_heads=4, n_kv_heads=2, d_ff=128))
    before = model_bytes(model)
    set_precision(model, "auto", "fp8")
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 2 * 4 + 1  # qkv, out, gate_up, down; the head
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert next(model.parameters()).dtype == torch.bfloat16  # auto: bf16 activations, as for int8
    assert model_bytes(model) < before / 2
    with pytest.raises(CheckpointError):
        model.save("unused")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_serves_a_fp8_model_like_its_uncached_forward(dtype: str) -> None:
    """Decode steps of one row multiply in fp16, prefill and the uncached forward in bf16: greedy tokens up to
    two bf16 steps at the largest logit, as for the other 16-bit paths."""
    from tformer.engine import Engine, EngineConfig, SamplingParams

    model = set_precision(make_model(tiny_config("tiny-llama", vocab_size=96)), dtype, "fp8")
    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(1, 18))]
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=32))
    results = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    single = engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))[0]  # one-row steps
    with torch.no_grad():
        largest = max(model(torch.tensor([p])).abs().max().item() for p in prompts)
    margin = 2 * 2.0 ** (math.floor(math.log2(largest)) - 7)
    for result, prompt in [*zip(results, prompts, strict=True), (single, prompts[0])]:
        assert len(result.token_ids) == 8 and greedy_within_rounding(model, prompt, result.token_ids, margin)
