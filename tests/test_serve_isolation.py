"""Nothing one request does can hurt another: hostile requests among well-formed streams, and requests that fail
inside the engine (while being added, sampled, masked or detokenized) end alone.

The reference for every well-formed stream is the offline `Engine`'s greedy text for the same request alone; the
observable facts are each hostile request's 4xx, the failed request's error, and the KV blocks in use going back
to 0.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import CMPL, NAME, LiveServer, assert_openai_error

from tformer.checkpoints import load_pretrained
from tformer.engine import Engine, SamplingParams
from tformer.engine.sampler import NonFiniteLogits, Sampler, _check_finite

PROMPTS = ["the cat sat", "a dog ran in", "the sun is", "birds sing", "the mat", "a park", "warm today", "at dawn"]
HOSTILE = [  # each made a 5xx, failed the requests beside it, or was decoded before it was checked
    {"prompt": "hi", "max_tokens": 8, "min_tokens": 3, "stop_token_ids": [999999]},
    {"prompt": "hello hello hello", "max_tokens": 8, "repetition_penalty": 1e-300, "temperature": 1},
    {"prompt": "hello hello", "max_tokens": 8, "repetition_penalty": 1e300},
    {"prompt": "hi", "max_tokens": 4, "logit_bias": {"999999": 5}},
    {"prompt": "hi", "max_tokens": 4, "logit_bias": {"²": 5}},
    {"prompt": [-1], "max_tokens": 2, "echo": True, "logprobs": 1},
    {"prompt": [2**40], "max_tokens": 2, "echo": True},
    {"prompt": [[5], [2**40]], "max_tokens": 2, "echo": True},
    {"prompt": "hi", "max_tokens": 4, "stop": ["x" * 16384] * 4},
    {"prompt": "hi", "max_tokens": 4, "beam_width": 2, "length_penalty": 1e300},
    {"prompt": "hi", "max_tokens": 4, "min_tokens": 9},
    {"prompt": "hi", "max_tokens": 10**9},
    {"prompt": "hi", "seed": 2**70},
]


def well_formed(prompt: str) -> dict[str, Any]:
    return {"model": NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_dir, one_thread):
    live = LiveServer(*load_pretrained(tiny_dir))
    yield live
    live.stop()


async def read_stream(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The stream's text and its events (the error events included), after checking it ends with [DONE]."""
    async with http.stream("POST", CMPL, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    return "".join(e["choices"][0]["text"] for e in events if "choices" in e), events


def blocks_in_use(server: LiveServer) -> int:
    """The KV blocks live requests hold, once the engine thread has caught up (polled: the books are its own)."""
    deadline = time.monotonic() + 10
    while server.engine.stats.blocks_in_use and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.engine.stats.blocks_in_use


def test_hostile_requests_among_streams_get_4xx_and_the_streams_their_own_tokens(server, offline) -> None:
    expected = {p: offline.complete(p, max_tokens=40, temperature=0.0, ignore_eos=True).text for p in PROMPTS}

    async def main() -> tuple[list[tuple[str, list]], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            streams = [asyncio.ensure_future(read_stream(http, well_formed(p))) for p in PROMPTS]
            await asyncio.sleep(0.05)  # the streams are under way
            hostile = [http.post(CMPL, json={"model": NAME, **body}) for body in HOSTILE]
            hostile += [http.get("/v1/runs/x", params={"offset": "²"}), http.post(CMPL, content=b'{"prompt": ')]
            answers = await asyncio.gather(*hostile)
            return await asyncio.gather(*streams), answers

    streamed, answers = asyncio.run(main())
    for response in answers:
        assert 400 <= response.status_code < 500, (response.request.url, response.text)
        assert_openai_error(response, response.status_code)
    named = [answer.json()["error"]["param"] for answer in answers[:4]]
    assert named == ["stop_token_ids", "repetition_penalty", "repetition_penalty", "logit_bias"]
    for prompt, (text, events) in zip(PROMPTS, streamed, strict=True):
        assert text == expected[prompt]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert blocks_in_use(server) == 0


FIELD_VALUES = {  # well-formed values and hostile ones for every sampling field
    "max_tokens": st.sampled_from([1, 4, 0, -1, 10**9, 2**63]),
    "temperature": st.sampled_from([0, 0.7, 2, 1e-300, 1e300, -1]),
    "top_p": st.sampled_from([1, 0.5, 1e-300, 0, 2]),
    "top_k": st.sampled_from([0, -1, 1, 5, 2**70, -5]),
    "min_p": st.sampled_from([0, 0.5, 1, -0.1, 2]),
    "seed": st.sampled_from([0, 7, -(2**63), 2**64 - 1, 2**70]),
    "stop": st.sampled_from(["a", ["a", "b"], "", ["x" * 300], ["a"] * 5]),
    "stop_token_ids": st.sampled_from([[], [3], [-1], [10**6], [2**40]]),
    "n": st.sampled_from([1, 2, 0, 17]),
    "beam_width": st.sampled_from([1, 2, 0, 17]),
    "length_penalty": st.sampled_from([0.6, -1, 11, 1e300]),
    "presence_penalty": st.sampled_from([0, 2, -2, 3]),
    "frequency_penalty": st.sampled_from([0, 1, -3]),
    "repetition_penalty": st.sampled_from([1, 1.3, 0.01, 100, 1e-300, 1e300, 0]),
    "logit_bias": st.sampled_from([{}, {"5": 100}, {"5": -100}, {"999999": 1}, {"-1": 1}, {"5": 101}]),
    "min_tokens": st.sampled_from([0, 2, 100]),
    "logprobs": st.sampled_from([None, 0, 5, 6]),
    "echo": st.booleans(),
    "prompt": st.sampled_from(["hi", [5, 6], [-1], [2**40], [[5], [2**31]], ""]),
    "ignore_eos": st.booleans(),
}
BODY = st.fixed_dictionaries({"model": st.just(NAME)}, optional=FIELD_VALUES).map(lambda b: {"prompt": "hi", **b})


def test_fuzzed_fields_beside_streams_never_get_a_5xx(server, offline) -> None:
    """Hypothesis over every sampling field, good values and hostile ones, 8 at a time beside a greedy stream."""
    expected = offline.complete(PROMPTS[0], max_tokens=40, temperature=0.0, ignore_eos=True).text
    seen: set[int] = set()

    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(BODY, min_size=8, max_size=8))
    def check(bodies: list[dict[str, Any]]) -> None:
        async def main() -> tuple[tuple[str, list], list[httpx.Response]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                stream = asyncio.ensure_future(read_stream(http, well_formed(PROMPTS[0])))
                answers = await asyncio.gather(*[http.post(CMPL, json=body) for body in bodies])
                return await stream, answers

        (text, _), answers = asyncio.run(main())
        assert text == expected
        for response in answers:
            seen.add(response.status_code)
            assert response.status_code < 500, response.text

    check()
    assert blocks_in_use(server) == 0
    assert 200 in seen and 400 in seen


class Panic(BaseException):
    """What a Rust extension raises on a panic (PyO3's PanicException derives from BaseException)."""


def test_a_request_that_cannot_be_added_is_answered_while_the_others_finish(server, offline, monkeypatch) -> None:
    engine = server.engine.engine
    add = engine.add_request

    def add_or_fail(prompt: Any, params: SamplingParams, request_id: str | None = None) -> str:
        if prompt == [13, 13, 13]:
            raise ZeroDivisionError("a bug while adding")
        if prompt == [13, 13, 14]:
            raise Panic("a panic in an extension")
        return add(prompt, params, request_id)

    monkeypatch.setattr(engine, "add_request", add_or_fail)
    expected = {p: offline.complete(p, max_tokens=40, temperature=0.0, ignore_eos=True).text for p in PROMPTS[:4]}

    async def main() -> tuple[list, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            streams = [asyncio.ensure_future(read_stream(http, well_formed(p))) for p in PROMPTS[:4]]
            failing = [http.post(CMPL, json={"prompt": ids, "max_tokens": 3}) for ids in ([13, 13, 13], [13, 13, 14])]
            return await asyncio.gather(*streams), await asyncio.gather(*failing)

    streamed, failed = asyncio.run(main())
    for response, words in zip(failed, ("ZeroDivisionError", "Panic"), strict=True):
        assert_openai_error(response, 500)
        assert words in response.json()["error"]["message"]
    assert [text for text, _ in streamed] == [expected[p] for p in PROMPTS[:4]]
    assert server.engine.is_running and blocks_in_use(server) == 0


@pytest.mark.parametrize("where", ["sampler", "penalties", "detokenizer"])
def test_a_request_failing_mid_stream_ends_alone_with_an_error_chunk(where, server, offline, monkeypatch) -> None:
    """The marked request (max_tokens 33) fails at its fourth token; it gets its three tokens' text, an error chunk
    saying why and [DONE]; the streams beside it end as they would alone."""
    engine = server.engine.engine

    def marked(seq: Any) -> bool:
        return seq.params.max_tokens == 33 and len(seq.output) >= 3

    if where == "sampler":
        token = Sampler._token

        def failing_token(self: Sampler, seq: Any, *args: Any) -> Any:
            if marked(seq):
                raise Panic("the sampler panicked")
            return token(self, seq, *args)

        monkeypatch.setattr(Sampler, "_token", failing_token)
    elif where == "penalties":
        from tformer.engine import sampler as sampler_module

        adjust = sampler_module.adjust_logits

        def non_finite(logits: Any, params: SamplingParams, context: list[int], output: list[int], ends: Any) -> Any:
            adjusted = adjust(logits, params, context, output, ends)
            return adjusted * float("nan") if params.max_tokens == 33 and len(output) >= 3 else adjusted

        monkeypatch.setattr(sampler_module, "adjust_logits", non_finite)
    else:
        process = engine.outputs.process

        def failing_process(seq: Any, logprob: Any = None) -> Any:
            if marked(seq) and len(seq.output) > 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "the detokenizer failed")
            return process(seq, logprob)

        monkeypatch.setattr(engine.outputs, "process", failing_process)
    expected = {p: offline.complete(p, max_tokens=40, temperature=0.0, ignore_eos=True).text for p in PROMPTS[:4]}
    marked_body = {**well_formed("the cat"), "max_tokens": 33, "presence_penalty": 0.5}
    params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True, presence_penalty=0.5)
    stream = offline.engine.stream("the cat", params)
    alone = "".join(next(stream).text for _ in range(3))  # what its first three tokens release (a piece may wait)
    stream.close()

    async def main() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            bodies = [marked_body] + [well_formed(p) for p in PROMPTS[:4]]
            return await asyncio.gather(*[read_stream(http, body) for body in bodies])

    (text, events), *others = asyncio.run(main())
    assert [t for t, _ in others] == [expected[p] for p in PROMPTS[:4]]
    assert text == alone
    error = events[-1]["error"]
    assert error["message"] and error["type"] == ("invalid_request_error" if where == "penalties" else "server_error")
    if where == "penalties":
        assert "non-finite" in error["message"]
    assert server.engine.is_running and blocks_in_use(server) == 0


def test_the_sampler_fails_a_request_with_non_finite_logits_alone(tiny_dir, offline) -> None:
    """Offline too: the request whose adjusted logits are NaN finishes with "error"; the other is its own greedy
    text; every block returns."""
    engine = Engine(*load_pretrained(tiny_dir))
    sampler = engine.sampler
    choose = sampler._token

    def nan_for_marked(seq: Any, logits: Any, *args: Any) -> Any:
        return choose(seq, logits * float("nan") if seq.params.max_tokens == 7 else logits, *args)

    sampler._token = nan_for_marked  # type: ignore[method-assign]
    good = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    bad = SamplingParams(max_tokens=7, temperature=0.8, seed=1)
    failed, done = engine.generate(["the cat", "a dog"], [bad, good])
    assert failed.finish_reason == "error" and failed.token_ids == [] and "not a distribution" in failed.error
    assert done.token_ids == offline.complete("a dog", max_tokens=12, temperature=0.0, ignore_eos=True).token_ids
    assert engine.num_blocks_in_use == 0 and not engine.requests
    with pytest.raises(NonFiniteLogits, match="non-finite"):  # the guard of adjusted logits
        _check_finite(torch.tensor([0.0, float("nan")]))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the point
def test_when_the_engine_thread_dies_every_request_is_answered_and_health_is_503(tiny_dir, one_thread) -> None:
    live = LiveServer(*load_pretrained(tiny_dir))
    engine = live.engine.engine
    step = engine.step

    def dying_step() -> list:
        if any(seq.params.max_tokens == 21 for seq in engine.scheduler.running):
            raise SystemExit("the engine thread is gone")
        time.sleep(0.01)  # the streams are still running when it dies
        return step()

    engine.step = dying_step  # type: ignore[method-assign]
    try:

        async def main() -> list:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                long = {**well_formed("a dog"), "max_tokens": 50}
                streams = [asyncio.ensure_future(read_stream(http, long)) for _ in range(3)]
                await asyncio.sleep(0.1)
                whole = http.post(CMPL, json={**well_formed("the sun"), "max_tokens": 21})
                return await asyncio.gather(*streams, whole, return_exceptions=True)

        *streams, whole = asyncio.run(main())
        assert_openai_error(whole, 503)
        for _, events in streams:
            assert "error" in events[-1] and "stopped" in events[-1]["error"]["message"]
        assert httpx.get(f"{live.url}/health").status_code == 503
        assert_openai_error(httpx.post(f"{live.url}{CMPL}", json=well_formed("hi")), 503)
    finally:
        live.stop()
