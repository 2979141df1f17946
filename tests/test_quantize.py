"""Quantized layers against the plain formulas, and quantized models against their float originals."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import greedy_within_rounding, reference_greedy
from torch import nn

from tformer.kernels.quantize import Int4Linear, Int8Linear, RowsEmbedding, W8A8Linear, model_bytes, quantize

QUANTIZED = (Int8Linear, Int4Linear, W8A8Linear)


def test_int8_matches_per_channel_formula() -> None:
    """The weights are the per-channel formula's; each token's activations are rounded in two int8 steps, so each
    output may move by half a step, max|x| / (2 * 127 * 254), times the row's absolute weights (fp32 rounding aside)."""
    linear = nn.Linear(64, 48)
    layer = Int8Linear(linear)
    weight = linear.weight.detach()
    scales = weight.abs().amax(1) / 127
    expected_weight = torch.round(weight / scales[:, None]).clamp(-128, 127) * scales[:, None]
    torch.testing.assert_close(layer.dequantized(), expected_weight, atol=0, rtol=1e-6)
    assert (layer.dequantized() - weight).abs().max() <= scales.max() / 2 + 1e-7  # rounding error bound
    x = torch.randn(3, 5, 64)
    out = layer(x)
    expected = x.double() @ expected_weight.double().T + linear.bias.double()
    half_step = x.abs().amax(-1, keepdim=True).double() / (2 * 127 * 254)
    bound = half_step * expected_weight.abs().sum(1).double() + 1e-5
    assert ((out.double() - expected).abs() <= bound).all()
    assert (out.double() - expected).abs().max() > 1e-7  # the activations were rounded: the bound is the one in use


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_matches_grouped_formula(group_size: int) -> None:
    """Weights w = q * scale + minimum per group, scales and minimums kept in fp16; the activations of each block
    of 32 rounded to two int8 steps of max |x| / 127 and 1/254 of that (tests/test_int4.py checks the rounding)."""
    linear = nn.Linear(128, 48, bias=False)
    layer = Int4Linear(linear, group_size)
    groups = linear.weight.detach().view(48, -1, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / 15
    q = torch.round((groups - low) / scale).clamp(0, 15)
    expected_weight = (q * scale.half().float() + low.half().float()).view(48, 128)
    torch.testing.assert_close(layer.dequantized(), expected_weight, atol=1e-6, rtol=1e-6)
    assert (expected_weight - linear.weight).abs().max() <= scale.max() / 2 + (high - low).abs().max() / 1000
    x = torch.randn(7, 128)
    blocks = x.view(7, 4, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(largest, 127).div(largest)  # as the kernel rounds (`127 / t` is 127 * (1 / t))
    scaled = blocks * inverse
    coarse = torch.round(scaled)
    rounded = ((coarse + torch.round((scaled - coarse) * 254) / 254) * (largest / 127)).view(7, 128)  # as sums read x
    sums = blocks.sum(-1)  # the minimums multiply the float activations' sums
    q_part = (rounded.double() @ (q * scale.half().float()).view(48, 128).double().T).float()
    min_part = sums @ low.half().float().view(48, -1).repeat_interleave(group_size // 32, 1).T
    torch.testing.assert_close(layer(x), q_part + min_part, atol=1e-4, rtol=1e-4)


def test_w8a8_matches_per_token_formula_and_ignores_the_other_rows() -> None:
    """Weights as INT8 (clamped to +-127); each row x of the input rounded to q = round(x * 127 / max|x|):
    y = (q_x q_w^T) * max|x| / 127 * s_w + b."""
    linear = nn.Linear(128, 48)
    layer = W8A8Linear(linear)
    weight = linear.weight.detach()
    scales = weight.abs().amax(1) / 127
    q_weight = torch.round(weight / scales[:, None]).clamp(-127, 127)
    x = torch.randn(6, 128) * torch.logspace(-2, 2, 6)[:, None]  # rows of very different sizes
    row_scale = x.abs().amax(1, keepdim=True)
    q_x = torch.round(x * torch.full_like(row_scale, 127).div(row_scale))  # as the kernel rounds: 127 / max, then x
    expected = (q_x @ q_weight.T) * (row_scale / 127) * scales + linear.bias
    out = layer(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.dequantized(), q_weight * scales[:, None])
    for rows in (slice(0, 1), slice(2, 5), slice(5, 6)):  # per-token scales: a row's result is its own
        assert torch.equal(layer(x[rows]), out[rows])
    reference = layer(x.bfloat16().float())
    bf16 = layer.to(torch.bfloat16)(x.bfloat16())  # the output and the bias are rounded; the scales stay fp32
    assert bf16.dtype == torch.bfloat16 and layer.scales.dtype == torch.float32
    torch.testing.assert_close(bf16.float(), reference, atol=reference.abs().max().item() / 128, rtol=0)


def test_w8a8_copy_keeps_its_weight_after_the_original_is_gone() -> None:
    import copy
    import gc

    layer = W8A8Linear(nn.Linear(64, 32))
    x = torch.randn(3, 64)
    expected = layer(x)
    clone = copy.deepcopy(layer)
    del layer
    gc.collect()
    assert torch.equal(clone(x), expected)


@pytest.mark.parametrize("mode, budget", [("int8", 0.30), ("int4", 0.20), ("w8a8", 0.30)])
def test_quantized_model_stays_close_and_shrinks(mode: str, budget: float) -> None:
    model = make_model(tiny_config("tiny-llama", d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=96))
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        reference = torch.softmax(model(ids), -1)
        before = model_bytes(model)
        quantize(model, mode, group_size=32)
        quantized = torch.softmax(model(ids), -1)
    n_linear = sum(isinstance(m, QUANTIZED) for m in model.modules())
    assert n_linear == 2 * 4 + 2 * 3 + 1  # q, k, v, out and gate, up, down per layer, plus the head
    assert model_bytes(model) < before
    assert (quantized - reference).abs().sum(-1).max() < budget  # total variation distance per position


def test_int4_models_head_is_int8_with_two_step_activations() -> None:
    """The two-step activation rounding adds under 2% of the INT8 weights' own error to the logits (one step: about
    as much again)."""
    model = make_model(tiny_config("tiny-llama", d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=96))
    head = model.lm_head
    x = torch.randn(3, 64)
    with torch.no_grad():
        float_logits = head(x).double()
        quantize(model, "int4")
        assert isinstance(model.lm_head, Int8Linear) and model.lm_head.fine
        logits = model.lm_head(x).double()
        weight_only = x.double() @ model.lm_head.dequantized().double().T  # INT8 weights, float activations
    assert (logits - weight_only).abs().max() < 0.02 * (float_logits - weight_only).abs().max()


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="int8, int4"):
        quantize(make_model(tiny_config("tiny-llama")), "int3")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_bf16_activations_match_the_formula_in_float32(mode: str) -> None:
    """The packed kernels' fast case: bf16 activations and scales. Reference: x @ W_deq^T in fp32, where W_deq
    is the weight the layer stands for with its scales rounded to bf16; the output's rounding to bf16 remains."""
    linear = nn.Linear(128, 64, bias=False)
    layer = (Int8Linear(linear) if mode == "int8" else Int4Linear(linear, 32)).to(torch.bfloat16)
    x = torch.randn(5, 128).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    expected = x.float() @ layer.dequantized().float().T
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
    assert (out.float() - expected).abs().max() <= expected.abs().max() / 64  # a few bf16 ulps, not a wrong weight


@pytest.mark.parametrize(
    "mode, dtype",
    [
        ("int8", "float32"),
        ("int4", "float32"),
        ("int8", "bfloat16"),
        ("int4", "bfloat16"),
        ("w8a8", "float32"),
        ("w8a8", "bfloat16"),
    ],
)
def test_engine_serves_a_quantized_model_like_its_uncached_forward(mode: str, dtype: str) -> None:
    from tformer.engine import Engine, EngineConfig, SamplingParams

    model = quantize(make_model(tiny_config("tiny-llama", vocab_size=96)), mode, group_size=32)
    model.to(getattr(torch, dtype))
    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(1, 18))]
    results = Engine(model, config=EngineConfig(block_size=4, num_blocks=32)).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0)
    )
    if dtype == "float32":  # fp32 paths stay exact
        assert [r.token_ids for r in results] == [reference_greedy(model, p, 8) for p in prompts]
        return
    # bf16: the cached and uncached forwards round differently; two bf16 steps at the largest logit
    with torch.no_grad():
        largest = max(model(torch.tensor([p])).abs().max().item() for p in prompts)
    margin = 2 * 2.0 ** (math.floor(math.log2(largest)) - 7)
    for result, prompt in zip(results, prompts, strict=True):
        assert len(result.token_ids) == 8 and greedy_within_rounding(model, prompt, result.token_ids, margin)


def test_set_precision_casts_or_quantizes_and_refuses_bad_choices() -> None:
    from tformer import ModelConfig, build_model
    from tformer.config import ConfigError
    from tformer.kernels.quantize import Int8Linear, set_precision

    model = build_model(ModelConfig.from_preset("tiny-llama"))
    assert {p.dtype for p in set_precision(model, "bfloat16").parameters()} == {torch.bfloat16}
    model = build_model(ModelConfig.from_preset("tiny-llama"))
    assert any(isinstance(m, Int8Linear) for m in set_precision(model, "float32", "int8").modules())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model = make_model(tiny_config("tiny-llama", d_model=64, n_heads=4, n_kv_heads=2, d_ff=128))
    weight = model.decoder.layers[0].ffn.down_proj.weight.detach().clone()
    set_precision(model, "auto", "int4")  # auto: bf16 activations for the packed kernels' fast path
    down = model.decoder.layers[0].ffn.down_proj  # gate and up are fused
    assert isinstance(down, Int4Linear) and down.packed.dtype == torch.uint8  # the cast leaves it as it is
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert (down.dequantized().float() - weight).abs().max() < (weight.abs().max() / 8)  # quantized from fp32 once
    model = build_model(ModelConfig.from_preset("tiny-llama"))
    assert {p.dtype for p in set_precision(model, "auto").parameters()} == {torch.float32}
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        set_precision(model, "fp8")
    with pytest.raises(ConfigError, match="unknown quantization mode 'int3'"):
        set_precision(model, "bfloat16", "int3")


def test_compiled_decode_of_a_w8a8_model_gives_the_uncached_tokens() -> None:
    """fbgemm's packed weight sits behind a custom op, so the compiled decode step stays one graph."""
    from tformer.engine import Engine, EngineConfig, SamplingParams
    from tformer.engine.runner import compiled_decode_step

    model = quantize(make_model(tiny_config("tiny-llama", vocab_size=96)), "w8a8")
    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(1, 18))]
    results = Engine(model, config=EngineConfig(block_size=4, num_blocks=32, compile=True)).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0)
    )
    assert compiled_decode_step(model.decoder).compiled is not None  # no eager fallback
    assert [r.token_ids for r in results] == [reference_greedy(model, p, 8) for p in prompts]


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
def test_a_quantized_model_is_not_saved_as_a_checkpoint(mode: str, tmp_path) -> None:
    """`load` could not read its tensors back into the config's model, so `save` refuses and writes nothing."""
    from tformer.models.base import CheckpointError

    model = quantize(make_model(tiny_config("tiny-llama", vocab_size=96)), mode, group_size=32)
    with pytest.raises(CheckpointError, match=r"quantized model \(int8, int4, w8a8\) cannot be saved"):
        model.save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_int8_rows_are_the_dequantized_rows_for_any_shape() -> None:
    """`rows` reads rows out of the packed bytes (16-row tiles, 4-column groups, padded at the edges)."""
    layer = Int8Linear(nn.Linear(37, 40))  # neither dimension a multiple of the tile
    ids = torch.tensor([[0, 39, 16], [15, 17, 39]])
    assert torch.equal(layer.rows(ids), layer.dequantized()[ids])


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_tied_embedding_looks_its_rows_up_in_the_int8_head(mode: str) -> None:
    """One copy of a tied table: the embedding reads the head's INT8 rows. The model computes exactly what it
    computes with a float table holding those rows, and stays within the INT8 rounding of the float table's
    logits (each row within half a step of max |row| / 127: measured 4e-3 of the largest logit here)."""
    shape = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "vocab_size": 96}
    model = make_model(tiny_config("tiny-llama", tie_embeddings=True, **shape))
    assert model.lm_head.weight is model.decoder.tokens.weight
    table = model.decoder.tokens.weight.detach().clone()
    ids = torch.tensor([[5, 17, 3, 60, 42, 8, 91, 33]])
    with torch.no_grad():
        quantize(model, mode)
        assert isinstance(model.decoder.tokens, RowsEmbedding) and isinstance(model.lm_head, Int8Linear)
        assert not any(t is not None and t.numel() == table.numel() for t in model.parameters())
        head = model.lm_head
        assert torch.equal(model.decoder.tokens(ids), head.dequantized()[ids])
        ours = model(ids)
        model.decoder.tokens = nn.Embedding.from_pretrained(head.dequantized())  # the same rows, as floats
        assert torch.equal(model(ids), ours)
        model.decoder.tokens = nn.Embedding.from_pretrained(table)  # the float table: the model before
        before = model(ids)
    error = (ours - before).abs().max() / before.abs().max()
    assert 0 < error < 2e-2, error


def test_an_untied_embedding_stays_in_floats() -> None:
    config = tiny_config("tiny-llama", d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=96)
    model = make_model(config)
    table = model.decoder.tokens.weight
    quantize(model, "int4")
    assert type(model.decoder.tokens) is nn.Embedding and model.decoder.tokens.weight is table
