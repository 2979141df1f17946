"""The engine against the plain uncached forward: every path must produce the same greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import DECODERS, prompts_of_mixed_lengths, reference_greedy

from tformer.decoding.search import beam_search, beam_search_decoder, greedy_search
from tformer.engine import packing, runner
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.paged import PagedKVCache
from tformer.engine.runner import StepBatch, group_by_width
from tformer.engine.sampling import RequestError, SamplingParams
from tformer.layers import attention, masks

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


class CharTokenizer:
    """Printable ASCII as ids 0..94, </s> = 95, <s> = 96: enough to test text, stop strings and streaming."""

    bos_id, eos_id = 96, 95

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + 32) for i in ids if i < 95)


@pytest.fixture(params=list(DECODERS), scope="module")
def decoder(request: pytest.FixtureRequest) -> torch.nn.Module:
    overrides = dict(DECODERS[request.param])
    return make_model(tiny_config(overrides.pop("preset"), **overrides))


@pytest.mark.parametrize(
    "engine_config",
    [
        EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=256),  # paged, whole prompts at once
        EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=8),  # chunked prefill
        EngineConfig(block_size=64, num_blocks=5, max_batched_tokens=256),  # contiguous: one block per sequence
    ],
    ids=["paged", "chunked-prefill", "contiguous"],
)
def test_engine_greedy_equals_uncached_forward(decoder: torch.nn.Module, engine_config: EngineConfig) -> None:
    prompts = prompts_of_mixed_lengths(decoder.config.vocab_size)
    results = Engine(decoder, config=engine_config).generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(decoder, prompt, GREEDY.max_tokens)
        assert result.finish_reason == "length"


def test_staggered_arrivals_and_preemption_keep_outputs(decoder: torch.nn.Module) -> None:
    # 12 blocks of 4 cannot hold five sequences of up to 32 tokens: the scheduler must preempt and recompute
    engine = Engine(decoder, config=EngineConfig(block_size=4, num_blocks=12, max_batched_tokens=16))
    prompts = prompts_of_mixed_lengths(decoder.config.vocab_size)
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    ids: list[str] = []
    step = 0
    while len(finished) < len(prompts):
        if step % 3 == 0 and len(ids) < len(prompts):  # a new request every third step
            ids.append(engine.add_request(prompts[len(ids)], GREEDY))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finished.add(out.request_id)
        step += 1
    # a sliding window frees the blocks behind it, so there the same pool holds every sequence
    assert engine.num_preemptions > 0 or decoder.config.sliding_window is not None
    for rid, prompt in zip(ids, prompts, strict=True):
        assert outputs[rid] == reference_greedy(decoder, prompt, GREEDY.max_tokens)
    assert engine.num_blocks_in_use == 0


def test_prefix_cache_hits_give_the_same_tokens() -> None:
    model = make_model(tiny_config("tiny-llama"))
    shared = prompts_of_mixed_lengths(model.config.vocab_size, (13,))[0]
    prompts = [shared + [5, 6], shared + [7], shared]
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=64))
    first = engine.generate([prompts[0]], GREEDY)[0]
    rid = engine.add_request(prompts[1], GREEDY)
    engine.step()
    assert (
        engine.requests[rid].samples[0].n_computed == 14
    )  # 12 of 13 shared tokens came from 3 cached blocks, +2 computed
    assert engine.scheduler.prefix_hit_tokens == 12
    rest = engine.generate([prompts[2]], GREEDY)[0]
    while engine.has_unfinished():
        engine.step()
    second = engine.requests[rid].samples[0]
    assert first.token_ids == reference_greedy(model, prompts[0], 12)
    assert second.output == reference_greedy(model, prompts[1], 12)
    assert rest.token_ids == reference_greedy(model, prompts[2], 12)


def test_prefill_steps_take_a_dense_mask_only_when_rows_continue_from_different_positions(monkeypatch) -> None:
    """Past the size of a dense bias: a step of whole prompts (every row from position 0, padded on the right)
    takes SDPA's causal path; a step whose rows all continue from one position after cached tokens (prefix hits;
    padded on the right) takes `causal_suffix_attention`; only a step whose rows continue from different positions
    builds its bias (by blocks). Only whole prompts take their keys as computed, without reading them back from
    the cache. All give the uncached tokens. (Padded steps: packing is off here; see the packed steps' test.)"""
    calls: list[tuple[bool, bool] | str] = []
    sdpa, suffix = torch.nn.functional.scaled_dot_product_attention, attention.causal_suffix_attention
    views, whole_prompts = PagedKVCache.step_views, []

    def views_spy(self, tables, positions):
        made = views(self, tables, positions)
        if positions.shape[1] > 1:
            whole_prompts.append(made[0].whole_prompts)
        return made

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if q.shape[2] > 1:  # prefill (decode steps attend in place or over one query)
            calls.append((attn_mask is not None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    def suffix_spy(q, k, v):
        calls.append("suffix")
        return suffix(q, k, v)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention, "causal_suffix_attention", suffix_spy)
    monkeypatch.setattr(masks, "DENSE_BIAS_MAX_ENTRIES", 0)  # no dense bias, as for a long prompt's chunks
    monkeypatch.setattr(PagedKVCache, "step_views", views_spy)
    model = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size, (9, 5, 14))
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=64, pack_prompts=False))
    outputs = engine.generate(prompts, GREEDY)
    assert calls and all(call == (False, True) for call in calls)
    assert whole_prompts and all(whole_prompts)
    calls.clear()
    whole_prompts.clear()
    continued = [prompt + [3, 4, 5] for prompt in prompts]
    alone = engine.generate([continued[2]], GREEDY)[0]  # 12 of its tokens come from the cache: it starts at 12
    one_start = [prompts[2][:12] + [6, 7], prompts[2][:12] + [8, 9, 10, 11, 12]]  # both from 12: 2 and 5 tokens
    from_one_start = engine.generate(one_start, GREEDY)
    assert calls and all(call == "suffix" for call in calls)
    calls.clear()
    together = engine.generate(continued[:2], GREEDY)  # from 8 and from 4, 4 tokens each
    assert calls and all(call == (True, False) for call in calls)
    assert whole_prompts and not any(whole_prompts)
    assert [o.token_ids for o in outputs] == [reference_greedy(model, p, 12) for p in prompts]
    assert alone.token_ids == reference_greedy(model, continued[2], 12)
    assert [o.token_ids for o in from_one_start] == [reference_greedy(model, p, 12) for p in one_start]
    assert [o.token_ids for o in together] == [reference_greedy(model, p, 12) for p in continued[:2]]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-transformer"])
def test_compiled_decode_steps_give_the_uncached_tokens(preset: str) -> None:
    """EngineConfig(compile=True): decode steps of one row and of several rows (each compiles once) run compiled,
    prefill chunks eager; fp32, so the tokens must be the uncached forward's exactly."""
    model = make_model(tiny_config(preset))
    prompts = [[t if t > 2 else 3 for t in p] for p in prompts_of_mixed_lengths(model.config.vocab_size, (6, 11, 3))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    from torch._dynamo.utils import counters

    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=32, compile=True))
    graphs_before = counters["stats"]["unique_graphs"]
    alone = engine.generate([prompts[0]], params)[0].token_ids  # batch size 1
    together = [r.token_ids for r in engine.generate(prompts, params)]
    assert runner.compiled_decode_step(model.decoder).compiled is not None  # one whole graph: no eager fallback
    # one graph for batch 1 and one for larger batches: nothing that changes from step to step is specialized on
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    if preset == "tiny-llama":
        expected = [reference_greedy(model, p, 8) for p in prompts]
    else:
        width = max(map(len, prompts))
        src = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        expected = greedy_search(model, src, src != 0, max_len=8, bos_id=1, eos_id=-1)
    assert [alone, *together] == [expected[0], *expected]


def test_a_stack_uses_the_rotary_angles_its_inputs_carry() -> None:
    """`StackInputs.rotary`, the (cos, sin) that a compiled decode step's caller computes once a step
    (`runner.CompiledDecode`): the stack's output with them equals its output when it computes them itself, and
    other angles change it, so they are what it reads."""
    from dataclasses import replace

    from tformer.models.stack import StackInputs

    model = make_model(tiny_config("tiny-llama")).eval()
    stack, tokens = model.decoder, torch.tensor([[5, 17, 3, 44, 9, 12]])
    inputs = StackInputs.from_prefix(tokens)
    with torch.no_grad():
        own = stack(tokens, inputs)
        given = stack(tokens, replace(inputs, rotary=stack.positions.rotary(inputs.positions)))
        doubled = stack(tokens, replace(inputs, rotary=stack.positions.rotary(2 * inputs.positions)))
    assert torch.equal(given, own)
    assert (doubled - own).abs().max() > 1e-3  # twice the distances between tokens: other attention scores


def test_compiled_engines_of_two_models_keep_their_own_graphs_and_read_weights_in_place() -> None:
    """The compiled step keeps no guards on the model's modules (runner.DECODE_COMPILE_OPTIONS): each engine's step
    has its own graph cache, so a second model of another shape in the same process gets its own graph, and
    weights changed in place after compiling are what the next step reads; a new engine over the same model
    compiles nothing again."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 3, 44]
    models = [make_model(tiny_config("tiny-llama")), make_model(tiny_config("tiny-llama", n_decoder_layers=3), seed=1)]
    engines = [Engine(m, config=EngineConfig(block_size=4, num_blocks=32, compile=True)) for m in models]
    for model, engine in zip(models, engines, strict=True):
        assert engine.generate([prompt], params)[0].token_ids == reference_greedy(model, prompt, 5)
    with torch.no_grad():
        for param in models[0].decoder.layers[0].parameters():
            param.mul_(-1.5)
    tokens = engines[0].generate([prompt], params)[0].token_ids
    assert tokens == reference_greedy(models[0], prompt, 5)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    again = Engine(models[0], config=EngineConfig(block_size=4, num_blocks=32, compile=True))
    assert again.generate([prompt], params)[0].token_ids == tokens
    assert counters["stats"]["unique_graphs"] == graphs  # a new engine over the same model reuses its graphs
    assert all(runner.compiled_decode_step(m.decoder).compiled is not None for m in models)


def test_a_decode_step_that_breaks_the_graph_runs_eager_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The compiled step skips Dynamo's guards on modules (runner.DECODE_COMPILE_OPTIONS), safe only as one graph: a
    graph break inside a layer made Dynamo compile that layer's frame alone, and the next layer, whose modules went
    unchecked, ran it with the first one's Python values. Each layer's forward here breaks the graph and then scales
    by a float of its own: the step must refuse to compile in pieces and decode eagerly, warning once, with the
    uncached forward's tokens (fp32)."""
    from tformer.layers.block import Block

    def forward_then_scale(self: Block, x: torch.Tensor, *args: object) -> torch.Tensor:
        out = Block.forward(self, x, *args)
        torch._dynamo.graph_break()
        return x + self.scale * (out - x)  # a Python value, which Dynamo reads as a constant of the graph

    model = make_model(tiny_config("tiny-llama"))
    for layer, scale in zip(model.decoder.layers, (1.0, -0.5), strict=True):
        layer.scale = scale
        layer.forward = forward_then_scale.__get__(layer)  # one code object for both layers, as Block.forward is
    prompts = [[5, 6, 7, 8], [3, 4, 9]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=32, compile=True))
    with caplog.at_level("WARNING", logger=runner.__name__):
        alone = engine.generate(prompts[:1], params)[0].token_ids  # batch size 1
        together = [r.token_ids for r in engine.generate(prompts, params)]
        again = Engine(model, config=EngineConfig(block_size=4, num_blocks=32, compile=True))
        assert again.generate(prompts[:1], params)[0].token_ids == alone
    assert [alone, *together] == [reference_greedy(model, p, 6) for p in [prompts[0], *prompts]]
    warnings = [r.getMessage() for r in caplog.records if r.name == runner.__name__]
    assert len(warnings) == 1 and "graph_break" in warnings[0] and "uncompiled" in warnings[0]


def test_a_models_own_error_keeps_the_step_compiled_and_the_recompile_limit_falls_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Dynamo's other refusals under `fullgraph`: an exception the model raises while traced (here in decode steps
    while `refuse` is set) reaches the caller as the model's own, as eager, and leaves the step compiled, so the next
    steps compile and run; a recompile past Dynamo's limit (a second batch size under a limit of 1) decodes eagerly
    with one warning instead of failing the request."""
    from torch._dynamo.utils import counters

    from tformer.layers.block import Block

    def forward(self: Block, x: torch.Tensor, *args: object) -> torch.Tensor:
        if self.refuse and x.shape[1] == 1:
            raise ValueError("refused")
        return Block.forward(self, x, *args)

    model = make_model(tiny_config("tiny-llama"))
    layer = model.decoder.layers[1]
    layer.refuse, layer.forward = True, forward.__get__(layer)
    prompts = [[5, 6, 7, 8], [3, 4, 9]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    config = EngineConfig(block_size=4, num_blocks=32, compile=True)
    with caplog.at_level("WARNING", logger=runner.__name__):
        with pytest.raises(ValueError, match="refused"):
            Engine(model, config=config).generate(prompts[:1], params)
        assert runner.compiled_decode_step(model.decoder).compiled is not None
        layer.refuse = False
        engine = Engine(model, config=config)  # the first one's request is left half done by the error
        graphs = counters["stats"]["unique_graphs"]
        alone = engine.generate(prompts[:1], params)[0].token_ids
        assert counters["stats"]["unique_graphs"] == graphs + 1  # compiled
        assert not [r for r in caplog.records if r.name == runner.__name__]
        with torch._dynamo.config.patch(recompile_limit=1):
            together = [r.token_ids for r in engine.generate(prompts, params)]
    assert [alone, *together] == [reference_greedy(model, p, 5) for p in [prompts[0], *prompts]]
    warnings = [r.getMessage() for r in caplog.records if r.name == runner.__name__]
    assert len(warnings) == 1 and "recompile limit" in warnings[0] and "uncompiled" in warnings[0]


@pytest.mark.parametrize("beam_width, num_blocks", [(3, 128), (4, 128), (4, 36)], ids=["3", "4", "4-preempting"])
def test_engine_beam_search_equals_the_offline_beam_search(beam_width: int, num_blocks: int) -> None:
    """Beams as sequences sharing KV blocks (copy-on-write), against search.beam_search_decoder on a contiguous
    cache; with 36 blocks of 4 the five requests' beams cannot all fit, so beams are preempted and recomputed."""
    model = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    tokenizer = CharTokenizer()
    # </s>: a token the first search picks 4th, so that some hypotheses end early
    tokenizer.eos_id = beam_search_decoder(model, prompts[:1], 10, -1, beam_width, 0.6)[0][3]
    params = SamplingParams(max_tokens=10, beam_width=beam_width, length_penalty=0.6)
    engine = Engine(model, tokenizer, EngineConfig(block_size=4, num_blocks=num_blocks, max_batched_tokens=64))
    results = engine.generate(prompts, params)
    expected = beam_search_decoder(model, prompts, 10, tokenizer.eos_id, beam_width, 0.6)
    assert [r.token_ids[: len(r.token_ids) - (r.finish_reason == "stop")] for r in results] == expected
    assert [r.finish_reason for r in results] == ["stop" if len(e) < 10 else "length" for e in expected]
    assert "stop" in [r.finish_reason for r in results]
    assert all(r.token_ids[-1] == tokenizer.eos_id for r in results if r.finish_reason == "stop")
    assert engine.num_block_copies > 0 and engine.num_blocks_in_use == 0
    assert (engine.num_preemptions > 0) == (num_blocks == 36)


def test_engine_beam_search_for_an_encoder_decoder_equals_beam_search() -> None:
    model = make_model(tiny_config("tiny-transformer"))
    sources = [[t if t > 2 else 3 for t in s] for s in prompts_of_mixed_lengths(model.config.vocab_size, (6, 11, 3))]
    params = SamplingParams(max_tokens=9, beam_width=4, length_penalty=0.6, ignore_eos=True)
    results = Engine(model, config=EngineConfig(block_size=4, num_blocks=64)).generate(sources, params)
    width = max(map(len, sources))
    src = torch.tensor([s + [0] * (width - len(s)) for s in sources])
    expected = beam_search(model, src, src != 0, max_len=9, bos_id=1, eos_id=-1, beam_size=4, alpha=0.6)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("block_size", [4, 64])
def test_encoder_decoder_engine_equals_greedy_search(block_size: int) -> None:
    model = make_model(tiny_config("tiny-transformer"))
    sources = prompts_of_mixed_lengths(model.config.vocab_size, (6, 11, 3))
    sources = [[t if t > 2 else 3 for t in s] for s in sources]  # no <pad>, <s> or </s> inside a source
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = Engine(model, config=EngineConfig(block_size=block_size, num_blocks=16, max_batched_tokens=8))
    results = engine.generate(sources, params)
    width = max(map(len, sources))
    src = torch.tensor([s + [0] * (width - len(s)) for s in sources])
    expected = greedy_search(model, src, src != 0, max_len=10, bos_id=1, eos_id=-1)
    assert [r.token_ids for r in results] == expected


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    model = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    alone = Engine(model).generate([prompts[0]], params)[0]
    batched = Engine(model).generate(prompts, [params] + [SamplingParams(max_tokens=10, seed=i) for i in range(4)])
    assert batched[0].token_ids == alone.token_ids
    greedy_by_top_k = Engine(model).generate([prompts[0]], SamplingParams(max_tokens=10, top_k=1, seed=3))[0]
    assert greedy_by_top_k.token_ids == reference_greedy(model, prompts[0], 10)


def test_stop_strings_streaming_and_eos() -> None:
    model = make_model(tiny_config("tiny-llama", vocab_size=97))
    engine = Engine(model, CharTokenizer())
    prompt = "The cat sat"
    plain = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert plain.text == CharTokenizer().decode(plain.token_ids)
    stop = plain.text[5:7]
    cut = plain.text.index(stop)
    pieces = list(engine.stream(prompt, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop])))
    assert "".join(p.text for p in pieces) == plain.text[:cut]
    assert pieces[-1].finished and pieces[-1].finish_reason == "stop"
    assert all(stop not in p.text for p in pieces)
    eos_at = plain.token_ids.index(95) if 95 in plain.token_ids else None
    with_eos = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0))[0]
    if eos_at is not None:
        assert with_eos.token_ids == plain.token_ids[: eos_at + 1] and with_eos.finish_reason == "stop"
    else:
        assert with_eos.token_ids == plain.token_ids
    assert engine.num_blocks_in_use == 0


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        (list(range(60)) + [1, 2, 3, 4], SamplingParams(), "context"),
        ([1, 2, 3], SamplingParams(max_tokens=100), "max_tokens"),
        ([1, 2, 500], SamplingParams(), "token ids"),
        ([1, 2, 3], SamplingParams(stop_token_ids=[999999], min_tokens=3), "stop_token_ids token ids"),
        ([1, 2, 3], SamplingParams(logit_bias={999999: 5.0}), "logit_bias token ids"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(prompt, params, message) -> None:
    model = make_model(tiny_config("tiny-llama"))
    engine = Engine(model)
    running = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RequestError, match=message):
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[running].samples[0].output == reference_greedy(model, [1, 2, 3], 12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(beam_width=0), "beam_width must be a positive integer"),
        (dict(beam_width=4, n=2), "leave n at 1"),
        (dict(beam_width=4, stop=["."]), "no stop strings"),
        (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, length_penalty=1e300), "length_penalty"),
        (dict(repetition_penalty=1e-300), "repetition_penalty"),  # logits / 1e-300: inf, then NaN
        (dict(repetition_penalty=1e300), "repetition_penalty"),
        (dict(stop=["x" * 257]), "stop string"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_invalid_sampling_parameters(kwargs: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


def test_abort_frees_blocks() -> None:
    engine = Engine(make_model(tiny_config("tiny-llama")), config=EngineConfig(block_size=4, num_blocks=32))
    rid = engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=30, temperature=0.0))
    engine.step()
    assert engine.num_blocks_in_use == 5
    engine.abort(rid)
    assert engine.num_blocks_in_use == 0 and not engine.has_unfinished()


# ---- the block pool and sampling, against hand-computed expectations ----------------------------------------------


def test_block_pool_reference_counts_and_lru_eviction() -> None:
    from tformer.engine.blocks import BlockAllocator, NoFreeBlocks

    allocator = BlockAllocator(num_blocks=4, block_size=2)
    a: list[int] = []
    allocator.grow(a, 5)  # 3 blocks for 5 tokens
    assert a == [0, 1, 2] and allocator.pool.num_free == 1
    allocator.register_prefix(a, [10, 11, 12, 13, 14], n_computed=5)  # two full blocks become cacheable
    b = allocator.fork(a)
    assert [allocator.pool.ref_counts[x] for x in a] == [2, 2, 2]
    copies = allocator.copy_on_write(b, 4, 6)  # b writes position 4..5: block 2 is shared, so b gets a copy
    assert [(c.src, c.dst) for c in copies] == [(2, 3)] and b == [0, 1, 3]
    with pytest.raises(NoFreeBlocks):
        allocator.grow(b, 8)
    allocator.free(a)
    allocator.free(b)
    assert allocator.pool.num_free == 4
    hits = allocator.match_prefix([10, 11, 12, 13, 99], max_blocks=2)
    assert hits == [0, 1]  # the freed blocks still hold the prefix until reallocated
    allocator.free(hits)
    fresh: list[int] = []
    allocator.grow(fresh, 8)  # takes all four blocks, evicting the cached prefix
    assert allocator.match_prefix([10, 11, 12, 13], max_blocks=2) == []


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_copy_on_write_copies_the_block_contents(kv_cache_dtype: str) -> None:
    """Keys, values and (in an int8 cache) their scales: block 2 reads back what block 0 holds."""
    from tformer.engine.blocks import BlockCopy
    from tformer.engine.paged import PagedKVCache

    kv = PagedKVCache(2, 3, 2, n_kv_heads=1, head_dim=3, dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)
    for layer in kv.layers:
        layer.store(torch.arange(6), *layer.encode(torch.randn(6, 1, 3)), *layer.encode(torch.randn(6, 1, 3)))
    kv.copy_blocks([BlockCopy(0, 2)])
    for layer in kv.layers:
        for copied, source in zip(layer.read(torch.arange(4, 6)), layer.read(torch.arange(0, 2)), strict=True):
            torch.testing.assert_close(copied, source, rtol=0, atol=0)
        assert not torch.equal(layer.read(torch.arange(2, 4))[0], layer.read(torch.arange(0, 2))[0])


def test_a_kv_pool_is_zeros_and_takes_memory_only_where_written() -> None:
    """The pool's pages come from the OS as zeros and are backed when written (layers.kv_cache.zeroed): a 512 MiB
    pool neither takes 512 MiB nor the time to clear it, and what is written reads back beside zeros."""
    from tformer.engine.paged import PagedKVCache
    from tformer.training.memory import rss_bytes

    before = rss_bytes()
    kv = PagedKVCache(n_layers=4, num_blocks=4096, block_size=16, n_kv_heads=4, head_dim=64, dtype=torch.float32)
    assert kv.nbytes == 512 << 20
    assert rss_bytes() - before < 64 << 20
    written = torch.randn(32, 4, 64)
    for layer in kv.k + kv.v:
        layer[1000:1032] = written
    torch.testing.assert_close(kv.v[3][1000:1032], written, rtol=0, atol=0)
    assert all(not layer[:1000].any() and not layer[1032:].any() for layer in kv.k + kv.v)


def test_top_k_top_p_filter_matches_the_definition() -> None:
    from tformer.engine.sampling import filter_logits

    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.75)).tolist()
    assert kept == [False, True, False, True, True]  # 0.4 + 0.3 < 0.75, adding 0.15 reaches it
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).tolist()
    assert kept == [False, True, False, True, False]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.3)).tolist()
    assert kept == [False, True, False, False, False]  # the most likely token always survives


def test_sampled_tokens_follow_the_tempered_distribution() -> None:
    from tformer.engine.sampling import make_generator, sample_token

    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    params = SamplingParams(temperature=0.7)
    generator = make_generator(0)
    counts = torch.bincount(torch.tensor([sample_token(logits, params, generator) for _ in range(4000)]), minlength=4)
    expected = torch.softmax(logits / 0.7, -1) * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # the 0.999 quantile of chi-square with 3 degrees of freedom


def test_parallel_samples_share_the_prompt_blocks_and_copy_on_write() -> None:
    model = make_model(tiny_config("tiny-llama"))
    prompt = prompts_of_mixed_lengths(model.config.vocab_size, (10,))[0]  # 10 tokens: the third block is partial
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=32))
    samples = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3))
    assert [s.index for s in samples] == [0, 1, 2]
    alone = [
        Engine(model).generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=5 + i))[0] for i in range(3)
    ]
    assert [s.token_ids for s in samples] == [a.token_ids for a in alone]
    assert len({tuple(s.token_ids) for s in samples}) > 1  # different seeds, different samples
    assert engine.num_block_copies == 2  # the two forks each copied the shared partial block once
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, n=2))
    assert greedy[0].token_ids == greedy[1].token_ids == reference_greedy(model, prompt, 8)
    assert engine.num_blocks_in_use == 0


def test_a_vanishing_temperature_is_greedy_and_a_bad_prompt_is_a_request_error() -> None:
    model = make_model(tiny_config("tiny-llama", vocab_size=97))
    engine = Engine(model, CharTokenizer())
    tiny = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=1e-45, seed=0))[0]
    assert tiny.token_ids == reference_greedy(model, [1, 2, 3], 6)

    class Strict(CharTokenizer):
        def encode(self, text: str) -> list[int]:
            text.encode("utf-8")  # raises on a lone surrogate, as HF tokenizers do
            return super().encode(text)

    with pytest.raises(RequestError, match="cannot be tokenized"):
        Engine(model, Strict()).add_request("\ud800", SamplingParams())


def test_prompt_chunks_of_similar_widths_share_a_forward() -> None:
    from tformer.engine.scheduler import SequenceState

    items = [(SequenceState(str(n), [0] * n, GREEDY), n) for n in (1, 20, 13, 7, 1, 6, 40)]
    groups = [[n for _, n in group] for group in group_by_width(items)]
    # decodes first; then by width, a group taking a chunk while padding stays within 10% of its tokens
    assert groups == [[1, 1], [40], [20], [13], [7, 6]]
    wider = [[n for _, n in group] for group in group_by_width(items, max_padding=0.25)]
    assert wider == [[1, 1], [40], [20, 13], [7, 6]]
    packed = [[n for _, n in group] for group in group_by_width(items, pack=True)]
    assert packed == [[1, 1], [20, 13, 7, 6, 40]]  # every prompt chunk in one row, in the step's order


def test_a_packed_batch_puts_each_chunk_at_its_positions_side_by_side() -> None:
    batch = StepBatch.pack([[5, 6, 7], [8, 9], [1, 2, 3, 4]], [0, 4, 2], torch.device("cpu"))
    assert batch.packed and batch.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert batch.positions.tolist() == [[0, 1, 2, 4, 5, 2, 3, 4, 5]]
    assert batch.last_index.tolist() == [2, 4, 8]
    hidden = torch.arange(9.0)[None, :, None].expand(1, 9, 2)  # column t holds t
    assert batch.last_hidden(hidden).tolist() == [[2.0, 2.0], [4.0, 4.0], [8.0, 8.0]]


def test_packed_prompt_steps_give_the_uncached_tokens(decoder: torch.nn.Module, monkeypatch) -> None:
    """A step's prompt chunks share one row where every layer attends plainly (LLaMA, GPT-2), each sequence over
    its own keys: whole prompts from position 0 beside chunks that continue after cached tokens (a budget of 16
    tokens a step splits the longer prompts). ALiBi's position bias and a sliding window keep padded batches.
    Either way every request gets the uncached forward's tokens."""
    steps: list[list[tuple[int, int]]] = []
    views = packing.packed_views

    def spy(kv, tables, starts, lengths):
        steps.append(list(zip(starts, lengths, strict=True)))
        return views(kv, tables, starts, lengths)

    monkeypatch.setattr(runner, "packed_views", spy)
    engine = Engine(decoder, config=EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=16))
    prompts = prompts_of_mixed_lengths(decoder.config.vocab_size)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == [reference_greedy(decoder, p, GREEDY.max_tokens) for p in prompts]
    plain = decoder.config.position != "alibi" and decoder.config.sliding_window is None
    assert engine.runner.packs() == plain
    if not plain:
        assert not steps
        return
    assert any({start == 0 for start, _ in step} == {True, False} for step in steps)  # whole and continuing


def test_packing_declines_for_layers_that_do_not_attend_plainly() -> None:
    """Kept attention weights make a layer attend on its own: the engine then pads its prompt chunks (and gives
    the uncached tokens); a packed view refuses to hand one row's keys of several sequences to a layer's mask."""
    model = make_model(tiny_config("tiny-llama"))
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=64))
    assert engine.runner.packs()
    assert not Engine(make_model(tiny_config("tiny-transformer"))).runner.packs()  # cross-attention per row
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    model.decoder.layers[1].self_attn.keep_weights = True
    try:
        assert not engine.runner.packs()
        results = engine.generate(prompts, GREEDY)
    finally:
        model.decoder.layers[1].self_attn.keep_weights = False
    assert [r.token_ids for r in results] == [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    view = packing.packed_views(engine.kv, [[0], [1]], [0, 0], [3, 2])[0]
    k = torch.zeros(1, model.config.n_kv_heads, 5, model.config.head_dim)
    with pytest.raises(RuntimeError, match="pack_prompts=False"):
        view.update(torch.tensor([[0, 1, 2, 0, 1]]), k, k)
