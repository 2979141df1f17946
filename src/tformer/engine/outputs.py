"""What the engine hands back: a request's output of one step (streaming) and a finished request, and the
output processor that detokenizes and applies the stop rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from tformer.engine.requests import ContextWindow
from tformer.engine.sampling import SamplingParams, TokenLogprob
from tformer.engine.scheduler import SequenceState
from tformer.engine.text import TextCodec, TextTracker


@dataclass
class RequestOutput:
    """What one request produced in one step (streaming): new token ids and new text, and with
    `SamplingParams.logprobs` each new token's log-probabilities."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    index: int = 0  # which of the request's samples (SamplingParams.n)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on sample 0's first output, when asked
    # a request that failed alone (finish_reason "error"): what went wrong; this one output ends all its samples
    error: RequestFailure | None = None


@dataclass
class RequestFailure:
    """Why a request failed alone while the others went on: `message` says why, and `client_error` tells whether
    the request itself was at fault (say, parameters that made its logits non-finite) rather than the server."""

    message: str
    client_error: bool = False


@dataclass
class Completion:
    """A finished request: every generated token id (a final stop token included) and the text."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, with `SamplingParams.logprobs`
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, with `prompt_logprobs`
    error: str | None = None  # finish_reason "error": why the request failed


def accumulate(completion: Completion, out: RequestOutput) -> None:
    """Adds one step's output to a completion (what `Engine.generate` collects)."""
    completion.token_ids += out.token_ids
    completion.text += out.text
    if out.logprobs is not None:
        completion.logprobs = (completion.logprobs or []) + out.logprobs
    if out.prompt_logprobs is not None:
        completion.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        completion.finish_reason = out.finish_reason
    if out.error is not None:
        completion.error = out.error.message


class OutputProcessor:
    """Detokenization and the stop rules: turns a sequence's new token into its request's `RequestOutput`.

    Each sample of a request has its own text so far (`TextTracker`), keyed by (request_id, index). A sample
    stops at a stop token or the end-of-sequence token (unless `ignore_eos`), at a stop string (cut from the
    text), when its structured output is complete, at `max_tokens`, or when it fills the context; the engine then
    ends the sequence in the scheduler.
    """

    def __init__(self, tokenizer: TextCodec | None, context: ContextWindow) -> None:
        self.tokenizer = tokenizer
        self.context = context
        eos = getattr(tokenizer, "eos_id", None)
        self.eos_ids: set[int] = set() if eos is None else {eos}
        self._texts: dict[tuple[str, int], TextTracker] = {}

    def add(self, request_id: str, index: int, params: SamplingParams) -> None:
        """Starts the text of sample `index` of a request."""
        self._texts[request_id, index] = TextTracker(self.tokenizer, params.stop)

    def forget(self, request_id: str, n: int) -> None:
        """Drops the texts of a request's n samples (it finished or was aborted)."""
        for index in range(n):
            self._texts.pop((request_id, index), None)

    def process(self, seq: SequenceState, logprob: TokenLogprob | None = None) -> RequestOutput:
        """The output of the token just appended to `seq` (and its `logprob`, when asked): its new text, and whether
        and why the sample stops."""
        token, params = seq.output[-1], seq.params
        tracker = self._texts[seq.request_id, seq.index]
        reason = None
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            reason = "stop"
        text, hit_stop = tracker.push(seq.output, stop_token=reason is not None)
        if hit_stop:
            reason = "stop"
        elif reason is None and seq.constraint is not None and seq.constraint.finished:
            reason = "stop"  # the structured output is complete: it admits nothing more
        elif reason is None and (len(seq.output) >= params.max_tokens or self.context.filled(seq)):
            reason = "length"
        if reason is not None and not hit_stop:
            text += tracker.flush()
        logprobs = None if logprob is None else [logprob]
        return RequestOutput(seq.request_id, [token], text, reason is not None, reason, seq.index, logprobs)

    def finish(self, seq: SequenceState, reason: str) -> RequestOutput:
        """The last output of a sample ended from outside (a timeout): the text it still held back, no token."""
        tracker = self._texts.get((seq.request_id, seq.index))
        text = "" if tracker is None else tracker.flush()
        return RequestOutput(seq.request_id, [], text, True, reason, seq.index)

    def beam_result(self, request_id: str, tokens: list[int], ended: bool) -> RequestOutput:
        """The one output of a finished beam search: its best hypothesis whole (with </s> if it `ended`)."""
        tracker = self._texts[request_id, 0]
        text, _ = tracker.push(tokens, stop_token=ended)
        return RequestOutput(request_id, tokens, text + tracker.flush(), True, "stop" if ended else "length")
