"""Static batching (`EngineConfig(static_batching=True)`), the baseline of benchmarks/engine_claims.py: a request joins
only a batch that has not begun to decode, and it decodes the same tokens as continuous batching and the uncached
forward."""

from __future__ import annotations

import pytest
from conftest import make_model, tiny_config
from helpers import prompts_of_mixed_lengths, reference_greedy

from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import SamplingParams

MAX_TOKENS = (9, 2, 5, 1, 7)  # uneven, so a continuous batch refills slots that a static one leaves idle


def run(static: bool, max_batched_tokens: int) -> tuple[int, int]:
    """Runs five requests two at a time; returns the steps taken and how many requests joined a step in which an
    earlier request had already generated tokens (a slot refilled mid-batch)."""
    model = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    config = EngineConfig(
        block_size=4, num_blocks=64, max_seqs=2, max_batched_tokens=max_batched_tokens, static_batching=static
    )
    engine = Engine(model, config=config)
    seen: set[str] = set()
    steps = refills = 0
    schedule = engine.scheduler.schedule

    def spy():
        nonlocal steps, refills
        decoding = any(seq.output for seq in engine.scheduler.running)
        plan = schedule()
        joined = {seq.request_id for seq, _ in plan.scheduled} - seen
        seen.update(joined)
        steps += 1
        refills += len(joined) if decoding else 0
        return plan

    engine.scheduler.schedule = spy
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = [c.token_ids for c in engine.generate(prompts, params)]
    assert outputs == [reference_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]
    assert engine.num_blocks_in_use == 0
    return steps, refills


@pytest.mark.parametrize("budget", [64, 5])  # 5: prompts prefill in chunks, so a batch is admitted over several steps
def test_static_batching_never_refills_a_decoding_batch_and_decodes_the_same_tokens(budget: int) -> None:
    static_steps, static_refills = run(static=True, max_batched_tokens=budget)
    continuous_steps, continuous_refills = run(static=False, max_batched_tokens=budget)
    assert static_refills == 0
    assert continuous_refills > 0  # the count can see a refill
    assert static_steps > continuous_steps  # the slots a finished request leaves idle cost steps
