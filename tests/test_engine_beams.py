"""An encoder-decoder's beam requests in the engine (engine/beams.py `SourceBeams`): searched in batches by the offline
beam search, with the hypotheses of the engine's own paged beams (`BeamGroup`, copy-on-write blocks) and of
`search.beam_search` run on each request alone; requests of other settings, greedy ones and aborted ones beside them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import prompts_of_mixed_lengths

from tformer.decoding.search import beam_search
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

BOS, EOS = 1, 2


class Tokenizer:
    """Ids as text; </s> = 2, <s> = 1."""

    bos_id, eos_id = BOS, EOS

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def sharp_model():
    """A tiny random translation model whose </s> is often a candidate, so that hypotheses end at many lengths."""
    model = make_model(tiny_config("tiny-transformer", tie_embeddings=False, vocab_size=16))
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
        model.lm_head.weight[EOS].mul_(3.0)
    return model


def alone(model, source: list[int], params: SamplingParams) -> list[int]:
    """The offline search on this request alone, with </s> appended as the engine reports a hypothesis that ended."""
    eos = -1 if params.ignore_eos else EOS
    src = torch.tensor([source])
    [best] = beam_search(
        model, src, torch.ones_like(src), params.max_tokens, BOS, eos, params.beam_width, params.length_penalty
    )
    return best + [EOS] * (len(best) < params.max_tokens and not params.ignore_eos)


def test_engine_beams_of_an_encoder_decoder_equal_the_offline_search_and_the_paged_beams() -> None:
    model = sharp_model()
    sources = [[3 + t % 13 for t in s] for s in prompts_of_mixed_lengths(13, (6, 11, 3, 1, 9, 4, 7))]
    settings = [
        SamplingParams(max_tokens=12, beam_width=4, length_penalty=0.6),
        SamplingParams(max_tokens=5, beam_width=4, length_penalty=0.6),  # cut at its limit
        SamplingParams(max_tokens=12, beam_width=3, length_penalty=1.0),  # another search: another batch
        SamplingParams(max_tokens=12, temperature=0.0),  # greedy: the engine's paged decode
        SamplingParams(max_tokens=9, beam_width=4, length_penalty=0.6, ignore_eos=True),
        SamplingParams(max_tokens=12, beam_width=4, length_penalty=0.6),
        SamplingParams(max_tokens=7, beam_width=2, length_penalty=0.0),
    ]
    config = EngineConfig(block_size=4, num_blocks=128, max_batched_tokens=64)
    engine = Engine(model, Tokenizer(), config)
    assert engine.source_beams is not None
    results = engine.generate(sources, settings)
    paged = Engine(model, Tokenizer(), config)
    paged.source_beams = None  # every beam a sequence of its own on shared blocks, as before
    paged_results = paged.generate(sources, settings)
    assert [r.token_ids for r in results] == [r.token_ids for r in paged_results]
    for source, params, result in zip(sources, settings, results, strict=True):
        if params.beam_width > 1:
            assert result.token_ids == alone(model, source, params)
    ended = [r.finish_reason for r, p in zip(results, settings, strict=True) if p.beam_width > 1]
    assert "stop" in ended and "length" in ended
    assert engine.num_blocks_in_use == 0 and not engine.source_beams.has_work()


def test_an_aborted_beam_request_leaves_the_batch_and_the_others_finish() -> None:
    model = sharp_model()
    engine = Engine(model, Tokenizer(), EngineConfig(block_size=4, num_blocks=64))
    params = SamplingParams(max_tokens=8, beam_width=3, length_penalty=0.6)
    kept = engine.add_request([5, 6, 7], params)
    dropped = engine.add_request([8, 9], params)
    engine.abort(dropped)
    assert engine.has_unfinished()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [out.request_id for out in outputs] == [kept] and outputs[0].finished
    assert outputs[0].token_ids == alone(model, [5, 6, 7], params)
