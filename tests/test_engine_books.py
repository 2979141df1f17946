"""The engine's books: the prefix cache's block keys, which sequence is preempted, and how samples are keyed.

Each test runs the engine against the plain uncached forward or the offline beam search, and checks the books
against what the scheduler's and the pool's documented rules say."""

from __future__ import annotations

import torch
from conftest import make_model, tiny_config
from helpers import prompts_of_mixed_lengths, reference_greedy

from tformer.decoding.search import beam_search_decoder
from tformer.engine import blocks
from tformer.engine.blocks import BlockAllocator, BlockHash
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import SamplingParams
from tformer.engine.scheduler import Scheduler, SequenceState

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_each_full_block_is_hashed_once_however_many_steps(monkeypatch) -> None:
    """A 512-token prompt and 64 decode steps in blocks of 16: 32 + 4 block keys in all, not a chain per step."""
    made: list[BlockHash] = []

    class CountedHash(BlockHash):
        __slots__ = ()

        def __init__(self, parent: BlockHash | None, tokens: tuple[int, ...]) -> None:
            super().__init__(parent, tokens)
            made.append(self)

    monkeypatch.setattr(blocks, "BlockHash", CountedHash)
    allocator = BlockAllocator(num_blocks=40, block_size=16)
    scheduler = Scheduler(allocator, prefix_caching=True)
    tokens = torch.randint(0, 1000, (512 + 64,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = SequenceState("a", tokens[:512], SamplingParams(max_tokens=64))
    allocator.grow(seq.table, 512 + 64)
    scheduler.record_computed(seq, 512)
    for token in tokens[512:]:
        seq.output.append(token)
        scheduler.record_computed(seq, 1)
    assert len(made) == 36 and len(allocator.pool.cached) == 36
    # the keys are those of the whole prefix: a new sequence with the same tokens finds all 36 blocks
    assert allocator.match_prefix(tokens, max_blocks=36) == seq.table


def test_equal_hashes_of_different_prefixes_are_different_keys() -> None:
    """A key identifies its whole prefix: a forged hash collision (same hash, same last block, another first block)
    must not hit the cache."""
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    table: list[int] = []
    allocator.grow(table, 4)
    allocator.register_prefix(table, [1, 2, 3, 4], n_computed=4)
    stored = allocator.pool.key_of[table[1]]
    forged = BlockHash(BlockHash(None, (9, 9)), (3, 4))
    forged.value = stored.value  # a collision of the 64-bit hash
    assert hash(forged) == hash(stored) and forged != stored
    assert allocator.pool.lookup(forged) is None
    assert allocator.pool.lookup(BlockHash(BlockHash(None, (1, 2)), (3, 4))) == table[1]  # an equal chain hits


def test_preemption_takes_the_latest_arrival_even_after_beams_advance() -> None:
    """A beam request arrives first, a greedy one later, and the pool cannot hold both to the end: the documented
    policy preempts the later arrival, however often the beams are forked anew (each step makes new sequences)."""
    model = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size, (8, 8))
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=10, max_batched_tokens=64))
    beams = SamplingParams(max_tokens=12, beam_width=2, length_penalty=0.6)
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def spy():  # what each step's plan preempted
        plan = schedule()
        preempted.extend(seq.request_id for seq in plan.preempted)
        return plan

    engine.scheduler.schedule = spy
    first = engine.add_request(prompts[0], beams)
    outputs: dict[str, list[int]] = {first: []}
    for out in engine.step():
        outputs[out.request_id] += out.token_ids
    later = engine.add_request(prompts[1], GREEDY)
    outputs[later] = []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
    assert preempted and set(preempted) == {later}
    assert outputs[first] == beam_search_decoder(model, [prompts[0]], 12, -1, 2, 0.6)[0]
    assert outputs[later] == reference_greedy(model, prompts[1], 12)
    assert engine.num_blocks_in_use == 0


def test_a_request_id_like_a_sample_key_is_its_own_request() -> None:
    """Request "a#1" beside request "a" with two samples: aborting "a#1" must leave both samples of "a" running
    (samples are keyed by (request_id, index), not by "a#1")."""
    model = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size, (6, 9))
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=32))
    engine.add_request(prompts[0], SamplingParams(max_tokens=8, temperature=0.0, n=2), request_id="a")
    engine.add_request(prompts[1], GREEDY, request_id="a#1")
    outputs: dict[tuple[str, int], list[int]] = {}
    finished: dict[tuple[str, int], str | None] = {}
    for out in engine.step():  # both prompts run; "a" forks its second sample
        outputs.setdefault((out.request_id, out.index), []).extend(out.token_ids)
    engine.abort("a#1")
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).extend(out.token_ids)
            finished[out.request_id, out.index] = out.finish_reason
    expected = reference_greedy(model, prompts[0], 8)
    assert outputs["a", 0] == outputs["a", 1] == expected
    assert finished == {("a", 0): "length", ("a", 1): "length"}  # nothing more from "a#1" after its abort
    assert len(outputs["a#1", 0]) == 1
    engine.abort("a")
    assert engine.num_blocks_in_use == 0 and not engine.requests
