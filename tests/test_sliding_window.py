"""A real sliding window: the engine frees the blocks that fall out of it, the contiguous cache rolls, and both give
the tokens of the full uncached forward with the dense window mask."""

from __future__ import annotations

import torch
from conftest import make_model, tiny_config
from helpers import reference_greedy

from tformer.decoding.search import beam_search_decoder
from tformer.engine.blocks import FREED
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.paged import kv_bytes_per_token
from tformer.engine.sampling import SamplingParams
from tformer.info import model_info

WINDOW = 8
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _windowed(window: int | None = WINDOW) -> torch.nn.Module:
    return make_model(tiny_config("tiny-llama", sliding_window=window, max_seq_len=128))


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Every prompt's greedy tokens, and the most blocks the engine held at once."""
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    peak = 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
        peak = max(peak, engine.num_blocks_in_use)
    return [tokens[rid] for rid in ids], peak


def test_the_engine_under_a_window_gives_the_uncached_tokens_and_holds_only_the_window() -> None:
    """Chunked prefill (6 tokens a step) and decoding over 4-token blocks: the same tokens as the full forward with
    the window mask, while each sequence holds at most its window's blocks plus one step's, not its whole length."""
    model = _windowed()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 90, (n,), generator=generator).tolist() for n in (3, 17, 25)]
    config = EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=6, prefix_caching=False)
    outputs, peak = _run(Engine(model, config=config), prompts)
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert tokens == reference_greedy(model, prompt, GREEDY.max_tokens)
    per_sequence = -(-(WINDOW + 6) // 4) + 1  # the window, one step's tokens, one block the window straddles
    assert peak <= len(prompts) * per_sequence
    _, unwindowed_peak = _run(Engine(_windowed(None), config=config), prompts)
    assert peak < unwindowed_peak / 2, (peak, unwindowed_peak)


def test_a_step_reads_only_each_rows_window() -> None:
    """A decode step of rows at positions 40 and 60 reads window-sized key ranges, not 61 keys from position 0."""
    model = _windowed()
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=64))
    tables = [list(range(0, 11)), list(range(11, 27))]
    positions = torch.tensor([[40], [60]])
    view = engine.kv.step_views(tables, positions)[0]
    assert view.key_count == WINDOW
    assert view.key_starts.flatten().tolist() == [40 - WINDOW + 1, 60 - WINDOW + 1]


def test_the_rolling_contiguous_cache_gives_the_uncached_tokens() -> None:
    """Beam search with one beam over a rolling buffer of WINDOW slots equals greedy decoding without a cache."""
    model = _windowed()
    cache = model.new_cache(1, 200)
    assert cache[0].self_attn.k.shape[2] == WINDOW
    prompt = torch.randint(1, 90, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    tokens = beam_search_decoder(model, [prompt], max_new_tokens=30, beam_size=1, eos_id=-1)[0]
    assert tokens == reference_greedy(model, prompt, 30)


def test_info_reports_the_bytes_the_engine_holds() -> None:
    """`tformer info`'s KV bytes for a windowed model at a long context equal the bytes of the blocks the engine
    holds for one long sequence, within one step's and one straddled block's worth."""
    model = _windowed()
    config = EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=4, prefix_caching=False)
    engine = Engine(model, config=config)
    _, peak = _run(engine, [list(range(1, 60))])
    held = peak * config.block_size * kv_bytes_per_token(model)
    info = model_info(model.config, context=100, kv_dtype="fp32")
    assert info.kv_cached_tokens == WINDOW
    assert (
        info.kv_bytes_at_context <= held <= info.kv_bytes_at_context + 3 * config.block_size * kv_bytes_per_token(model)
    )


def test_prefix_caching_under_a_window_never_publishes_a_freed_entry() -> None:
    """Prefix caching on: blocks are published when full, before the window frees them, and FREED table entries
    are never published. A repeat of the prompt hits the cached blocks and beams of it (whose forked tables hold
    FREED entries, hashed anew) give the offline beam search's hypothesis, both as without a cache."""
    model = _windowed()
    prompt = torch.randint(1, 90, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=6))
    first, _ = _run(engine, [prompt])
    again, _ = _run(engine, [prompt])
    assert first == again == [reference_greedy(model, prompt, GREEDY.max_tokens)]
    assert engine.scheduler.prefix_hit_tokens == 28  # every full block but the one with the last prompt token
    beams = engine.generate([prompt], SamplingParams(max_tokens=10, beam_width=2, length_penalty=0.6))[0]
    assert beams.token_ids == beam_search_decoder(model, [prompt], 10, -1, 2, 0.6)[0]
    assert FREED not in engine.allocator.pool.key_of and engine.num_blocks_in_use == 0
