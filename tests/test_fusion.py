"""Fused projections for serving (kernels/fusion.py): q/k/v and gate/up joined by output rows must compute what
the separate layers compute, in fp32 and in every quantized format, and leave what cannot be joined alone."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import reference_greedy

from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.kernels.fusion import concat_linears, fuse_projections
from tformer.kernels.int4 import Int4Linear
from tformer.kernels.quantize import set_precision
from tformer.layers.attention import Attention
from tformer.layers.ffn import GatedMLP

IDS = torch.tensor([[5, 17, 3, 44, 9, 61, 2, 30, 8, 12]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        if model.config.is_seq2seq:
            return model(IDS, IDS[:, :6])
        return model(IDS)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-transformer"])
def test_fused_float_model_computes_the_separate_layers_logits(preset: str) -> None:
    """GQA with a gated MLP (LLaMA), biases and a plain MLP (GPT-2), self- and cross-attention (the paper's)."""
    model = make_model(tiny_config(preset))
    fused = fuse_projections(copy.deepcopy(model))
    attentions = [m for m in fused.modules() if isinstance(m, Attention)]
    assert all((m.qkv_proj is None) == m.cross for m in attentions)
    assert all(not hasattr(m, "q_proj") for m in attentions if not m.cross)
    assert all(m.gate_up_proj is not None for m in fused.modules() if isinstance(m, GatedMLP))
    torch.testing.assert_close(logits(fused), logits(model), rtol=0, atol=2e-6)


@pytest.mark.parametrize("mode", ["int4", "int8", "w8a8", "fp8"])
def test_fusing_before_quantizing_gives_the_separately_quantized_logits(mode: str) -> None:
    """Scales and INT4 groups are per output row, so a fused layer quantizes to the separate layers' rows; fp32
    activations keep the comparison free of bf16 rounding."""
    model = make_model(tiny_config("tiny-llama"))
    separate = set_precision(copy.deepcopy(model), "float32", mode, fuse=False)
    fused = set_precision(copy.deepcopy(model), "float32", mode)
    assert any(m.qkv_proj is not None for m in fused.modules() if isinstance(m, Attention))
    torch.testing.assert_close(logits(fused), logits(separate), rtol=0, atol=1e-5)


def test_packed_int4_layers_join_as_they_are() -> None:
    """INT4 layers read from a GGUF file arrive packed, in chunks of 16 output rows: joined, the fused layer holds
    the three weights and computes the three outputs side by side, whatever their groups' sizes."""
    torch.manual_seed(0)
    parts = [Int4Linear(torch.nn.Linear(128, 48)), Int4Linear(torch.nn.Linear(128, 16), group_size=64)]
    parts.append(Int4Linear(torch.nn.Linear(128, 32), group_size=128))
    fused = concat_linears(parts)
    assert torch.equal(fused.dequantized(), torch.cat([p.dequantized() for p in parts]))
    x = torch.randn(3, 128)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert concat_linears([parts[1], torch.nn.Linear(128, 32)]) is None  # a mix of types stays apart


def test_the_engine_serves_a_fused_model_with_the_uncached_tokens() -> None:
    model = set_precision(make_model(tiny_config("tiny-llama")), "float32")
    prompts = [[5, 17, 3, 44, 9], [61, 2, 30]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = Engine(model, config=EngineConfig(block_size=4, num_blocks=32)).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [reference_greedy(model, p, 6) for p in prompts]
