"""Continuous batching: a scheduler that only keeps books (vLLM v1 style).

The scheduler owns its queues: `add_request` puts a new sequence in the waiting queue, `add_running` a fork of
a running one (a parallel sample, a beam), `schedule` plans a step, `update_from_output` books what the step
computed (once per step), and `finish` ends a sequence. The engine only reads the queues.

Each step it decides which sequences run and how many of their tokens: running sequences first, in order of
arrival (a decode step is one token; an unfinished prompt continues in chunks), then waiting ones as long as
the token budget, the sequence limit and the free KV blocks allow. A waiting prompt first takes whatever prefix
the cache already holds. When blocks run out, the latest arrival among the running sequences is preempted (the
samples and beams of a request share its arrival; among them, the last): its blocks go back to the pool and it
waits to be recomputed from scratch, keeping the tokens it has generated so far.

With `static_batching` the scheduler batches as Hugging Face `generate` and FasterTransformer do, for A/B runs
against continuous batching (benchmarks/engine_claims.py): a batch is admitted while no sequence runs, and stays open
across steps only while the token budget alone held admission back (long prompts prefilled in chunks) and none of
it has begun to decode; the next batch then waits until every sequence of this one has finished.

With speculative decoding (`lookahead` > 0), a decode step verifies up to `lookahead` draft tokens after the
pending one, so the scheduler reserves (and charges the token budget for) that many more positions.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from tformer.engine.blocks import BlockAllocator, BlockCopy, BlockHash
from tformer.engine.sampling import SamplingParams
from tformer.engine.structured import Constraint

if TYPE_CHECKING:
    from tformer.engine.sampler import SamplerOutput


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(eq=False)  # a sequence is itself: two beams or samples with equal fields are still two sequences
class SequenceState:
    """One stream of tokens: its prompt, what it has generated, and its place in the paged cache."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    n_computed: int = 0  # tokens whose keys and values are in the cache
    draft_computed: int = 0  # speculative decoding: tokens whose keys and values are in the draft model's cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrivals))  # its request's: samples and beams share it
    source: list[int] | None = None  # encoder-decoder models: the source the encoder reads
    encoder_state: object = None  # encoder-decoder models: the source's cross-attention keys and values
    index: int = 0  # which of the request's `n` samples this is
    block_hashes: list[BlockHash] = field(default_factory=list)  # prefix-cache keys of its published blocks
    constraint: Constraint | None = None  # structured outputs: which tokens may come next (structured.py)

    def fork(self, allocator: BlockAllocator, **fields: object) -> SequenceState:
        """A running sequence of the same request that shares every block of this one (copy-on-write) and has
        computed as much; `fields` set the rest (a sample's generator and index, a beam's output)."""
        return SequenceState(
            self.request_id,
            self.prompt,
            self.params,
            table=allocator.fork(self.table),
            n_computed=self.n_computed,
            draft_computed=self.draft_computed,
            status=Status.RUNNING,
            source=self.source,
            encoder_state=self.encoder_state,
            block_hashes=list(self.block_hashes),  # its blocks are this one's: their keys too
            **fields,
        )

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def n_pending(self) -> int:
        return self.length - self.n_computed

    def tokens_between(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without copying the whole sequence (a decode step reads one token)."""
        cut = len(self.prompt)
        if start >= cut:
            return self.output[start - cut : end - cut]
        return self.prompt[start:end] + self.output[: max(0, end - cut)]


@dataclass
class SchedulerOutput:
    """One step's plan: which sequences run with how many new tokens, and the blocks to copy first."""

    scheduled: list[tuple[SequenceState, int]] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)
    drafts: dict[SequenceState, int] = field(default_factory=dict)  # draft positions reserved for a decode step


class Scheduler:
    """Chooses each step's batch under a token budget, a sequence limit and the KV block pool."""

    def __init__(
        self,
        allocator: BlockAllocator,
        max_batched_tokens: int = 512,
        max_seqs: int = 64,
        prefix_caching: bool = True,
        lookahead: int = 0,
        max_model_len: int | None = None,
        window: int | None = None,
        static_batching: bool = False,
    ) -> None:
        self.allocator = allocator
        self.static_batching = static_batching
        self._batch_open = True  # static batching: whether waiting requests may still join the running batch
        self.window = window  # a sliding window: blocks wholly before it go back to the pool
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.prefix_caching = prefix_caching
        self.lookahead = lookahead  # speculative decoding: draft tokens a decode step may verify
        self.max_model_len = max_model_len
        self.prefix_hit_tokens = 0  # prompt tokens whose keys and values came from the prefix cache
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # in order of arrival: the last is the first to be preempted

    def add_request(self, seq: SequenceState) -> None:
        """A new sequence waits for its first step."""
        self.waiting.append(seq)

    def add_running(self, seqs: list[SequenceState]) -> None:
        """Forks of a running sequence (parallel samples, the next beams): they already hold blocks and run next step,
        in their request's place among the running."""
        for seq in seqs:
            seq.status = Status.RUNNING
            self._insert_running(seq)

    def max_blocks_held(self, n_tokens: int) -> int:
        """The most blocks a sequence of n_tokens holds at once: all of them, or under a sliding window (without a
        draft) the window's blocks plus those of one step's new tokens, and one more a window may straddle."""
        needed = self.allocator.blocks_needed([], n_tokens)
        if self.window is None or self.lookahead:
            return needed
        return min(needed, self.allocator.blocks_needed([], self.window + self.max_batched_tokens) + 1)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def draft_length(self, seq: SequenceState) -> int:
        """Draft tokens the next step of `seq` may verify: none for a prompt, a beam, a request with penalties, a
        logit bias, logprobs or a structured output, or without a draft, and never more than its max_tokens or the
        context leave room for."""
        params = seq.params
        if not self.lookahead or seq.n_pending != 1 or not seq.output or params.beam_width > 1:
            return 0
        if params.adjusts_logits or params.logprobs is not None or params.structured is not None:
            return 0  # verified drafts would need the adjustments, log-probabilities or masks per position
        room = seq.params.max_tokens - len(seq.output) - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.length)
        return max(0, min(self.lookahead, room))

    def update_from_output(self, plan: SchedulerOutput, output: SamplerOutput) -> None:
        """Books what a step computed, once per step (vLLM v1's): every scheduled sequence's new tokens, and for a
        speculative one the pending token and the drafts it kept (`output.kept`); the draft's cache rolls back to
        them."""
        for seq, n in plan.scheduled:
            if seq in plan.drafts:
                n = output.kept[seq]
                seq.draft_computed = min(seq.draft_computed, seq.n_computed + n)
            self.record_computed(seq, n)

    def record_computed(self, seq: SequenceState, n_new: int) -> None:
        """After a step computed the keys and values of n_new more tokens of `seq`: its newly full blocks become
        prefix-cache entries, and under a sliding window the blocks no later token can see go back to the pool.

        Each block is hashed once (`seq.block_hashes` remembers them), so a step costs the same at any length.
        With a draft model, a block is published only once the draft's keys and values in it are complete too.
        """
        seq.n_computed += n_new
        n = min(seq.n_computed, seq.draft_computed) if self.lookahead else seq.n_computed
        if self.prefix_caching and n // self.allocator.block_size > len(seq.block_hashes):
            self.allocator.register_prefix(seq.table, seq.tokens, n, seq.block_hashes)
        if self.window is not None and not self.lookahead:  # a draft may roll back and its own cache may be full
            self.allocator.release_before(seq.table, seq.n_computed - self.window + 1)

    def finish(self, seq: SequenceState, reason: str) -> None:
        """Ends a sequence (stopped, cancelled or rejected) and returns its blocks to the pool."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.allocator.free(seq.table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.n_pending == 0:  # a beam waiting for its siblings' logits (engine beam search)
                i += 1
                continue
            n = min(seq.n_pending, budget)
            extra = self.draft_length(seq)
            while not self.allocator.can_write(seq.table, seq.n_computed, seq.n_computed + n + extra):
                victim = self.running[-1]  # the latest arrival: the list is in order of arrival
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            self._reserve(seq, n, out, extra)
            budget -= n + extra
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if self.static_batching:
            if not self.running:
                self._batch_open = True
            elif not self._batch_open or any(seq.output for seq in self.running):
                return  # the batch has begun to decode: nothing joins it
        budget = self._admit_waiting(out, budget)
        if self.static_batching:  # left open only when the budget ran out before the batch or the queue did
            self._batch_open = bool(self.waiting) and budget <= 0 and len(self.running) < self.max_seqs

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admits waiting sequences in order while the budget, the sequence limit and the blocks allow; returns the
        budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            # a request asking its prompt's log-probabilities computes every prompt token
            if self.prefix_caching and seq.n_computed == 0 and not seq.table and seq.params.prompt_logprobs is None:
                # keep at least one token to compute: its logits give the next token
                max_hits = (len(seq.tokens) - 1) // self.allocator.block_size
                seq.table = self.allocator.match_prefix(seq.tokens, max_hits, seq.block_hashes)
                seq.n_computed = seq.draft_computed = len(seq.table) * self.allocator.block_size
                self.prefix_hit_tokens += seq.n_computed
            n = min(seq.n_pending, budget)
            extra = self.draft_length(seq)  # a recomputed sequence whose prefix was all cached is a decode step
            if not self.allocator.can_write(seq.table, seq.n_computed, seq.n_computed + n + extra):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self._insert_running(seq)
            self._reserve(seq, n, out, extra)
            budget -= n + extra
        return budget

    def _reserve(self, seq: SequenceState, n: int, out: SchedulerOutput, extra: int = 0) -> None:
        """Blocks for `n` new tokens plus `extra` draft positions; the plan records both."""
        end = seq.n_computed + n + extra
        self.allocator.grow(seq.table, end)
        out.copies += self.allocator.copy_on_write(seq.table, seq.n_computed, end)
        out.scheduled.append((seq, n))
        if extra:
            out.drafts[seq] = extra

    def _insert_running(self, seq: SequenceState) -> None:
        """Keeps `running` in order of arrival; a sequence goes after those that arrived with it or before."""
        bisect.insort_right(self.running, seq, key=lambda s: s.arrival)

    def _preempt(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.table)
        seq.n_computed = seq.draft_computed = 0
        seq.block_hashes.clear()  # its blocks are gone; a prefix hit on readmission refills the keys
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
