"""Per-request sampling parameters and the next-token choice: greedy, temperature, top-k, top-p; the penalties
and logit bias that adjust a request's logits first, and the log-probabilities it may ask back.

Each request carries its own `SamplingParams` and its own seeded generator, so a request's output does not
depend on which other requests share its batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tformer.engine.structured import StructuredOutput
from tformer.errors import RequestError

GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives a token's log-probabilities may list (OpenAI's top_logprobs limit)
MAX_BIAS = 100.0  # OpenAI's logit_bias range: -100 bans a token, +100 all but forces it
# repetition_penalty divides or multiplies logits by itself: within these bounds finite logits stay finite
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LENGTH_PENALTY = 10.0  # beam search's alpha: ((5 + |y|) / 6) ** alpha stays finite in float32 at long lengths
MAX_STOP_CHARS = 256  # a stop string's length: the stop search costs time in its square per token


@dataclass
class SamplingParams:
    """How one request picks tokens and when it stops (the OpenAI / vLLM parameters).

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters. Generation stops at
    `max_tokens`, at the tokenizer's end-of-sequence token (unless `ignore_eos`), at any of `stop_token_ids`,
    or when the text ends with one of `stop` (the stop string itself is not returned). With `n` > 1, sample i
    uses the seed `seed + i`, so it equals a request of its own with that seed.

    Before a token is chosen, its logits are adjusted as vLLM and OpenAI do (`adjust_logits`): `repetition_penalty`
    (> 1 discourages every token already in the prompt or output: a positive logit is divided by it, a negative
    one multiplied), then `frequency_penalty` times each token's count in the output and `presence_penalty` once
    for each token the output holds are subtracted, then `logit_bias` {token id: value} is added; before
    `min_tokens` tokens the stop tokens and end-of-sequence cannot be chosen. `min_p` keeps, after temperature,
    top-k and top-p, only the tokens at least min_p times as likely as the likeliest. With `logprobs`
    = k, each generated token comes back with its log-probability and the k likeliest alternatives', from the
    model's distribution (log-softmax of the raw logits, as vLLM's default; temperature and penalties excluded);
    with `prompt_logprobs` = k, each prompt token after the first too (the prompt is then computed whole, without
    prefix-cache hits). With `structured` (a `StructuredOutput`, or a dict of its fields), only tokens that keep
    the text valid under its JSON schema, regular expression, choice or grammar can be chosen (structured.py).

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
    logprobs: int | None = None  # each token's log-probability and this many alternatives' (None: none)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (vLLM's; None: none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (llama.cpp's and vLLM's; 0: off)
    min_tokens: int = 0  # no end-of-sequence or stop token before this many tokens (vLLM's)
    structured: StructuredOutput | None = None  # JSON schema, regex, choice or grammar the output must match

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
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"a stop string may hold at most {MAX_STOP_CHARS} characters")
        self._check_adjustments()
        self._check_structured()
        self._check_beam_search()

    def _check_structured(self) -> None:
        if isinstance(self.structured, dict):
            try:
                self.structured = StructuredOutput(**self.structured)
            except TypeError as err:
                raise RequestError(f"structured takes json, json_object, regex, choice or grammar: {err}") from None
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise RequestError(f"structured must be a StructuredOutput or a dict, got {type(self.structured)}")

    def _check_adjustments(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or None), got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise RequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            limit = f"[0, max_tokens={self.max_tokens}]"
            raise RequestError(f"min_tokens must be an integer in {limit}, got {self.min_tokens!r}")
        penalty, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        if not (isinstance(penalty, (int, float)) and low <= penalty <= high):
            raise RequestError(
                f"repetition_penalty must be a number in [{low}, {high}] (1 disables it), got {penalty!r}"
            )
        for token in self.stop_token_ids:
            if not isinstance(token, int) or token < 0:
                raise RequestError(f"stop_token_ids must be token ids (non-negative integers), got {token!r}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise RequestError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
            if not (isinstance(bias, (int, float)) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise RequestError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {token}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a logit bias changes this request's logits before it chooses."""
        penalized = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
        return bool(penalized or self.logit_bias or self.min_tokens)

    def _check_beam_search(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise RequestError(f"beam_width must be a positive integer (1: no beam search), got {self.beam_width!r}")
        alpha = self.length_penalty
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and abs(alpha) <= MAX_LENGTH_PENALTY):
            raise RequestError(
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], got {alpha!r}"
            )
        if self.beam_width > 1 and (self.n > 1 or self.stop or self.stop_token_ids):
            raise RequestError(
                "beam search returns one hypothesis and stops at end-of-sequence or max_tokens: "
                "leave n at 1 and give no stop strings or stop_token_ids with beam_width > 1"
            )
        asks_logprobs = self.logprobs is not None or self.prompt_logprobs is not None
        if self.beam_width > 1 and (self.adjusts_logits or asks_logprobs or self.structured is not None):
            raise RequestError(
                "beam search ranks hypotheses by the model's own log-probabilities: give no penalties, logit_bias, "
                "min_tokens, logprobs or structured output with beam_width > 1"
            )

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 count as 0: dividing logits by them overflows to inf."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


# top-p looks for its nucleus among the likeliest NUCLEUS_FIRST tokens, then 8x as many, then among all
NUCLEUS_FIRST = 256


def kept_tokens(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """The ids (1-D) of the tokens that top_k, then top_p, keep of logits (V,); None when both keep every token.

    top_k keeps the tokens at least as large as the k-th largest logit (ties with it too); top_p then the smallest
    set, likeliest first, whose probability reaches top_p. The most likely token always survives. The nucleus is
    found among the likeliest 256 tokens (`torch.topk`) whenever they hold top_p of the mass, as they do for a
    language model's typical distribution, else among 8x as many, else all of them: sorting the whole vocabulary
    (the definition, tested against) costs far more a token (docs/design-notes.md, "engine/sampling.py").
    """
    vocab = logits.shape[-1]
    kept = None
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        kept = (logits >= kth).nonzero().squeeze(-1)
    if top_p < 1.0:
        probs = torch.softmax(logits if kept is None else logits[kept], -1)
        size = probs.shape[-1]
        k = min(NUCLEUS_FIRST, size)
        best = torch.topk(probs, k)  # sorted, likeliest first
        while k < size and float(best.values.sum()) < top_p:
            k = k * 8 if k * 8 <= size // 16 else size  # a large partial sort costs as much as sorting all
            best = torch.topk(probs, k)
        before = best.values.cumsum(-1) - best.values  # the mass of the likelier tokens before each
        # at least the likeliest: a top_p below float32's smallest number compares as 0 with the first's 0 before
        nucleus = best.indices[: max(1, int((before < top_p).sum()))]
        kept = nucleus if kept is None else kept[nucleus]
    return kept


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keeps the tokens `kept_tokens` keeps; every other logit becomes -inf; (V,) -> (V,)."""
    kept = kept_tokens(logits, top_k, top_p)
    if kept is None:
        return logits
    drop = torch.ones_like(logits, dtype=torch.bool)
    drop[kept] = False
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(filter(logits / T)), then with `min_p` only the tokens at
    least min_p times as likely as the likeliest, renormalized; one-hot at the argmax if greedy."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    scaled = logits.float() / params.temperature
    probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), -1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# torch's CPU argmax walks a row one element at a time, slow for a whole vocabulary. The largest logit of each
# 128-logit chunk (amax, vectorized), the first chunk holding the row's largest, then the first index inside that
# chunk find the same index much faster (docs/design-notes.md, "engine/sampling.py").
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


def sample_index(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One index drawn from a distribution (V,) by inverse transform sampling: the first index whose cumulative
    probability (float64) exceeds a uniform draw scaled to the total, so an index of probability 0 is never drawn.

    One random number a draw, where `torch.multinomial` draws an exponential for every index, many times slower
    (docs/design-notes.md, "engine/sampling.py"). ValueError for NaN, infinite or all-zero probabilities."""
    cdf = probs.double().cumsum(-1)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"the sampling probabilities are not a distribution (they sum to {total})")
    # drawn where the request's generator lives (the CPU): a seed gives the same stream on every device
    where = probs.device if generator is None else generator.device
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=where).to(probs.device) * total
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= probs.shape[-1]:  # u rounded up to the total: the last index of positive probability
        index = int(probs.nonzero()[-1])
    return index


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of logits (V,), drawn from `sampling_probs`' distribution; with top-k or top-p,
    among the kept tokens only (their softmax is that distribution's nonzero part), so that a nucleus of a few
    hundred tokens costs no pass over the whole vocabulary after it is found."""
    if params.greedy:
        return int(logits.argmax())
    scaled = logits.float() / params.temperature
    kept = kept_tokens(scaled, params.top_k, params.top_p)
    if kept is None:
        return sample_index(sampling_probs(logits, params), generator)
    probs = torch.softmax(scaled[kept], -1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    return int(kept[sample_index(probs, generator)])


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, context: list[int], output: list[int], ends: Iterable[int] = ()
) -> torch.Tensor:
    """A request's logits (V,) after its penalties and logit bias (see `SamplingParams`); `context` is every token
    so far (prompt and output), `output` the generated ones. Before `min_tokens` tokens, the stop tokens and the
    end-of-sequence ids `ends` cannot be chosen. The input is left as it was."""
    logits = logits.float().clone()
    if len(output) < params.min_tokens:
        banned = sorted({*params.stop_token_ids, *([] if params.ignore_eos else ends)})
        logits[torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(context)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[0]).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    return logits


@dataclass
class TokenLogprob:
    """A generated token's log-probability, and the `top` likeliest tokens' (id, log-probability), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The model's log-probability of `token` under its logits (V,) (log-softmax in fp32), and the `top` best."""
    logprobs = torch.log_softmax(logits.float(), -1)
    best = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else None
    pairs = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), pairs)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream: seeded when the request gives a seed, else from fresh entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
