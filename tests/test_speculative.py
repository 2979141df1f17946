"""Speculative decoding: greedy output equals the target alone; sampled output follows the target's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import chi_square, reference_greedy

from tformer.engine.sampling import RequestError, SamplingParams
from tformer.engine.speculative import SpeculativeStats, accept_draft, accept_greedy, speculative_generate

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9] * 13, [1]]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_equals_the_target_alone(k: int) -> None:
    target = make_model(tiny_config("tiny-llama"), seed=0)
    draft = make_model(tiny_config("tiny-llama", n_decoder_layers=1, d_model=16, n_heads=2, n_kv_heads=1), seed=1)
    stats = SpeculativeStats()
    out = speculative_generate(target, draft, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), k, stats)
    assert out == [reference_greedy(target, p, 12) for p in PROMPTS]
    assert stats.target_calls < 12 * len(PROMPTS)  # rows share target forwards


def test_a_perfect_draft_is_always_accepted() -> None:
    target = make_model(tiny_config("tiny-llama"))
    stats = SpeculativeStats()
    out = speculative_generate(target, target, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), 4, stats)
    assert out == [reference_greedy(target, p, 12) for p in PROMPTS]
    assert stats.acceptance_rate == 1.0
    assert stats.target_calls == 3  # 12 tokens at 5 per round (4 drafts + 1 bonus)


def test_rejection_scheme_reproduces_the_target_distribution() -> None:
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    firsts = []
    for _ in range(8000):
        proposal = int(torch.multinomial(q[0], 1, generator=generator))
        firsts.append(accept_draft([proposal], q, p, generator)[0])
    counts = torch.bincount(torch.tensor(firsts), minlength=4).float()
    assert chi_square(counts, p[0]) < 16.3  # 0.999 quantile, 3 degrees of freedom
    assert chi_square(counts, q[0]) > 100  # and it is not the draft's distribution


@pytest.mark.parametrize("seed", range(20))
def test_greedy_acceptance_is_the_rejection_scheme_on_one_hot_distributions(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    k, vocab = 4, 3  # a small vocabulary, so drafts often match and often do not
    drafts = torch.randint(vocab, (k,), generator=generator).tolist()
    target = torch.randint(vocab, (k + 1,), generator=generator).tolist()
    q = torch.nn.functional.one_hot(torch.tensor(drafts), vocab).float()
    p = torch.nn.functional.one_hot(torch.tensor(target), vocab).float()
    assert accept_greedy(drafts, target) == accept_draft(drafts, q, p, torch.Generator().manual_seed(0))


def test_sampled_speculation_follows_the_target_distribution() -> None:
    target = make_model(tiny_config("tiny-llama", vocab_size=6), seed=0)
    draft = make_model(tiny_config("tiny-llama", vocab_size=6, n_decoder_layers=1), seed=5)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p_first = torch.softmax(target(torch.tensor([prompt]))[0, -1], -1)
    firsts = []
    for seed in range(6):
        out = speculative_generate(target, draft, [prompt] * 500, SamplingParams(max_tokens=2, seed=seed), k=2)
        firsts += [row[0] for row in out]
    counts = torch.bincount(torch.tensor(firsts), minlength=6).float()
    assert chi_square(counts, p_first) < 20.5  # 0.999 quantile, 5 degrees of freedom


def test_draft_with_another_vocabulary_is_refused() -> None:
    target = make_model(tiny_config("tiny-llama"))
    draft = make_model(tiny_config("tiny-llama", vocab_size=50))
    with pytest.raises(RequestError, match="vocabulary"):
        speculative_generate(target, draft, PROMPTS, SamplingParams(max_tokens=4, temperature=0.0))
