"""Requests on their way in: a prompt becomes a sequence the engine can serve, or is refused before anything changes.

`InputProcessor` tokenizes and checks a prompt and its parameters' token ids, applies the context-length rule
(`ContextWindow`, the one place it lives) and builds the request's first sequence with its family's decoder
prompt. `Request` keeps the books of one request: its samples, keyed by (request_id, index), and its beams.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from tformer.engine.beams import BeamGroup
from tformer.engine.blocks import BlockAllocator
from tformer.engine.runner import ModelRunner
from tformer.engine.sampler import Fork
from tformer.engine.sampling import SamplingParams, TokenLogprob, make_generator, token_logprob
from tformer.engine.scheduler import Scheduler, SequenceState
from tformer.engine.structured import GrammarCompiler
from tformer.engine.text import TextCodec
from tformer.errors import RequestError


class ContextLengthError(RequestError):
    """A request that does not fit the model's context; `param` names the part to change ("prompt" or the
    max-tokens parameter the caller named)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False)
class Request:
    """One request's books: sample 0 from the start, samples 1..n-1 once the prompt is cached, or its beams."""

    request_id: str
    params: SamplingParams
    samples: list[SequenceState] = field(default_factory=list)  # samples[i].index == i
    beams: BeamGroup | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt position so far (None for the first), until the
    # request's first output carries them
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def records_prompt(self, seq: SequenceState) -> bool:
        """Whether a step over `seq` still adds to the request's prompt log-probabilities."""
        recorded = self.prompt_logprobs
        return recorded is not None and seq.index == 0 and len(recorded) < len(seq.prompt)

    def record_prompt(self, seq: SequenceState, start: int, after_each: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens that a step's tokens from `start` predict, from the logits
        after each of them (n, V); a prefix computed again after a preemption adds nothing twice."""
        recorded = self.prompt_logprobs
        assert recorded is not None
        for k, logits in enumerate(after_each):
            target = start + k + 1  # the prompt position the logits after token start + k predict
            if target == len(recorded) and target < len(seq.prompt):
                recorded.append(token_logprob(logits, seq.prompt[target], seq.params.prompt_logprobs or 0))

    def sequences(self) -> list[SequenceState]:
        """Every sequence of the request still in the engine's books."""
        return self.samples + (self.beams.live if self.beams is not None else [])

    def fork(self, parent: SequenceState, allocator: BlockAllocator, forks: list[Fork]) -> list[SequenceState]:
        """Samples 1..n-1 of a request whose prompt is now cached, as the sampler drew them (their random streams
        and constraints; the engine appends their first tokens): each shares every block of the prompt, and
        arrived with the request."""
        children = [
            parent.fork(
                allocator,
                generator=fork.generator,
                arrival=parent.arrival,
                index=fork.index,
                constraint=fork.constraint,
            )
            for fork in forks
        ]
        self.samples += children
        return children


class ContextWindow:
    """The context-length rule, the one place it lives: what a prompt leaves room for, and whether a request fits.
    The engine's `InputProcessor`, `AsyncEngine` and the server's `check_fits` all ask it; it reads only the
    engine's configuration, so any thread may."""

    def __init__(self, runner: ModelRunner, max_model_len: int) -> None:
        self.runner = runner
        self.max_model_len = max_model_len

    def max_new_tokens(self, prompt_len: int) -> int:
        """How many tokens a prompt of prompt_len tokens leaves in the context (the longest max_tokens): a decoder's
        prompt and output share it; an encoder-decoder's output has all of it (the decoder's positions are its own)."""
        taken, _ = self.runner.context_lengths(prompt_len)
        return self.max_model_len - taken

    def filled(self, seq: SequenceState) -> bool:
        """Whether `seq`'s output has taken all the room its request's prompt (an encoder-decoder's source) left."""
        prompt_len = len(seq.prompt) if seq.source is None else len(seq.source)
        return len(seq.output) >= self.max_new_tokens(prompt_len)

    def check(self, prompt_len: int, max_tokens: int, tokens_param: str = "max_tokens") -> None:
        """Raises ContextLengthError when a prompt of prompt_len tokens, or it with max_tokens more, overflows the
        context; `tokens_param` is the name the caller gave max_tokens (the message and `param` use it)."""
        _, source = self.runner.context_lengths(prompt_len)
        if source > self.max_model_len:
            raise ContextLengthError(
                f"the source has {source} tokens; the model reads at most {self.max_model_len}; shorten it", "prompt"
            )
        room = self.max_new_tokens(prompt_len)
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {prompt_len} tokens but the model's context holds {self.max_model_len}; shorten it",
                "prompt",
            )
        if max_tokens > room:
            raise ContextLengthError(
                f"{tokens_param}={max_tokens} is beyond the context: the prompt's {prompt_len} tokens leave room "
                f"for {room} of the {self.max_model_len}; use {tokens_param} <= {room}",
                tokens_param,
            )


class InputProcessor:
    """Prompts in: tokenization, validation, the context-length rule and the request's first sequence (with its
    structured output's `Constraint`; `ends` are the end-of-sequence ids a constraint allows once complete)."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: TextCodec | None,
        vocab_size: int,
        context: ContextWindow,
        scheduler: Scheduler,
        ends: Iterable[int] = (),
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context = context
        self.scheduler = scheduler
        bos = getattr(tokenizer, "bos_id", None)
        self.bos_id = 1 if bos is None else bos
        self.grammars = GrammarCompiler(tokenizer, vocab_size, ends)

    def new_sequence(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> SequenceState:
        """The request's first sequence; raises RequestError when the engine cannot serve it."""
        ids = self.encode(prompt)
        self.context.check(len(ids), params.max_tokens)
        self.check_token_ids(params)
        decoder_prompt, source = self.runner.split_prompt(ids, self.bos_id)
        if source is not None and params.prompt_logprobs is not None:
            raise RequestError(
                "prompt_logprobs score the tokens of a decoder's prompt; an encoder-decoder reads its prompt as the "
                "source and predicts none of it"
            )
        # every beam may need its own blocks in the end (all its tokens but the last, which is never fed back); a
        # beam group that fits alone can always make progress
        blocks = self.scheduler.max_blocks_held(len(decoder_prompt) + params.max_tokens - 1) * params.beam_width
        pool = self.scheduler.allocator.pool.num_blocks
        if blocks > pool:
            raise RequestError(f"the request needs {blocks} KV blocks; the pool has {pool}")
        generator = None if params.greedy else make_generator(params.seed)
        constraint = None if params.structured is None else self.grammars.constraint(params.structured)
        return SequenceState(request_id, decoder_prompt, params, generator, source=source, constraint=constraint)

    def check_token_ids(self, params: SamplingParams) -> None:
        """Raises RequestError when a token id the parameters name (stop_token_ids, logit_bias) is not in the
        vocabulary."""
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            outside = sorted(token for token in ids if not 0 <= token < self.vocab_size)
            if outside:
                raise RequestError(f"{name} token ids must be in [0, {self.vocab_size}), got {outside[:8]}")

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids, checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: pass the prompt as a list of token ids")
            try:
                ids = self.tokenizer.encode(prompt)
            except (TypeError, ValueError) as err:  # e.g. a lone UTF-16 surrogate from a JSON body
                raise RequestError(f"the prompt cannot be tokenized: {err}") from None
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty; send at least one token")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {min(ids)}..{max(ids)}")
        return ids
