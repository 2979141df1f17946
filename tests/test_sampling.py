"""The next-token choice's helpers against torch's own formulas."""

import pytest
import torch

from tformer.inference.sampling import ARGMAX_CHUNK, greedy_tokens


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
