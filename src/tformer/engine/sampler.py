"""The sampler: a step's next tokens from the runner's logits, a room of its own as in vLLM v1.

For each sequence whose tokens are all cached, the sampler applies the request's penalties and logit bias, then
its structured output's mask, then draws a token (or takes the argmax), and advances the constraint. On the first
token of a request with n samples it also draws the first tokens of samples 1..n-1 from the same logits, each with
its own seed and its own copy of the constraint; the engine forks their sequences once the step is booked. A
speculative step's drafts are accepted or rejected here. Beams are not sampled: their logits go to their
`BeamGroup` (beams.py).

A failure while choosing one sequence's token (non-finite logits, a grammar library's panic) fails that sequence
alone: its `Sampled` carries the error and the other rows go on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tformer.engine.sampling import (
    TokenLogprob,
    adjust_logits,
    greedy_tokens,
    make_generator,
    sample_token,
    sampling_probs,
    token_logprob,
)
from tformer.engine.scheduler import SequenceState
from tformer.engine.speculative import SpeculativeStats, accept_draft, accept_greedy
from tformer.engine.structured import Constraint
from tformer.errors import RequestError


class NonFiniteLogits(RequestError):
    """A request's adjusted logits hold NaN or +inf: nothing can be sampled from them."""


@dataclass
class ScoredRows:
    """One forward's logits (B, V), a row per sequence it ran, and the rows whose next token is due (every token
    of the sequence is now cached), as (row, sequence)."""

    logits: torch.Tensor
    due: list[tuple[int, SequenceState]]


@dataclass
class Verification:
    """A speculative step: each sequence's draft tokens, the draft distributions they were drawn from, and the
    target's logits (B, 1 + drafts, V) after its pending token and after each draft."""

    seqs: list[SequenceState]
    proposals: list[list[int]]
    draft_probs: list[torch.Tensor]
    logits: torch.Tensor


@dataclass
class ModelOutput:
    """What the runner computed in one step (the sampler's input)."""

    scored: list[ScoredRows] = field(default_factory=list)
    verification: Verification | None = None


@dataclass
class Fork:
    """Sample `index` of a request, drawn at the request's first token: its token and log-probability, and the
    random stream and constraint its sequence goes on with."""

    index: int
    token: int
    logprob: TokenLogprob | None
    generator: torch.Generator | None
    constraint: Constraint | None


@dataclass(eq=False)
class Sampled:
    """What the sampler chose for one sequence: its new tokens (a speculative step's kept ones, the pending
    token's and the accepted drafts'), a beam's logits for its group, or the error that failed it."""

    seq: SequenceState
    tokens: list[int] = field(default_factory=list)
    logprob: TokenLogprob | None = None
    forks: list[Fork] = field(default_factory=list)
    beam_logits: torch.Tensor | None = None
    error: BaseException | None = None


@dataclass
class SamplerOutput:
    """A step's choices in the order of the runner's rows, and how many tokens each speculative sequence kept."""

    samples: list[Sampled] = field(default_factory=list)
    kept: dict[SequenceState, int] = field(default_factory=dict)


def isolated(err: BaseException) -> bool:
    """Whether a failure ends one request rather than the process: every exception, and the BaseException
    subclasses native extensions raise (PyO3's PanicException), but not an interrupt or an exit."""
    return not isinstance(err, KeyboardInterrupt | SystemExit | GeneratorExit)


class Sampler:
    """Chooses tokens from logits for the sequences of a step; `ends` are the end-of-sequence ids that
    min_tokens bans, `stats` counts the drafts proposed and accepted."""

    def __init__(self, ends: Iterable[int], stats: SpeculativeStats) -> None:
        self.ends = ends
        self.stats = stats

    def sample(self, model_output: ModelOutput) -> SamplerOutput:
        out = SamplerOutput()
        for scored in model_output.scored:
            self._sample_rows(scored, out)
        if model_output.verification is not None:
            self._verify(model_output.verification, out)
        return out

    def _sample_rows(self, scored: ScoredRows, out: SamplerOutput) -> None:
        logits = scored.logits
        greedy = any(seq.params.greedy for _, seq in scored.due)
        best = greedy_tokens(logits).tolist() if greedy else None  # one call for the batch
        for row, seq in scored.due:
            sampled = Sampled(seq)
            try:
                if seq.params.beam_width > 1:
                    sampled.beam_logits = logits[row]
                else:
                    self._choose(sampled, logits[row], best[row] if best is not None else None)
            except BaseException as err:
                if not isolated(err):
                    raise
                sampled = Sampled(seq, error=err)
            out.samples.append(sampled)

    def _choose(self, sampled: Sampled, logits: torch.Tensor, best: int | None) -> None:
        """A sample's next token from its logits (V,), and on a request's first token its forks' (drawn first, each
        from a copy of the constraint as it stands). `best` is the logits' argmax (a greedy sample takes it)."""
        seq = sampled.seq
        params = seq.params
        if not seq.output and params.n > 1:
            for i in range(1, params.n):
                seed = None if params.seed is None else params.seed + i
                generator = None if params.greedy else make_generator(seed)
                constraint = None if seq.constraint is None else seq.constraint.copy()
                token, logprob = self._token(seq, logits, best, generator, constraint)
                sampled.forks.append(Fork(i, token, logprob, generator, constraint))
        token, sampled.logprob = self._token(seq, logits, best, seq.generator, seq.constraint)
        sampled.tokens.append(token)

    def _token(
        self,
        seq: SequenceState,
        logits: torch.Tensor,
        best: int | None,
        generator: torch.Generator | None,
        constraint: Constraint | None,
    ) -> tuple[int, TokenLogprob | None]:
        params, chosen_from = seq.params, logits
        if params.adjusts_logits:  # its own penalties and bias: the batch's argmax does not serve it
            chosen_from = adjust_logits(logits, params, seq.tokens_between(0, seq.length), seq.output, self.ends)
        if constraint is not None:  # a structured output: only the tokens that keep it valid
            chosen_from = constraint.mask(chosen_from, None if chosen_from is logits else logits)
        if chosen_from is not logits:
            _check_finite(chosen_from)
        greedy = params.greedy and best is not None and chosen_from is logits
        token = best if greedy else sample_token(chosen_from, params, generator)
        if constraint is not None:
            constraint.advance(token)
        logprob = None if params.logprobs is None else token_logprob(logits, token, params.logprobs)
        return token, logprob

    def _verify(self, batch: Verification, out: SamplerOutput) -> None:
        """The rejection scheme of speculative.py: which drafts each sequence keeps, and the target's token after."""
        logits = batch.logits
        greedy = any(seq.params.greedy for seq in batch.seqs)
        best = greedy_tokens(logits.flatten(0, 1)).view(logits.shape[:2]).tolist() if greedy else None  # one call
        rows = zip(batch.seqs, batch.proposals, batch.draft_probs, strict=True)
        for row, (seq, drafted, q) in enumerate(rows):
            try:
                if best is not None and seq.params.greedy:
                    kept = accept_greedy(drafted, best[row][: len(drafted) + 1])
                else:
                    p = torch.stack([sampling_probs(logits[row, i], seq.params) for i in range(len(drafted) + 1)])
                    kept = accept_draft(drafted, q, p, seq.generator)
            except BaseException as err:
                if not isolated(err):
                    raise
                out.samples.append(Sampled(seq, error=err))
                out.kept[seq] = 0
                continue
            self.stats.proposed += len(drafted)
            self.stats.accepted += len(kept) - 1
            out.samples.append(Sampled(seq, kept))
            out.kept[seq] = len(kept)


def _check_finite(logits: torch.Tensor) -> None:
    """Raises NonFiniteLogits when a request's adjusted logits hold NaN or +inf (-inf is a banned token)."""
    top = float(logits.max())
    if math.isnan(top) or top == math.inf:
        raise NonFiniteLogits(
            "the request's penalties or logit bias made its logits non-finite; use a repetition_penalty closer to 1"
        )
