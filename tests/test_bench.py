"""`tformer bench`: the bytes a decode step reads against the plain count of the weights, and the timings and
advice on a tiny engine."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_config
from torch import nn

from tformer.engine import Engine, EngineConfig
from tformer.engine.bench import bench_engine, format_bench, remedies, weight_bytes_per_token
from tformer.kernels import q4k, q6k
from tformer.kernels.q4k import Q4KLinear
from tformer.kernels.q6k import Q6KLinear
from tformer.kernels.quantize import set_precision

BLOCK_BYTES = {Q4KLinear: q4k.BLOCK_BYTES, Q6KLinear: q6k.BLOCK_BYTES}


def plain_count(model: nn.Module, tied: bool) -> int:
    """Every parameter's and buffer's (RoPE's frequencies) bytes once, less the token table unless the output
    head reads it whole."""
    params = {id(p): p for p in [*model.parameters(), *model.buffers()]}
    total = sum(p.numel() * p.element_size() for p in params.values())
    table = model.decoder.tokens.weight
    return total if tied else total - table.numel() * table.element_size()


def test_weight_bytes_per_token_counts_what_a_decode_step_reads() -> None:
    for tied in (False, True):
        model = make_model(tiny_config("tiny-llama", tie_embeddings=tied))
        assert weight_bytes_per_token(model) == plain_count(model, tied)
    bf16 = make_model(tiny_config("tiny-llama")).to(torch.bfloat16)
    assert weight_bytes_per_token(bf16) == plain_count(bf16, False)


def test_bench_reports_every_phase_and_the_remedies_that_apply() -> None:
    model = make_model(tiny_config("tiny-llama"))
    engine = Engine(model, None, EngineConfig(prefix_caching=False, kv_cache_bytes=8 << 20))
    result = bench_engine(engine, prompt_tokens=16, new_tokens=6, batch=4)
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0 and result.batch_decode_tokens_per_s > 0
    assert result.weight_bytes_per_token == plain_count(model, False)
    assert 0 < result.bandwidth_share
    advice = remedies(engine, result)
    assert any(line.startswith("quantization: off") for line in advice)
    report = format_bench("tiny", result, advice)
    assert "decode, batch 4" in report and "quantization: off" in report

    quantized = Engine(
        set_precision(make_model(tiny_config("tiny-llama")), "bfloat16", "int8"),
        None,
        EngineConfig(prefix_caching=False, kv_cache_bytes=8 << 20),
    )
    assert any(line == "quantization: on" for line in remedies(quantized, result))
    assert any(
        "--kv-cache-dtype int8 keeps keys and values in about half" in line for line in remedies(quantized, result)
    )
    int8_kv = Engine(model, None, EngineConfig(prefix_caching=False, kv_cache_bytes=8 << 20, kv_cache_dtype="int8"))
    assert any(line.endswith(", int8 keys and values") for line in remedies(int8_kv, result))


@pytest.mark.parametrize("layer", [Q4KLinear, Q6KLinear])
def test_a_gguf_layer_served_as_stored_counts_as_quantized(layer: type) -> None:
    model = make_model(tiny_config("tiny-llama", d_model=256, vocab_size=96))
    engine = Engine(model, None, EngineConfig(prefix_caching=False, kv_cache_bytes=8 << 20))
    result = bench_engine(engine, prompt_tokens=4, new_tokens=2, batch=1)
    assert any(line.startswith("quantization: off") for line in remedies(engine, result))
    blocks = torch.randint(0, 256, (96, BLOCK_BYTES[layer]), dtype=torch.uint8)  # any bytes are blocks
    model.lm_head = layer.from_blocks(blocks, (96, 256))
    assert any(line == "quantization: on" for line in remedies(engine, result))
