"""Speculative decoding inside the engine: greedy output is the target's own, sampled output follows the
target's distribution, and blocks, preemption, prefix hits and stops work as without a draft."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import DECODERS, chi_square, prompts_of_mixed_lengths, reference_greedy, top2_gap

from tformer.config import ConfigError
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 7) -> torch.nn.Module:
    """A draft that agrees with `model` on some tokens and not on others."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=generator))
    return draft


@pytest.fixture(params=list(DECODERS), scope="module")
def target_and_draft(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, torch.nn.Module]:
    overrides = dict(DECODERS[request.param])
    target = make_model(tiny_config(overrides.pop("preset"), **overrides))
    return target, noisy_copy(target, 0.5)


@pytest.mark.parametrize(
    "engine_config",
    [
        EngineConfig(block_size=4, num_blocks=64, num_speculative_tokens=3),
        EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=8, num_speculative_tokens=2),  # chunked
        EngineConfig(block_size=4, num_blocks=14, max_batched_tokens=16, num_speculative_tokens=4),  # preempts
    ],
    ids=["paged", "chunked-prefill", "preemption"],
)
def test_greedy_speculation_in_the_engine_gives_the_target_alone(target_and_draft, engine_config) -> None:
    target, draft = target_and_draft
    prompts = prompts_of_mixed_lengths(target.config.vocab_size)
    engine = Engine(target, config=engine_config, draft=draft)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == [reference_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    stats = engine.speculative
    assert 0 < stats.accepted < stats.proposed  # both branches of the rejection scheme ran
    assert engine.num_blocks_in_use == 0


def test_a_draft_equal_to_the_target_is_always_accepted() -> None:
    target = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(target.config.vocab_size)
    engine = Engine(target, config=EngineConfig(block_size=4, num_blocks=64, num_speculative_tokens=4), draft=target)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == [reference_greedy(target, p, 12) for p in prompts]
    # prefill gives token 1; two steps of 4 drafts + 1 give tokens 2-11; token 12 is a plain decode step
    assert engine.speculative.acceptance_rate == 1.0 and engine.speculative.target_calls == 2


def test_staggered_arrivals_preemption_and_prefix_hits_with_a_draft() -> None:
    target = make_model(tiny_config("tiny-llama"))
    draft = noisy_copy(target, 0.3)
    shared = prompts_of_mixed_lengths(target.config.vocab_size, (13,))[0]
    prompts = [*prompts_of_mixed_lengths(target.config.vocab_size), shared + [5], shared + [6, 7], shared]
    engine = Engine(target, config=EngineConfig(block_size=4, num_blocks=16, max_batched_tokens=16), draft=draft)
    outputs: dict[str, list[int]] = {}
    ids: list[str] = []
    for step in itertools.count():
        if step % 2 == 0 and len(ids) < len(prompts):  # a new request every other step
            ids.append(engine.add_request(prompts[len(ids)], GREEDY))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        if len(ids) == len(prompts) and not engine.has_unfinished():
            break
    assert engine.num_preemptions > 0 and engine.scheduler.prefix_hit_tokens > 0
    assert engine.speculative.accepted > 0
    assert [outputs[rid] for rid in ids] == [reference_greedy(target, p, 12) for p in prompts]
    assert engine.num_blocks_in_use == 0


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there() -> None:
    target = make_model(tiny_config("tiny-llama"))
    prompt = prompts_of_mixed_lengths(target.config.vocab_size, (6,))[0]
    expected = reference_greedy(target, prompt, 12)
    stop = expected[6]  # reached inside the second speculative step, whose 5 tokens are all accepted
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])
    engine = Engine(target, config=EngineConfig(block_size=4, num_blocks=64), draft=target)
    result = engine.generate(prompt, params)[0]
    assert result.token_ids == expected[: expected.index(stop) + 1] and result.finish_reason == "stop"
    assert result.token_ids == Engine(target).generate(prompt, params)[0].token_ids
    assert engine.num_blocks_in_use == 0


def test_sampled_speculation_in_the_engine_follows_the_target_distribution() -> None:
    """Tokens 2 and 3 come from one speculative step (one draft token, then the target's extra token)."""
    target = make_model(tiny_config("tiny-llama", vocab_size=6), seed=0)
    draft = make_model(tiny_config("tiny-llama", vocab_size=6, n_decoder_layers=1), seed=5)
    prompt = [1, 2, 3]
    with torch.no_grad():
        target.decoder.final_norm.weight.mul_(6)  # sharper than the draft's near-uniform guesses
        first = torch.softmax(target(torch.tensor([prompt]))[0, -1], -1)
        two = torch.tensor([[*prompt, a] for a in range(6)])
        second = torch.softmax(target(two)[:, -1], -1)  # (a, b): p(b | a)
        three = torch.tensor([[*prompt, a, b] for a in range(6) for b in range(6)])
        third = torch.softmax(target(three)[:, -1], -1).view(6, 6, 6)  # (a, b, c): p(c | a, b)
        draft_second = torch.softmax(draft(two)[:, -1], -1)
    p_second = first @ second
    p_third = torch.einsum("a,ab,abc->c", first, second, third)
    engine = Engine(target, config=EngineConfig(block_size=4, max_seqs=256, num_speculative_tokens=4), draft=draft)
    results = engine.generate([prompt] * 3000, [SamplingParams(max_tokens=3, seed=s) for s in range(3000)])
    assert engine.speculative.proposed == 3000  # max_tokens 3 leaves room for one draft token per request
    assert 0 < engine.speculative.accepted < 3000
    tokens = torch.tensor([r.token_ids for r in results])
    counts = [torch.bincount(tokens[:, i], minlength=6).float() for i in (1, 2)]
    assert chi_square(counts[0], p_second) < 20.5  # 0.999 quantile, 5 degrees of freedom
    assert chi_square(counts[1], p_third) < 20.5
    assert chi_square(counts[0], first @ draft_second) > 100  # and not the draft's distribution


def test_beam_search_and_parallel_samples_run_beside_speculation() -> None:
    """Beams, greedy rows and parallel samples in one batch with a draft give what they give without one.

    The samples take the sampling path (rejection scheme, per-sample generators, copy-on-write of both caches)
    at a temperature so low that the target's distribution is one-hot in fp32, so they too must equal the target's
    greedy tokens: a rejected draft token must be replaced by the target's, never by the draft's."""
    target = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(target.config.vocab_size, (5, 9))
    beams = SamplingParams(max_tokens=8, temperature=0.0, beam_width=3)
    samples = SamplingParams(max_tokens=8, temperature=2e-5, n=2, seed=3)
    requests, params = [prompts[0], prompts[1], prompts[1]], [beams, GREEDY, samples]
    plain = Engine(target, config=EngineConfig(block_size=4, num_blocks=64)).generate(requests, params)
    engine = Engine(target, config=EngineConfig(block_size=4, num_blocks=64), draft=noisy_copy(target, 0.3))
    with_draft = engine.generate(requests, params)
    greedy = reference_greedy(target, prompts[1], GREEDY.max_tokens)
    assert top2_gap(target, prompts[1], greedy) / samples.temperature > 50  # e^-50: no second token can be drawn
    assert [r.token_ids for r in with_draft] == [r.token_ids for r in plain]
    assert [r.token_ids for r in with_draft[1:]] == [greedy, greedy[:8], greedy[:8]]
    assert 0 < engine.speculative.accepted < engine.speculative.proposed  # drafts were rejected too
    assert engine.num_blocks_in_use == 0


def test_bad_drafts_are_refused() -> None:
    target = make_model(tiny_config("tiny-llama"))
    with pytest.raises(ConfigError, match="vocabulary"):
        Engine(target, draft=make_model(tiny_config("tiny-llama", vocab_size=50)))
    with pytest.raises(ConfigError, match="decoder-only"):
        Engine(make_model(tiny_config("tiny-transformer")), draft=target)
    with pytest.raises(ConfigError, match="max_model_len"):
        Engine(target, draft=make_model(tiny_config("tiny-llama", max_seq_len=16)))
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
