"""`Engine`: batched, streaming generation on a paged KV cache with continuous batching.

One `step()` asks the scheduler for a plan, runs the model once over every scheduled sequence, samples a
token for each sequence whose pending tokens are all in the cache, and reports what each request produced.
Requests join between steps as soon as blocks are free and leave the moment they stop. The engine serves
decoder-only models (the prompt starts the sequence) and encoder-decoder models (the prompt is the source;
the decoder starts from <s>) alike.

With a draft model (`Engine(model, draft=small_model)`, decoder-only), every decode step is speculative: the
draft proposes up to `num_speculative_tokens` tokens per sequence, the target scores them all in one forward,
and the rejection scheme of speculative.py keeps a prefix of them plus one token of the target's, so greedy
output is the target's own and sampled output follows the target's distribution.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tformer.config import ConfigError
from tformer.inference.beams import BeamGroup
from tformer.inference.outputs import Completion, RequestOutput, accumulate
from tformer.inference.paged import BlockAllocator, kv_bytes_per_token, paged_cache_for
from tformer.inference.runner import StepBatch, group_by_width, make_runner
from tformer.inference.sampling import RequestError, SamplingParams, make_generator, sample_token, sampling_probs
from tformer.inference.scheduler import Scheduler, Sequence, Status
from tformer.inference.speculative import Drafter, SpeculativeStats, accept_draft, check_draft
from tformer.inference.text import TextTracker, Tokenizer
from tformer.models import DecoderLM, EncoderDecoder, TransformerModel


@dataclass
class EngineConfig:
    """Sizes of the engine: KV block size and count, the per-step token budget, concurrency and context.

    `num_blocks` 0 sizes the pool to `kv_cache_bytes`, capped at what `max_seqs` sequences of the full
    context need. A `block_size` equal to the context preallocates each sequence contiguously.
    """

    block_size: int = 16
    num_blocks: int = 0
    kv_cache_bytes: int = 1 << 30
    max_batched_tokens: int = 512  # per step; a longer prompt is prefilled in chunks of this size
    max_seqs: int = 64
    max_model_len: int = 0  # 0: the model's max_seq_len
    prefix_caching: bool = True
    compile: bool = False  # decode steps through torch.compile (see runner.py)
    num_speculative_tokens: int = 4  # draft tokens per decode step, when the engine has a draft model

    def __post_init__(self) -> None:
        for name, least in (
            ("block_size", 1),
            ("num_blocks", 0),
            ("kv_cache_bytes", 1),
            ("max_batched_tokens", 1),
            ("max_seqs", 1),
            ("max_model_len", 0),
            ("num_speculative_tokens", 1),
        ):
            if getattr(self, name) < least:
                raise ConfigError(f"EngineConfig.{name} must be at least {least}, got {getattr(self, name)}")


class Engine:
    """Generates for many requests at once: `generate(prompts, params)`, `stream(prompt, params)`, `step()`."""

    def __init__(
        self,
        model: TransformerModel,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        draft: DecoderLM | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.runner = make_runner(model, self.config.compile)
        self.max_model_len = self.config.max_model_len or model.config.max_seq_len
        if draft is not None:
            check_draft(model, draft.eval(), self.max_model_len)
        models = [model] if draft is None else [model, draft]
        num_blocks = self._num_blocks(sum(kv_bytes_per_token(m) for m in models))
        self.kv, *draft_kv = [paged_cache_for(m, num_blocks, self.config.block_size) for m in models]
        self.allocator = BlockAllocator(num_blocks, self.config.block_size)
        self.drafter = Drafter(draft, draft_kv[0], self.config.compile) if draft is not None else None
        self.speculative = SpeculativeStats()
        prefix_caching = self.config.prefix_caching and not isinstance(model, EncoderDecoder)
        lookahead = self.config.num_speculative_tokens if draft is not None else 0
        self.scheduler = Scheduler(
            self.allocator,
            self.config.max_batched_tokens,
            self.config.max_seqs,
            prefix_caching=prefix_caching,
            lookahead=lookahead,
            max_model_len=self.max_model_len,
            window=model.config.sliding_window,
        )
        self.sequences: dict[str, Sequence] = {}
        self._beam_groups: dict[str, BeamGroup] = {}
        self._trackers: dict[str, TextTracker] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_block_copies = 0  # copy-on-write copies of shared blocks

    def _num_blocks(self, bytes_per_token: int) -> int:
        if self.config.num_blocks:
            return self.config.num_blocks
        blocks_per_seq = -(-self.max_model_len // self.config.block_size)
        by_memory = self.config.kv_cache_bytes // (bytes_per_token * self.config.block_size)
        return max(blocks_per_seq, min(by_memory, blocks_per_seq * self.config.max_seqs))

    # requests -------------------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a request; raises RequestError (and changes nothing) when it cannot be served."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = self._new_sequence(request_id, self._encode(prompt), params)
        self.sequences[request_id] = seq
        self._trackers[request_id] = TextTracker(self.tokenizer, params.stop)
        if params.beam_width > 1:
            eos = self._eos_ids()
            self._beam_groups[request_id] = BeamGroup(seq, -1 if params.ignore_eos or not eos else min(eos))
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancels a request, every sample or beam of it (a client went away): its blocks return to the pool."""
        group = self._beam_groups.pop(request_id, None)
        for member in group.live if group is not None else []:
            if member.status is not Status.FINISHED:
                self.scheduler.finish(member, "abort")
        first = self.sequences.get(request_id)
        n = first.params.n if first is not None else 1
        for key in [_key(request_id, i) for i in range(n)]:
            seq = self.sequences.pop(key, None)
            self._trackers.pop(key, None)
            if seq is not None and seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_blocks_in_use(self) -> int:
        """KV blocks some live request holds (cached free blocks do not count)."""
        return self.allocator.pool.num_used

    def _encode(self, prompt: str | Seq[int]) -> list[int]:
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
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        return ids

    def _new_sequence(self, request_id: str, ids: list[int], params: SamplingParams) -> Sequence:
        generator = None if params.greedy else make_generator(params.seed)
        if isinstance(self.model, EncoderDecoder):
            if len(ids) > self.max_model_len:
                raise RequestError(f"the source has {len(ids)} tokens; the model reads at most {self.max_model_len}")
            prompt, source = [self._bos_id()], ids
        else:
            prompt, source = ids, None
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.max_model_len}; shorten it"
            )
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"max_tokens={params.max_tokens} is beyond the limit: the prompt's {len(prompt)} tokens plus "
                f"max_tokens exceed the context of {self.max_model_len}; use max_tokens <= "
                f"{self.max_model_len - len(prompt)}"
            )
        # every beam may need its own blocks in the end; a beam group that fits alone can always make progress
        blocks = self._blocks_per_sequence(len(prompt) + params.max_tokens) * params.beam_width
        if blocks > self.allocator.pool.num_blocks:
            raise RequestError(f"the request needs {blocks} KV blocks; the pool has {self.allocator.pool.num_blocks}")
        return Sequence(request_id, prompt, params, generator, source=source)

    def _blocks_per_sequence(self, n_tokens: int) -> int:
        """The most blocks a sequence of n_tokens holds at once: all of them, or under a sliding window (without a
        draft) the window's blocks plus those of one step's new tokens, and one more a window may straddle."""
        needed = self.allocator.blocks_needed([], n_tokens)
        window = self.model.config.sliding_window
        if window is None or self.scheduler.lookahead:
            return needed
        return min(needed, self.allocator.blocks_needed([], window + self.config.max_batched_tokens) + 1)

    def _bos_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_id", None)
        return 1 if bos is None else bos

    def _eos_ids(self) -> set[int]:
        eos = getattr(self.tokenizer, "eos_id", None)
        return set() if eos is None else {eos}

    # the loop -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch; returns one output per request that produced a token or finished."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        self.num_preemptions += len(plan.preempted)
        self.num_block_copies += len(plan.copies)
        self.kv.copy_blocks(plan.copies)
        if self.drafter is not None:
            self.drafter.kv.copy_blocks(plan.copies)
        outputs = []
        for group in group_by_width([item for item in plan.scheduled if item[0] not in plan.drafts]):
            outputs += self._run(group)
        if plan.drafts:
            outputs += self._speculate(list(plan.drafts), list(plan.drafts.values()))
        return outputs

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """One forward over sequences with their new tokens; samples where a sequence's tokens are all cached."""
        seqs = [seq for seq, _ in scheduled]
        for seq in seqs:
            self.runner.start(seq)
        chunks = [seq.tokens[seq.n_computed : seq.n_computed + n] for seq, n in scheduled]
        batch = StepBatch.build(chunks, [seq.n_computed for seq in seqs], self.kv.k[0].device)
        views = self.kv.step_views([seq.table for seq in seqs], batch.positions)
        logits = self.runner.logits(seqs, batch, views)  # (B, V)
        if self.drafter is not None:
            self.drafter.follow(seqs, batch)
        outputs = []
        for row, (seq, n) in enumerate(scheduled):
            seq.n_computed += n
            self.scheduler.computed(seq)
            if seq.n_pending == 0 and seq.params.beam_width > 1:
                outputs += self._beam_step(seq, logits[row])
            elif seq.n_pending == 0:
                forks = self._fork(seq) if not seq.output and seq.params.n > 1 else []
                for member in [seq, *forks]:  # samples of one prompt draw their first tokens from the same logits
                    member.output.append(sample_token(logits[row], member.params, member.generator))
                    outputs.append(self._emit(member))
        return outputs

    def _speculate(self, seqs: list[Sequence], lengths: list[int]) -> list[RequestOutput]:
        """One speculative decode step: lengths[i] draft tokens for seqs[i] (the positions the scheduler
        reserved), one target forward over each sequence's pending token and its drafts, then the rejection
        scheme decides which tokens each sequence keeps."""
        assert self.drafter is not None
        proposals, draft_probs = self.drafter.propose(seqs, lengths)
        chunks = [[seq.tokens[seq.n_computed], *drafted] for seq, drafted in zip(seqs, proposals, strict=True)]
        batch = StepBatch.build(chunks, [seq.n_computed for seq in seqs], self.kv.k[0].device)
        views = self.kv.step_views([seq.table for seq in seqs], batch.positions)
        logits = self.runner.logits(seqs, batch, views, every_position=True)  # (B, 1 + drafts, V)
        self.speculative.target_calls += 1
        outputs = []
        for row, (seq, drafted, q) in enumerate(zip(seqs, proposals, draft_probs, strict=True)):
            p = torch.stack([sampling_probs(logits[row, i], seq.params) for i in range(len(drafted) + 1)])
            kept = accept_draft(drafted, q, p, seq.generator)
            self.speculative.proposed += len(drafted)
            self.speculative.accepted += len(kept) - 1
            seq.n_computed += len(kept)  # the pending token and the accepted drafts; the last kept one is pending
            seq.draft_computed = min(seq.draft_computed, seq.n_computed)
            self.scheduler.computed(seq)
            for token in kept:
                seq.output.append(token)
                outputs.append(self._emit(seq))
                if outputs[-1].finished:
                    break
        return outputs

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of a request whose prompt is now cached: each shares every block of the prompt."""
        children = []
        for i in range(1, seq.params.n):
            seed = None if seq.params.seed is None else seq.params.seed + i
            child = Sequence(
                seq.request_id,
                seq.prompt,
                seq.params,
                None if seq.params.greedy else make_generator(seed),
                table=self.allocator.fork(seq.table),
                n_computed=seq.n_computed,
                draft_computed=seq.draft_computed,
                status=Status.RUNNING,
                source=seq.source,
                encoder_state=seq.encoder_state,
                index=i,
            )
            self.sequences[_key(seq.request_id, i)] = child
            self._trackers[_key(seq.request_id, i)] = TextTracker(self.tokenizer, seq.params.stop)
            self.scheduler.running.append(child)
            children.append(child)
        return children

    def _beam_step(self, seq: Sequence, logits: torch.Tensor) -> list[RequestOutput]:
        """A beam's next-token logits; once the request's live beams all have theirs, the beams move on.

        Beam search streams nothing until it ends: then one output carries the best hypothesis whole.
        """
        group = self._beam_groups[seq.request_id]
        if not group.record(seq, logits):
            return []
        old = group.live
        new = group.advance(self.allocator)  # forks the new beams before the old ones release their blocks
        for member in old:
            self.scheduler.finish(member, "beam")
        if new is not None:
            self.scheduler.running += new
            return []
        del self._beam_groups[seq.request_id]
        tokens, ended = group.result()
        tracker = self._trackers[seq.request_id]
        text, _ = tracker.push(tokens, stop_token=ended)
        reason = "stop" if ended else "length"
        return [RequestOutput(seq.request_id, tokens, text + tracker.flush(), True, reason)]

    def _emit(self, seq: Sequence) -> RequestOutput:
        token = seq.output[-1]
        params = seq.params
        tracker = self._trackers[_key(seq.request_id, seq.index)]
        reason = None
        if token in params.stop_token_ids or (token in self._eos_ids() and not params.ignore_eos):
            reason = "stop"
        text, hit_stop = tracker.push(seq.output, stop_token=reason is not None)
        if hit_stop:
            reason = "stop"
        elif reason is None and (len(seq.output) >= params.max_tokens or len(seq.tokens) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            text += tracker.flush() if not hit_stop else ""
            self.scheduler.finish(seq, reason)
        return RequestOutput(seq.request_id, [token], text, reason is not None, reason, seq.index)

    # convenience ----------------------------------------------------------------------------------------

    def generate(
        self, prompts: str | Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[Completion]:
        """Runs every prompt to completion (continuous batching among them).

        Results come in prompt order, and for a prompt with n samples, its n completions by `index`.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        done = {
            (rid, i): Completion(rid, list(self.sequences[rid].source or self.sequences[rid].prompt), index=i)
            for rid, sp in zip(ids, params_list, strict=True)
            for i in range(sp.n)
        }
        while any(c.finish_reason is None for c in done.values()):
            for out in self.step():
                if (out.request_id, out.index) in done:
                    accumulate(done[out.request_id, out.index], out)
        for rid in ids:
            self.abort(rid)  # finished already: this only forgets the request
        return list(done.values())

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields the request's tokens and text as they are produced (other requests keep running).

        With n > 1 samples, outputs of all samples interleave; `index` tells them apart.
        """
        params = params or SamplingParams()
        rid = self.add_request(prompt, params)
        try:
            unfinished = params.n
            while unfinished:
                for out in self.step():
                    if out.request_id == rid:
                        unfinished -= out.finished
                        yield out
        finally:
            self.abort(rid)


def _key(request_id: str, index: int) -> str:
    """The engine's key of sample `index` of a request: sample 0 is the request itself."""
    return request_id if index == 0 else f"{request_id}#{index}"
