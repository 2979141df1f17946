"""`Engine`: batched, streaming generation on a paged KV cache with continuous batching.

One `step()` reads as vLLM v1's: the scheduler plans (schedule), the runner runs the model once over every
scheduled sequence (execute), the `Sampler` (sampler.py) chooses a token for each sequence whose pending tokens
are all in the cache (sample), the scheduler books what the step computed in one `update_from_output`, and the
outputs report what each request produced.
Requests join between steps as soon as blocks are free and leave the moment they stop. The engine serves
decoder-only models (the prompt starts the sequence) and encoder-decoder models (the prompt is the source;
the decoder starts from <s>) alike.

With a draft model (`Engine(model, draft=small_model)`, decoder-only), every decode step is speculative: the
draft proposes up to `num_speculative_tokens` tokens per sequence, the target scores them all in one forward,
and the rejection scheme of speculative.py keeps a prefix of them plus one token of the target's, so greedy
output is the target's own and sampled output follows the target's distribution.

The engine coordinates; the books are elsewhere (vLLM v1's split): `InputProcessor` (requests.py) checks a
prompt and builds its sequence under the context rule (`ContextWindow`, `engine.context`), the family's runner
(runner.py) holds the family's rules and runs the model, the `Sampler` chooses tokens, the `Scheduler` owns the
queues and the `BlockAllocator` the blocks, beams.py moves beams on, and the `OutputProcessor` (outputs.py)
detokenizes and applies the stop rules.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from tformer.config import ConfigError
from tformer.engine.beams import BeamGroup, SourceBeams
from tformer.engine.blocks import BlockAllocator
from tformer.engine.outputs import Completion, OutputProcessor, RequestFailure, RequestOutput, accumulate
from tformer.engine.paged import KV_CACHE_DTYPES, kv_bytes_per_token, paged_cache_for
from tformer.engine.requests import ContextWindow, InputProcessor, Request
from tformer.engine.runner import StepBatch, group_by_width, make_runner, step_inputs
from tformer.engine.sampler import ModelOutput, Sampled, Sampler, SamplerOutput, ScoredRows, Verification, isolated
from tformer.engine.sampling import RequestError, SamplingParams, TokenLogprob
from tformer.engine.scheduler import Scheduler, SchedulerOutput, SequenceState, Status
from tformer.engine.speculative import Drafter, SpeculativeStats, check_draft
from tformer.engine.text import TextCodec
from tformer.models import DecoderLM, TransformerModel

logger = logging.getLogger(__name__)


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
    pack_prompts: bool = True  # a step's prompt chunks in one row, where the model allows it (see packing.py)
    num_speculative_tokens: int = 4  # draft tokens per decode step, when the engine has a draft model
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "int8": int8 keys and values with scales (paged.py)
    static_batching: bool = False  # admit a new batch only when the last has finished (scheduler.py), for A/Bs

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
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

    generates = True  # an encoder's EmbeddingEngine (embedding.py), which serves embeddings only, does not

    def __init__(
        self,
        model: TransformerModel,
        tokenizer: TextCodec | None = None,
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
        kv_dtype = self.config.kv_cache_dtype
        num_blocks = self._num_blocks(sum(kv_bytes_per_token(m, kv_dtype) for m in models))
        self.kv, *draft_kv = [paged_cache_for(m, num_blocks, self.config.block_size, kv_dtype) for m in models]
        self.allocator = BlockAllocator(num_blocks, self.config.block_size)
        self.drafter = Drafter(draft, draft_kv[0], self.config.compile) if draft is not None else None
        self.speculative = SpeculativeStats()
        self.scheduler = Scheduler(
            self.allocator,
            self.config.max_batched_tokens,
            self.config.max_seqs,
            prefix_caching=self.config.prefix_caching and self.runner.prefix_caching,
            lookahead=self.config.num_speculative_tokens if draft is not None else 0,
            max_model_len=self.max_model_len,
            window=model.config.shared_window,  # blocks go back only when no layer can see them
            static_batching=self.config.static_batching,
        )
        self.context = ContextWindow(self.runner, self.max_model_len)
        self.outputs = OutputProcessor(tokenizer, self.context)
        self.inputs = InputProcessor(
            self.runner, tokenizer, model.config.vocab_size, self.context, self.scheduler, self.outputs.eos_ids
        )
        self.sampler = Sampler(self.outputs.eos_ids, self.speculative)
        # an encoder-decoder's beam requests: searched in batches by the offline search (beams.py), not as sequences
        self.source_beams = SourceBeams.of(model)
        self.requests: dict[str, Request] = {}
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
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a request; raises RequestError (and changes nothing) when it cannot be served."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = self.inputs.new_sequence(request_id, prompt, params)
        request = Request(request_id, params, [seq])
        eos = self.outputs.eos_ids
        eos_id = -1 if params.ignore_eos or not eos else min(eos)
        by_source = params.beam_width > 1 and self.source_beams is not None
        if params.beam_width > 1 and not by_source:
            request.beams = BeamGroup(seq, eos_id)
            request.samples = []
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token has no context to be predicted from
        self.requests[request_id] = request
        try:
            self.outputs.add(request_id, 0, params)
            if by_source:  # the sequence only carries the request's source and settings
                self.source_beams.add(seq, eos_id)
            else:
                self.scheduler.add_request(seq)
        except BaseException:  # nothing of a refused request stays in the books
            self.abort(request_id)
            raise
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancels a request, every sample or beam of it (a client went away): its blocks return to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if self.source_beams is not None:
            self.source_beams.discard(request_id)
        for seq in request.sequences():
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
        self.outputs.forget(request_id, request.params.n)

    def finish_request(self, request_id: str, reason: str) -> list[RequestOutput]:
        """Ends a request from outside (a timeout, say): the last output of each unfinished sample (a beam search's
        one), with `reason` as its finish reason and the text it held back; its blocks return to the pool."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        seqs = request.sequences()
        ends = {  # samples not forked yet end too; a beam search's beams end as one output
            seq.index: self.outputs.finish(seq, reason) for seq in seqs if seq.status is not Status.FINISHED
        }
        if request.beams is None:
            finished = {seq.index for seq in seqs if seq.status is Status.FINISHED}
            for index in range(request.params.n):
                if index not in finished and index not in ends:
                    ends[index] = RequestOutput(request_id, [], "", True, reason, index)
        self.abort(request_id)
        return [ends[index] for index in sorted(ends)]

    def _fail(self, seq: SequenceState, err: BaseException) -> RequestOutput:
        """Fails the request of `seq` alone: its sequences end, their blocks return to the pool, and one output
        says why (it ends all its samples)."""
        client = isinstance(err, RequestError)
        trace = None if client else err
        logger.warning("request %s failed: %s: %s", seq.request_id, type(err).__name__, err, exc_info=trace)
        self.abort(seq.request_id)
        message = str(err) if client else f"the request failed in the engine: {type(err).__name__}: {err}"
        return RequestOutput(seq.request_id, [], "", True, "error", error=RequestFailure(message, client))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.source_beams is not None and self.source_beams.has_work())

    @property
    def num_blocks_in_use(self) -> int:
        """KV blocks some live request holds (cached free blocks do not count)."""
        return self.allocator.pool.num_used

    # the loop -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step, read as vLLM v1's: the scheduler's plan, the runner's forwards, the sampler's tokens, one update
        of the scheduler's books, then the outputs (forks and beams move on, text is detokenized, stop rules
        end sequences). Returns one output per request that produced a token or finished. A batch of an
        encoder-decoder's waiting beam requests is searched first (beams.py)."""
        outputs = self._search_sources() if self.source_beams is not None and self.source_beams.has_work() else []
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return outputs
        self._copy_blocks(plan)
        model_output = self._execute(plan)
        sampled = self.sampler.sample(model_output)
        self.scheduler.update_from_output(plan, sampled)
        return outputs + self._process(sampled)

    def _search_sources(self) -> list[RequestOutput]:
        """One batch of beam requests through the offline search: each gets its one output, its best hypothesis."""
        assert self.source_beams is not None
        return [self.outputs.beam_result(rid, tokens, ended) for rid, tokens, ended in self.source_beams.run()]

    def _copy_blocks(self, plan: SchedulerOutput) -> None:
        self.num_preemptions += len(plan.preempted)
        self.num_block_copies += len(plan.copies)
        self.kv.copy_blocks(plan.copies)
        if self.drafter is not None:
            self.drafter.kv.copy_blocks(plan.copies)

    def _execute(self, plan: SchedulerOutput) -> ModelOutput:
        """The runner's forwards over the plan: a forward per group of similar widths (prompt chunks packed in one
        row where the model allows it), then the speculative sequences' drafts and their verification."""
        output = ModelOutput()
        scheduled = [item for item in plan.scheduled if item[0] not in plan.drafts]
        # asked only of a step with prompt chunks: `packs` walks every layer, a cost decode steps need not pay
        # (docs/design-notes.md, "engine/engine.py")
        pack = self.config.pack_prompts and any(n > 1 for _, n in scheduled) and self.runner.packs()
        for group in group_by_width(scheduled, pack=pack):
            output.scored.append(self._forward(group, pack))
        if plan.drafts:
            output.verification = self._verify_drafts(list(plan.drafts), list(plan.drafts.values()))
        return output

    def _forward(self, scheduled: list[tuple[SequenceState, int]], pack: bool = False) -> ScoredRows:
        """One forward over sequences with their new tokens (prompt chunks packed in one row with `pack`); the rows
        whose tokens will all be cached are due a next token."""
        seqs = [seq for seq, _ in scheduled]
        for seq in seqs:
            self.runner.start(seq)
        chunks = [seq.tokens_between(seq.n_computed, seq.n_computed + n) for seq, n in scheduled]
        starts = [seq.n_computed for seq in seqs]
        batch, views = step_inputs(self.kv, [seq.table for seq in seqs], chunks, starts, pack)
        recording = [row for row, seq in enumerate(seqs) if self.requests[seq.request_id].records_prompt(seq)]
        if recording:  # logits after every token of the step: a request asks its prompt's log-probabilities
            every = self.runner.logits(seqs, batch, views, every_position=True)  # (B, T, V), or (1, N, V) packed
            logits = batch.last_hidden(every)  # (B, V)
            for row in recording:
                last, n = int(batch.last_index[row]), len(chunks[row])
                after_each = every[0 if batch.packed else row, last - n + 1 : last + 1]  # (n, V)
                self.requests[seqs[row].request_id].record_prompt(seqs[row], starts[row], after_each)
        else:
            logits = self.runner.logits(seqs, batch, views)  # (B, V)
        if self.drafter is not None:
            self.drafter.follow(seqs, chunks, starts, self.config.pack_prompts)
        return ScoredRows(logits, [(row, seq) for row, (seq, n) in enumerate(scheduled) if n == seq.n_pending])

    def _verify_drafts(self, seqs: list[SequenceState], lengths: list[int]) -> Verification:
        """lengths[i] draft tokens for seqs[i] (the positions the scheduler reserved), then one target forward over
        each sequence's pending token and its drafts; the sampler decides which tokens each sequence keeps."""
        assert self.drafter is not None
        proposals, draft_probs = self.drafter.propose(seqs, lengths)
        chunks = [
            [seq.tokens_between(seq.n_computed, seq.n_computed + 1)[0], *drafted]
            for seq, drafted in zip(seqs, proposals, strict=True)
        ]
        batch = StepBatch.build(chunks, [seq.n_computed for seq in seqs], self.kv.k[0].device)
        views = self.kv.step_views([seq.table for seq in seqs], batch.positions)
        logits = self.runner.logits(seqs, batch, views, every_position=True)  # (B, 1 + drafts, V)
        self.speculative.target_calls += 1
        return Verification(seqs, proposals, draft_probs, logits)

    def _process(self, sampled: SamplerOutput) -> list[RequestOutput]:
        """The sampled tokens become outputs: a request's first token forks its other samples, a beam's logits go
        to its group, and each new token is detokenized under the stop rules (a sequence that stops is finished)."""
        outputs: list[RequestOutput] = []
        for sample in sampled.samples:
            seq = sample.seq
            if seq.request_id not in self.requests:  # failed earlier in this step (another of its samples)
                continue
            if sample.error is not None:
                outputs.append(self._fail(seq, sample.error))
                continue
            try:
                outputs += self._outputs_of(sample)
            except BaseException as err:  # detokenizing, a stop rule, a beam's books: this request alone
                if not isolated(err):
                    raise
                outputs.append(self._fail(seq, err))
        return outputs

    def _outputs_of(self, sample: Sampled) -> list[RequestOutput]:
        seq = sample.seq
        if sample.beam_logits is not None:
            return self._beam_step(self.requests[seq.request_id], seq, sample.beam_logits)
        forks = []
        if sample.forks:  # forked before the parent may finish and free the prompt's blocks
            forks = self.requests[seq.request_id].fork(seq, self.allocator, sample.forks)
            for child in forks:
                self.outputs.add(seq.request_id, child.index, seq.params)
            self.scheduler.add_running(forks)
        outputs = self._append(seq, sample.tokens, sample.logprob)
        for child, fork in zip(forks, sample.forks, strict=True):
            outputs += self._append(child, [fork.token], fork.logprob)
        return outputs

    def _append(self, seq: SequenceState, tokens: list[int], logprob: TokenLogprob | None) -> list[RequestOutput]:
        """Appends a sequence's new tokens one by one, an output each, until one stops it."""
        outputs = []
        for token in tokens:
            seq.output.append(token)
            outputs.append(self._emit(seq, logprob))
            if outputs[-1].finished:
                break
        return outputs

    def _beam_step(self, request: Request, seq: SequenceState, logits: torch.Tensor) -> list[RequestOutput]:
        """A beam's next-token logits; once the request's live beams all have theirs, the beams move on.

        Beam search streams nothing until it ends: then one output carries the best hypothesis whole.
        """
        group = request.beams
        assert group is not None
        if not group.record(seq, logits.cpu()):  # a beam group keeps its books on the CPU, whatever the device
            return []
        old = group.live
        new = group.advance(self.allocator)  # forks the new beams before the old ones release their blocks
        for member in old:
            self.scheduler.finish(member, "beam")
        if new is not None:
            for member in new:
                member.arrival = seq.arrival  # the beams keep their request's place in the queue
            self.scheduler.add_running(new)
            return []
        request.beams = None
        return [self.outputs.beam_result(seq.request_id, *group.result())]

    def _emit(self, seq: SequenceState, logprob: TokenLogprob | None = None) -> RequestOutput:
        out = self.outputs.process(seq, logprob)
        request = self.requests[seq.request_id]
        if request.prompt_logprobs is not None and seq.index == 0:  # the request's first output carries them
            out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        if out.finished:
            self.scheduler.finish(seq, out.finish_reason or "stop")
        return out

    # convenience ----------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Runs every prompt to completion (continuous batching among them).

        Results come in prompt order, and for a prompt with n samples, its n completions by `index`. A request
        that failed alone (its finish_reason "error") says why in its `error`; the others run on.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        first = {rid: self.requests[rid].sequences()[0] for rid in ids}
        done = {
            (rid, i): Completion(rid, list(first[rid].source or first[rid].prompt), index=i)
            for rid, sp in zip(ids, params_list, strict=True)
            for i in range(sp.n)
        }
        while any(c.finish_reason is None for c in done.values()):
            for out in self.step():
                if out.error is not None:  # the request failed alone: every sample of it ends with the error
                    for i in range(params_list[ids.index(out.request_id)].n):
                        accumulate(done[out.request_id, i], replace(out, index=i))
                elif (out.request_id, out.index) in done:
                    accumulate(done[out.request_id, out.index], out)
        for rid in ids:
            self.abort(rid)  # finished already: this only forgets the request
        return list(done.values())

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields the request's tokens and text as they are produced (other requests keep running).

        With n > 1 samples, outputs of all samples interleave; `index` tells them apart. A request that fails
        alone ends with one output whose `error` says why.
        """
        params = params or SamplingParams()
        rid = self.add_request(prompt, params)
        try:
            unfinished = params.n
            while unfinished:
                for out in self.step():
                    if out.request_id == rid:
                        unfinished = 0 if out.error is not None else unfinished - out.finished
                        yield out
        finally:
            self.abort(rid)
