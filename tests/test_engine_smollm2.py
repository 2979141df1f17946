"""The engine on real weights (SmolLM2-135M-Instruct): every path gives the plain uncached forward's tokens."""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch

from test_engine import reference_greedy
from tformer.inference import Engine, EngineConfig, SamplingParams
from tformer.inference.quantize import quantize, set_precision
from tformer.inference.speculative import SpeculativeStats, speculative_generate

N_TOKENS = 12
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea, please."]


@pytest.fixture(scope="module")
def smollm2(smollm2_pretrained):
    model, tokenizer = smollm2_pretrained
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    return model, tokenizer, prompts


@cache
def _reference(model_id: int, prompt: tuple[int, ...], model: torch.nn.Module) -> list[int]:
    return reference_greedy(model, list(prompt), N_TOKENS)


def reference(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    return _reference(id(model), tuple(prompt), model)


GREEDY = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


def test_paged_engine_with_chunked_prefill(smollm2) -> None:
    model, tokenizer, prompts = smollm2
    engine = Engine(model, tokenizer, EngineConfig(block_size=16, max_batched_tokens=32))
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == [reference(model, p) for p in prompts]
    assert "Paris" in engine.generate(prompts[0], SamplingParams(max_tokens=20, temperature=0.0))[0].text


def test_staggered_arrivals_preemption_and_prefix_hits(smollm2) -> None:
    model, tokenizer, prompts = smollm2
    engine = Engine(model, tokenizer, EngineConfig(block_size=8, num_blocks=14, max_batched_tokens=64))
    ids = [engine.add_request(prompts[0], GREEDY)]
    outputs: dict[str, list[int]] = {ids[0]: []}
    for step in range(10**6):
        if step == 1:  # the rest arrive one step later; the repeat of the first prompt hits the prefix cache
            ids += [engine.add_request(p, GREEDY) for p in prompts[1:] + [prompts[0]]]
            outputs |= {rid: [] for rid in ids[1:]}
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
        if not engine.has_unfinished():
            break
    assert engine.num_preemptions > 0 and engine.scheduler.prefix_hit_tokens > 0
    expected = [reference(model, p) for p in prompts + [prompts[0]]]
    assert [outputs[rid] for rid in ids] == expected


def test_speculative_decoding_with_an_int8_draft(smollm2) -> None:
    model, _, prompts = smollm2
    draft = quantize(copy.deepcopy(model), "int8")  # a quarter of the weight bytes: a cheap draft that often agrees
    stats = SpeculativeStats()
    out = speculative_generate(model, draft, prompts, GREEDY, k=3, stats=stats)
    assert out == [reference(model, p) for p in prompts]
    assert stats.target_calls < N_TOKENS and stats.acceptance_rate > 0.5


def test_bf16_weights_give_the_bf16_uncached_tokens_and_still_answer(smollm2) -> None:
    model, tokenizer, prompts = smollm2
    bf16 = set_precision(copy.deepcopy(model), "bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    engine = Engine(bf16, tokenizer, EngineConfig(block_size=16))
    results = engine.generate(prompts[:2], GREEDY)
    assert [r.token_ids for r in results] == [reference_greedy(bf16, p, N_TOKENS) for p in prompts[:2]]
    assert "Paris" in engine.generate(prompts[0], SamplingParams(max_tokens=20, temperature=0.0))[0].text
