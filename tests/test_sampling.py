"""The next-token choice's helpers against torch's own formulas."""

from dataclasses import replace

import pytest
import torch
from helpers import chi_square

from tformer.engine.sampling import (
    ARGMAX_CHUNK,
    SamplingParams,
    filter_logits,
    greedy_tokens,
    kept_tokens,
    sample_index,
    sample_token,
    sampling_probs,
)


@pytest.mark.parametrize("vocab", [49152, 50257, 3 * ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 100])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_greedy_tokens_are_torch_argmax_with_ties_nan_and_infinities(rows, vocab):
    generator = torch.Generator().manual_seed(rows * vocab)
    cases = [
        torch.randn(rows, vocab, generator=generator),  # distinct values
        torch.randint(-3, 4, (rows, vocab), generator=generator).float(),  # many ties: the first index wins
        torch.full((rows, vocab), -float("inf")),  # nothing but -inf: index 0
        torch.zeros(rows, vocab).bfloat16(),  # the engine's logits may be bf16
    ]
    with_nan = torch.randn(rows, vocab, generator=generator)
    with_nan[0, vocab - 1] = float("nan")  # in the tail when vocab is not a multiple of the chunk
    with_nan[-1, vocab // 2] = float("nan")
    with_nan[-1, vocab - 2] = float("nan")  # a second NaN after the first: the first wins
    with_inf = torch.randn(rows, vocab, generator=generator)
    with_inf[:, vocab - 1] = float("inf")
    with_inf[0, 1] = float("inf")
    cases += [with_nan, with_inf]
    for logits in cases:
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


def test_sample_index_draws_from_the_distribution_and_never_a_zero():
    """Inverse transform sampling: 20,000 seeded draws from a distribution with zeros at both ends and inside follow
    it (Pearson's statistic below the 0.999 quantile), never land on a zero, and repeat with the seed; NaN or an
    all-zero distribution is an error, not a silent index."""
    probs = torch.tensor([0.0, 0.05, 0.3, 0.0, 0.15, 0.5, 0.0])
    generator = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_index(probs, generator) for _ in range(20000)])
    counts = torch.bincount(draws, minlength=len(probs)).float()
    assert counts[probs == 0].sum() == 0
    kept = probs > 0
    assert chi_square(counts[kept], probs[kept]) < 16.3  # 3 degrees of freedom
    unnormalized = probs * 7  # a total other than 1 is scaled to, not assumed
    again = [sample_index(unnormalized, torch.Generator().manual_seed(0)) for _ in range(1)]
    assert again == [int(draws[0])]
    one_hot = torch.zeros(49152)
    one_hot[49151] = 1.0  # the last index, where a draw rounded up to the total lands
    assert sample_index(one_hot, generator) == 49151
    for bad in (torch.tensor([0.5, float("nan")]), torch.zeros(4)):
        with pytest.raises(ValueError, match="not a distribution"):
            sample_index(bad, generator)


def nucleus_by_sorting(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort every logit, keep each token whose likelier tokens hold less than top_p."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, -1)
    drop_sorted = probs.cumsum(-1) - probs >= top_p
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.3])  # peaked, language-model-like, nearly flat
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_nucleus_the_sorted_definition_keeps(scale, top_p):
    """Over SmolLM2's vocabulary size, top-p (which looks among the likeliest 256 tokens first, then 2,048, ...)
    keeps exactly the tokens that sorting all 49,152 logits keeps, from a peaked distribution whose nucleus is a
    few tokens to a nearly flat one whose nucleus is most of the vocabulary; with top_k first, over the survivors.
    Where every logit is equal, any equal tokens form a nucleus: it keeps as many as the definition does."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(int(scale * 10 + top_p * 100))) * scale
    assert torch.equal(filter_logits(logits, 0, top_p), nucleus_by_sorting(logits, top_p))
    top_k = filter_logits(logits, 1000, 1.0)
    assert torch.equal(filter_logits(logits, 1000, top_p), nucleus_by_sorting(top_k, top_p))
    flat = torch.zeros(49152)
    kept = filter_logits(flat, 0, top_p).isfinite().sum()
    assert kept == nucleus_by_sorting(flat, top_p).isfinite().sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_k=8, top_p=0.99, min_p=0.2),
        SamplingParams(temperature=0.7),
    ],
    ids=["top_p", "top_k", "top_k-top_p-min_p", "temperature"],
)
def test_sample_token_draws_from_sampling_probs(params):
    """sample_token, which draws among the kept tokens only, follows `sampling_probs`' distribution over the whole
    vocabulary (Pearson's statistic over 20,000 seeded draws below the 0.999 quantile) and never draws a token it
    gives probability 0."""
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    expected = sampling_probs(logits, params)
    if params.min_p:  # the case is chosen so that min_p drops tokens top-k and top-p keep
        assert (expected > 0).sum() < (sampling_probs(logits, replace(params, min_p=0.0)) > 0).sum()
    generator = torch.Generator().manual_seed(2)
    counts = torch.bincount(torch.tensor([sample_token(logits, params, generator) for _ in range(20000)]), minlength=12)
    assert counts[expected == 0].sum() == 0
    kept = expected > 0
    quantile_999 = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3, 8: 26.1, 9: 27.9, 10: 29.6, 11: 31.3}
    assert int(kept.sum()) > 1 and chi_square(counts[kept].float(), expected[kept]) < quantile_999[int(kept.sum()) - 1]


def test_a_top_p_too_small_for_float32_keeps_the_likeliest_token() -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    for top_p in (1e-300, 1e-50, 0.0):  # each rounds to 0.0 in float32, as the probabilities are
        assert kept_tokens(logits, 0, top_p).tolist() == [1]
