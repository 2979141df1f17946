"""Per-request sampling parameters and the next-token choice: greedy, temperature, top-k, top-p.

Each request carries its own `SamplingParams` and its own seeded generator, so a request's output does not
depend on which other requests share its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tformer.errors import RequestError

GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How one request picks tokens and when it stops (the OpenAI / vLLM parameters).

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters. Generation stops at
    `max_tokens`, at the tokenizer's end-of-sequence token (unless `ignore_eos`), at any of `stop_token_ids`,
    or when the text ends with one of `stop` (the stop string itself is not returned). With `n` > 1, sample i
    uses the seed `seed + i`, so it equals a request of its own with that seed.

    `beam_width` > 1 asks for beam search instead: the request returns its best hypothesis, ranked by summed
    log-probability over GNMT's length penalty ((5 + |y|) / 6) ** `length_penalty`; temperature, top_k, top_p
    and seed do not apply, and stop strings, stop tokens and n > 1 are refused.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # independent samples of one prompt; they share the prompt's KV blocks (copy-on-write)
    beam_width: int = 1  # > 1: beam search; the beams share their common KV blocks (copy-on-write)
    length_penalty: float = 0.6  # beam search: GNMT's alpha (0 ranks by raw log-probability)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n must be a positive integer, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise RequestError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be a non-negative integer (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise RequestError(f"beam_width must be a positive integer (1: no beam search), got {self.beam_width!r}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise RequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.beam_width > 1 and (self.n > 1 or self.stop or self.stop_token_ids):
            raise RequestError(
                "beam search returns one hypothesis and stops at end-of-sequence or max_tokens: "
                "leave n at 1 and give no stop strings or stop_token_ids with beam_width > 1"
            )

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 count as 0: dividing logits by them overflows to inf."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keeps the top_k largest logits, then the smallest set whose probability reaches top_p; (V,) -> (V,).

    Everything else becomes -inf. The most likely token always survives.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, -1) >= top_p  # mass before this token already >= p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(filter(logits / T)); one-hot at the argmax if greedy."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    scaled = logits.float() / params.temperature
    return torch.softmax(filter_logits(scaled, params.top_k, params.top_p), -1)


# torch's CPU argmax walks a row one element at a time: 96 us for SmolLM2's 49,152 logits at one row and 2.3 ms at
# 32 rows, 3% of the 32-request run under the torch profiler (2 threads, an Intel Xeon without AMX, 2026-12-03). The
# largest logit of each 128-logit chunk (amax, vectorized), the first chunk holding the row's largest, then the first
# index inside that chunk: the same index in 46 us and 0.38 ms.
ARGMAX_CHUNK = 128


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` of (B, V) logits, index for index (the first of equal largest values; a NaN counts as
    the largest, as in torch), computed a chunk of `ARGMAX_CHUNK` logits at a time."""
    rows, vocab = logits.shape
    whole = vocab - vocab % ARGMAX_CHUNK
    if whole == 0:
        return logits.argmax(-1)
    chunks = logits[:, :whole].reshape(rows, whole // ARGMAX_CHUNK, ARGMAX_CHUNK)
    best_chunk = chunks.amax(-1).argmax(-1)  # (B,): amax keeps a NaN, and argmax takes the first NaN as largest
    row = torch.arange(rows, device=logits.device)
    best = best_chunk * ARGMAX_CHUNK + chunks[row, best_chunk].argmax(-1)
    if whole == vocab:
        return best
    tail = logits[:, whole:]  # the last vocab % ARGMAX_CHUNK logits win only when strictly larger (or a first NaN)
    tail_best = tail.argmax(-1)
    value, tail_value = logits[row, best], tail[row, tail_best]
    tail_wins = (tail_value > value) | (tail_value.isnan() & ~value.isnan())
    return torch.where(tail_wins, whole + tail_best, best)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of logits (V,)."""
    if params.greedy:
        return int(logits.argmax())
    probs = sampling_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream: seeded when the request gives a seed, else from fresh entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
