"""`tformer generate/serve model.gguf` serve a quantized file as stored by default (load_engine's quantize
'auto'): a Q4_K file as stored (its Q4_K layers `Q4KLinear`, the rest INT4; bf16 activations), a Q8_0 one in
INT8, a float one in floats; 'none' forces floats.

The reference for the tokens is the served model's own uncached forward (the bf16 margin of test_quantize), and
the INT4 model's logits are compared with the dequantized float model's (from_gguf) within a stated tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf_writers
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import greedy_within_rounding

from tformer.engine import EngineConfig, SamplingParams
from tformer.engine.loading import load_engine
from tformer.interop.gguf import from_gguf, open_gguf, stored_precision
from tformer.kernels.q4k import Q4KLinear
from tformer.kernels.quantize import Int4Linear, Int8Linear

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], list(range(1, 18))]


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return gguf_writers.tiny_llama(hidden_size=256, intermediate_size=512, initializer_range=0.05)


def q4_k_file(model, path: Path) -> Path:
    """Every matrix of `model` in Q4_K (a realistic Q4_K_M keeps a few in Q6_K; all Q4_K is the harder case)."""
    tensors = gguf_writers.tensors(model, "llama")
    blocks = {name: gguf_writers.quantize_q4_k(v) for name, v in tensors.items() if v.ndim == 2}
    types = dict.fromkeys(blocks, Q.Q4_K)
    return gguf_writers.write(
        path, model, "llama", tensors_override=blocks, types=types, keys=gguf_writers.TINY_TOKENIZER
    )


def engine_modules(engine) -> set[type]:
    return {type(m) for m in engine.model.modules()}


def test_q4_k_file_serves_as_stored_by_default_close_to_its_float_model(hf_model, tmp_path: Path) -> None:
    path = q4_k_file(hf_model, tmp_path / "q4k.gguf")
    assert stored_precision(open_gguf(path)) == "int4"
    engine = load_engine(path, EngineConfig(block_size=4, num_blocks=64), quantize="auto")
    assert Q4KLinear in engine_modules(engine)
    assert {p.dtype for p in engine.model.parameters() if p.is_floating_point()} == {torch.bfloat16}
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    served = engine.model
    with torch.no_grad():
        largest = max(served(torch.tensor([p])).abs().max().item() for p in PROMPTS)
    margin = 2 * 2.0 ** (math.floor(math.log2(largest)) - 7)  # test_quantize's: two bf16 steps at the largest logit
    for result, prompt in zip(results, PROMPTS, strict=True):
        assert len(result.token_ids) == 8 and greedy_within_rounding(served, prompt, result.token_ids, margin)
    # against the dequantized float model: the Q4_K layers hold its weights exactly, the activations in bf16
    reference = from_gguf(path)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        ours, floats = served(ids).float(), reference(ids)
    error = (ours - floats).abs().max().item() / floats.abs().max().item()
    assert error < 0.05, error  # bf16, the int8 activation steps and the INT8 head; a wrong layer would be O(1)


def test_default_precision_follows_the_file_and_none_forces_floats(hf_model, tmp_path: Path) -> None:
    q8 = gguf_writers.write(tmp_path / "q8.gguf", hf_model, "llama", Q.Q8_0, keys=gguf_writers.TINY_TOKENIZER)
    f16 = gguf_writers.write(tmp_path / "f16.gguf", hf_model, "llama", Q.F16, keys=gguf_writers.TINY_TOKENIZER)
    assert stored_precision(open_gguf(q8)) == "int8" and stored_precision(open_gguf(f16)) is None
    config = EngineConfig(block_size=4, num_blocks=16)
    assert Int8Linear in engine_modules(load_engine(q8, config, quantize="auto"))
    floats = load_engine(f16, config, quantize="auto")
    assert not {Int4Linear, Int8Linear, Q4KLinear} & engine_modules(floats)
    assert {p.dtype for p in floats.model.parameters()} == {torch.float32}
    forced = load_engine(q8, config, quantize="none")
    assert not {Int4Linear, Int8Linear, Q4KLinear} & engine_modules(forced)
    reference = from_gguf(q8)
    prompt = PROMPTS[0]
    tokens = forced.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids
    with torch.no_grad():
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(reference(torch.tensor([ids]))[0, -1].argmax()))
    assert tokens == ids[len(prompt) :]  # fp32 from the same dequantized weights: exact
