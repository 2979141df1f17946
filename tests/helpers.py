"""References shared by the engine, speculation and quantization tests: the uncached greedy decoder, the bf16
rounding margin, prompts of mixed lengths, the decoder variants the engine must serve, and the chi-square statistic.

Fixtures and the tiny-config helpers live in conftest.py; these are plain functions and data.
"""

from __future__ import annotations

import torch

DECODERS = {
    "llama (RoPE, GQA, RMSNorm, SwiGLU)": dict(preset="tiny-llama"),
    "gpt2 (learned positions)": dict(preset="tiny-gpt2"),
    "alibi": dict(preset="tiny-llama", position="alibi"),
    "sliding window": dict(preset="tiny-llama", sliding_window=5),
}


def reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the full uncached forward at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy_within_rounding(model: torch.nn.Module, prompt: list[int], tokens: list[int], margin: float) -> bool:
    """Whether each of `tokens` scores within `margin` of the best logit of the uncached forward on the prefix
    before it: greedy decoding up to near-ties that bf16 rounding can flip either way.

    Two bf16 paths that reduce in different shapes (cached decode against the full forward) round differently,
    so tests of bf16 paths state this margin instead of demanding the reference's exact tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].float()  # (len(tokens), V)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return bool((chosen >= logits.amax(1) - margin).all())


def top2_gap(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> float:
    """The smallest gap between the best and second-best logit of the uncached forward along `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].float()  # (len(tokens), V)
    best = logits.topk(2, dim=-1).values  # (len(tokens), 2)
    return float((best[:, 0] - best[:, 1]).min())


def prompts_of_mixed_lengths(vocab: int, lengths: tuple[int, ...] = (7, 2, 13, 1, 20)) -> list[list[int]]:
    """Seeded random prompts, one per length."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed `counts` against the expected distribution `probs`."""
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())
