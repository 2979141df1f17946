"""Beams and the prefix cache: a beam forked from its parent inherits the keys of the parent's published blocks,
so a step keys only the block that just filled, however long the beams are.

Against the offline beam search (the same tokens) and the pool's documented rule (a later request with the best
hypothesis as its prompt finds every full block the beams published).
"""

from __future__ import annotations

from conftest import make_model, tiny_config

from tformer.decoding.search import beam_search_decoder
from tformer.engine.blocks import BlockAllocator, BlockHash
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import SamplingParams


def test_a_beam_step_keys_only_the_block_that_filled(monkeypatch) -> None:
    model = make_model(tiny_config("tiny-llama"))
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(40)]  # 10 full blocks of 4
    engine = Engine(model, None, EngineConfig(block_size=4, num_blocks=256, max_batched_tokens=64))
    visited: list[int] = []  # blocks each register_prefix call looks at (keys it has no record of)
    register = BlockAllocator.register_prefix

    def counted(self, table: list[int], tokens: list[int], n_computed: int, hashes: list[BlockHash]) -> None:
        visited.append(n_computed // self.block_size - len(hashes))
        register(self, table, tokens, n_computed, hashes)

    monkeypatch.setattr(BlockAllocator, "register_prefix", counted)
    params = SamplingParams(max_tokens=24, beam_width=3, length_penalty=0.6, ignore_eos=True)
    [result] = engine.generate([prompt], params)
    assert result.token_ids == beam_search_decoder(model, [prompt], 24, -1, 3, 0.6)[0]
    assert visited[0] == 10  # the prompt's blocks
    assert len(visited) > 3 * 24 // 4 - 3  # every beam, at every block boundary
    assert max(visited[1:]) == 1  # before: a new beam looked at all of its parent's blocks again, up to 15
    # the beams published their blocks under the keys of their own prefixes: the best hypothesis hits them all
    tokens = prompt + result.token_ids
    hits = engine.allocator.match_prefix(tokens, max_blocks=len(tokens) // 4)
    assert len(hits) == (len(tokens) - 1) // 4  # every block the beams computed (the last token never was)
