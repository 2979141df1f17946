"""`tformer serve` as clients see it: a real server on loopback, the official openai client, httpx and fuzzing.

Every answer is compared with what the offline `Engine` generates for the same request.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import free_port
from tformer import ModelConfig, build_model
from tformer.data.tokenizer import Tokenizer
from tformer.inference import Completion, Engine, EngineConfig, RequestError, SamplingParams
from tformer.inference.quantize import set_precision
from tformer.interop.loading import load_pretrained
from tformer.serve import AsyncEngine, EngineStopped, create_app

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today", "birds sing at dawn"] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NAME = "tiny"
KEY = "sekret-key"


def save_tiny_checkpoint(directory: Path, max_seq_len: int) -> Path:
    """A tiny LLaMA-style decoder and a BPE tokenizer with a chat template, saved as a tformer checkpoint."""
    tokenizer = Tokenizer.train(TEXTS, vocab_size=300)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny-llama", vocab_size=len(tokenizer), dropout=0.0, max_seq_len=max_seq_len)
    build_model(config).eval().save(directory)
    tokenizer.save(directory)
    return directory


class LiveServer:
    """uvicorn serving `create_app(...)` in a background thread of this process, on a free loopback port."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 name: str = NAME, draft: torch.nn.Module | None = None) -> None:
        self.tokenizer = tokenizer
        self.engine = AsyncEngine(Engine(model, tokenizer, config, draft=draft))
        self.app = create_app(self.engine, tokenizer, name)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.engine.is_running, "the engine thread outlived the server"


class Offline:
    """The reference: an offline Engine on its own copy of the same checkpoint."""

    def __init__(self, path: Path | str, quantize: str | None = None) -> None:
        model, self.tokenizer = load_pretrained(path)
        set_precision(model, "auto", quantize)  # as `tformer serve` does: bf16 activations when quantized
        self.engine = Engine(model, self.tokenizer)

    def complete(self, prompt: str | list[int], **params: Any) -> Completion:
        return self.engine.generate([prompt], SamplingParams(**params))[0]

    def chat(self, messages: list[dict[str, str]], **params: Any) -> Completion:
        return self.complete(self.tokenizer.apply_chat_template(messages), **params)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_seq_len=64)


@pytest.fixture(scope="module")
def offline(tiny_dir) -> Offline:
    return Offline(tiny_dir)


@pytest.fixture(scope="module")
def tiny(tiny_dir, one_thread) -> Iterator[LiveServer]:
    server = LiveServer(*load_pretrained(tiny_dir))
    yield server
    server.stop()


def client(server: LiveServer, cls: type = openai.OpenAI) -> Any:
    return cls(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error


def test_async_engine_streams_then_cancels_everything_on_shutdown(tiny_dir, offline, one_thread) -> None:
    engine = AsyncEngine(Engine(*load_pretrained(tiny_dir)))
    expected = offline.complete("the cat", max_tokens=6, temperature=0.0)

    async def main() -> None:
        engine.start()
        outputs = [o async for o in engine.generate("the cat", SamplingParams(max_tokens=6, temperature=0.0))]
        assert "".join(o.text for o in outputs) == expected.text and outputs[-1].finished
        with pytest.raises(RequestError, match="empty"):
            await engine.add("empty", [], SamplingParams())
        stream = engine.generate("a dog", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)  # what the server's lifespan does at the end
        with pytest.raises(EngineStopped, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineStopped):
            await engine.add("late", [5], SamplingParams())

    asyncio.run(main())
    assert not engine.is_running and engine.stats.blocks_in_use == 0 and engine.num_cancelled == 1


# ---- the openai client against the tiny model ------------------------------------------------------------------


def test_models_health_and_metrics(tiny) -> None:
    assert [m.id for m in client(tiny).models.list().data] == [NAME]
    assert client(tiny).models.retrieve(NAME).id == NAME
    assert httpx.get(f"{tiny.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{tiny.url}/metrics").text
    for name in ("tformer_requests_waiting", "tformer_requests_running", "tformer_kv_blocks_in_use",
                 "tformer_prompt_tokens_total", "tformer_generation_tokens_total"):
        assert re.search(rf"^# TYPE {name} (gauge|counter)$", text, re.MULTILINE), name
    assert re.search(r'^tformer_requests_total\{endpoint="/v1/models",status="200"\} [1-9]', text, re.MULTILINE)


def test_a_server_with_a_draft_streams_the_models_own_greedy_text(tiny_dir, offline, one_thread) -> None:
    model, tokenizer = load_pretrained(tiny_dir)
    draft = set_precision(load_pretrained(tiny_dir)[0], "float32", "int8")  # as `--draft-quantize int8`
    server = LiveServer(model, tokenizer, EngineConfig(num_speculative_tokens=3), draft=draft)
    try:
        expected = offline.complete("the cat", max_tokens=12, temperature=0.0, ignore_eos=True)
        stream = client(server).completions.create(model=NAME, prompt="the cat", max_tokens=12, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected.text
        drafted = metric(server.url, "tformer_spec_decode_draft_tokens_total")
        assert 0 < metric(server.url, "tformer_spec_decode_accepted_tokens_total") <= drafted
    finally:
        server.stop()


@pytest.mark.parametrize("prompt", ["the cat", [5, 17, 42, 9]], ids=["text", "token-ids"])
def test_completions_equal_the_offline_engine(tiny, offline, prompt) -> None:
    expected = offline.complete(prompt, max_tokens=10, temperature=0.0)
    result = client(tiny).completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert result.object == "text_completion" and result.model == NAME and result.id.startswith("cmpl-")
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    prompt_tokens = len(prompt) if isinstance(prompt, list) else len(offline.tokenizer.encode(prompt))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, len(expected.token_ids))
    chunks = list(client(tiny).completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                                  stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_stop_strings_and_seeded_sampling_equal_the_offline_engine(tiny, offline) -> None:
    expected = offline.complete("a dog", max_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=7)
    result = client(tiny).completions.create(model=NAME, prompt="a dog", max_tokens=12, temperature=0.9, top_p=0.9,
                                             seed=7, extra_body={"top_k": 20})
    assert result.choices[0].text == expected.text
    stop = expected.text[3:5] or "x"
    expected = offline.complete("a dog", max_tokens=12, temperature=0.0, stop=[stop])
    result = client(tiny).completions.create(model=NAME, prompt="a dog", max_tokens=12, temperature=0, stop=stop)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (expected.text, expected.finish_reason)


def test_chat_completions_equal_the_offline_engine(tiny, offline) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sun is"}]
    expected = offline.chat(messages, max_tokens=8, temperature=0.0)
    result = client(tiny).chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage.completion_tokens == len(expected.token_ids)
    stream = client(tiny).chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_raw_stream_is_openai_sse_ending_with_done(tiny) -> None:
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{tiny.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_64_concurrent_streams_each_get_their_own_tokens(tiny, offline) -> None:
    prompts = [f"{TEXTS[i % 4]} {i}" for i in range(64)]
    lengths = [4 + i % 7 for i in range(64)]  # a misrouted token would also break the token counts
    expected = offline.engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths])
    assert len({e.text for e in expected}) > 40, "the reference outputs must differ for misrouting to show"

    async def one(api: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, str | None, int]:
        stream = await api.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
        text, reason, tokens = "", None, -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, reason, tokens

    async def run_all() -> list[tuple[str, str | None, int]]:
        api = client(tiny, openai.AsyncOpenAI)
        return await asyncio.gather(*(one(api, p, n) for p, n in zip(prompts, lengths, strict=True)))

    results = asyncio.run(run_all())
    assert results == [(e.text, e.finish_reason, len(e.token_ids)) for e in expected]
    assert metric(tiny.url, "tformer_kv_blocks_in_use") == 0


# ---- errors: OpenAI's shape and status, never a 5xx --------------------------------------------------------------

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
ERROR_CASES = [
    (CMPL, b'{"model": "tiny", "prompt": ', 400, None),  # malformed JSON
    (CMPL, b'\xff\xfe{"prompt": 1}', 400, None),  # not UTF-8
    (CMPL, b"[1, 2, 3]", 400, None),  # JSON, but not an object
    (CMPL, b"[" * 100_000 + b"]" * 100_000, 400, None),  # nested too deep for the JSON parser
    (CMPL, b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "prompt"),  # a lone surrogate
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages"),
    (CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (CMPL, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 2.0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (CMPL, {"max_tokens": 5}, 400, "prompt"),
    (CMPL, {"prompt": ["a", "b"]}, 400, "prompt"),
    (CMPL, {"prompt": [1, "b"]}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, None),
    (CMPL, {"prompt": [10**9]}, 400, None),  # a token id outside the vocabulary
    (CMPL, {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    (CMPL, {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),  # beyond the 64-token context
    (CMPL, {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    (CMPL, {"prompt": " ".join(["sun"] * 100)}, 400, "prompt"),  # the prompt alone overflows the context
    (CMPL, {"prompt": "hi", "n": 17}, 400, "n"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (CMPL, {"prompt": "hi", "logprobs": 1}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "echo": True}, 400, "echo"),
    (CMPL, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (CMPL, {"prompt": "hi", "stop": ""}, 400, None),
    (CMPL, {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    (CMPL, {"prompt": "hi", "beam_width": 0}, 400, "beam_width"),
    (CMPL, {"prompt": "hi", "beam_width": 3, "n": 2}, 400, None),  # beam search returns one hypothesis
    (CMPL, {"prompt": "hi", "beam_width": 3, "stop": "."}, 400, None),
    (CHAT, {"max_tokens": 2}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": USER, "n": "3"}, 400, "n"),
    (CHAT, {"messages": USER, "logprobs": True}, 400, "logprobs"),
    (CHAT, {"messages": USER, "model": "other"}, 404, "model"),
    (CHAT, {"messages": USER, "max_completion_tokens": 500}, 400, "max_completion_tokens"),
    ("/v1/embeddings", {"input": "hi"}, 404, None),
]


ERROR_IDS = [f"{i}-{path.removeprefix('/v1/').replace('/', '-')}-{param}" for i, (path, _, _, param) in
             enumerate(ERROR_CASES)]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES, ids=ERROR_IDS)
def test_bad_requests_get_openai_errors(tiny, path, body, status, param) -> None:
    if isinstance(body, bytes):
        response = httpx.post(f"{tiny.url}{path}", content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{tiny.url}{path}", json=body)
    assert_openai_error(response, status, param)


def test_wrong_method_and_unknown_model_via_the_client(tiny) -> None:
    assert_openai_error(httpx.get(f"{tiny.url}{CMPL}"), 405)
    with pytest.raises(openai.NotFoundError) as err:
        client(tiny).chat.completions.create(model="nope", messages=USER)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n"):
        client(tiny).completions.create(model=NAME, prompt="hi", n=17)


def test_n_samples_equal_the_offline_engine_whole_and_streamed(tiny, offline) -> None:
    params = {"max_tokens": 10, "temperature": 1.0, "seed": 3}
    expected = offline.engine.generate(["the moon"], SamplingParams(n=3, **params))
    assert [c.index for c in expected] == [0, 1, 2] and len({c.text for c in expected}) > 1
    result = client(tiny).completions.create(model=NAME, prompt="the moon", n=3, **params)
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [
        (c.index, c.text, c.finish_reason) for c in expected]
    assert result.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    stream = client(tiny).chat.completions.create(model=NAME, messages=USER, n=2, stream=True, **params)
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    expected = offline.engine.generate([offline.tokenizer.apply_chat_template(USER)], SamplingParams(n=2, **params))
    assert texts == [c.text for c in expected] and reasons == [c.finish_reason for c in expected]
    assert metric(tiny.url, "tformer_kv_blocks_in_use") == 0


def test_beam_search_extension_equals_the_offline_engine_whole_and_streamed(tiny, offline) -> None:
    params = {"max_tokens": 10, "beam_width": 3, "length_penalty": 0.6}
    expected = offline.engine.generate(["the moon"], SamplingParams(**params))[0]
    body = {"model": NAME, "prompt": "the moon", **params}
    whole = httpx.post(f"{tiny.url}{CMPL}", json=body).json()
    assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == (expected.text,
                                                                                expected.finish_reason)
    streamed = client(tiny).completions.create(model=NAME, prompt="the moon", stream=True,
                                               extra_body=params, max_tokens=10)
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert metric(tiny.url, "tformer_kv_blocks_in_use") == 0


def test_chat_without_a_template_is_a_400_that_says_why(tiny, monkeypatch) -> None:
    monkeypatch.setattr(tiny.tokenizer, "chat_template", None)
    response = httpx.post(f"{tiny.url}{CHAT}", json={"messages": USER})
    assert_openai_error(response, 400, "messages")
    assert "no chat template" in response.json()["error"]["message"]


# ---- fuzzing ------------------------------------------------------------------------------------------------------

SPECIAL = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 10**40, -(10**40), 1e308, -1e308, 5e-324, 1e-300, "",
                           "\x00", "\ud800", "🙂" * 50, "tiny", "user", [], {}, [0], [[1, 2]], ["a"], True])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | SPECIAL,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]) | JSON,
                                 "content": st.text(max_size=20) | JSON})
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "n", "stream", "stream_options", "echo", "logprobs", "best_of", "ignore_eos",
          "presence_penalty", "logit_bias", "user", "unknown"]
BASES = [{"model": NAME, "prompt": "the cat", "max_tokens": 2, "temperature": 0},
         {"model": NAME, "messages": USER, "max_tokens": 2, "temperature": 0}]


@st.composite
def mutated_body(draw: st.DrawFn) -> Any:
    """A valid body with a few fields deleted or replaced by arbitrary JSON (or messages of odd shapes)."""
    body = dict(draw(st.sampled_from(BASES)))
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
        if draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(st.lists(MESSAGE, max_size=3) if key == "messages" else JSON)
    return body


def encode_json(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN, Infinity and lone surrogates included


FUZZ_REQUEST = st.tuples(
    st.sampled_from([("POST", CMPL), ("POST", CHAT), ("GET", "/v1/models"), ("GET", "/v1/models/x%00"),
                     ("POST", "/v1/models"), ("GET", "/health"), ("DELETE", CHAT), ("POST", "/v1/../v1/completions")]),
    st.one_of(mutated_body().map(encode_json), JSON.map(encode_json), st.binary(max_size=40)),
    st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", "", "application/x-www-form",
                     "multipart/form-data; boundary=x", "application/vnd+json"]),
    st.dictionaries(st.sampled_from(["authorization", "x-request-id", "accept", "content-encoding", "expect"]),
                    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=20), max_size=2),
)


@pytest.fixture(scope="module")
def small(tiny_dir, one_thread) -> Iterator[LiveServer]:
    """A server whose context is 16 tokens, so that any request that happens to be valid is quick."""
    server = LiveServer(*load_pretrained(tiny_dir), EngineConfig(max_model_len=16))
    yield server
    server.stop()


def test_fuzzed_requests_never_get_a_5xx(small, offline) -> None:
    seen: dict[int, int] = {}
    with httpx.Client(base_url=small.url, timeout=60) as http:

        @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(FUZZ_REQUEST)
        def check(request: tuple[tuple[str, str], bytes, str, dict[str, str]]) -> None:
            (method, path), body, content_type, headers = request
            headers = {**headers, "content-type": content_type} if content_type else headers
            response = http.request(method, path, content=body, headers=headers)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (response.status_code, response.text, body)
            if response.status_code >= 400:
                assert_openai_error(response, response.status_code)

        check()
    assert seen.get(400, 0) > 50 and seen.get(200, 0) > 0, seen  # the fuzzing reached the validators and beyond
    expected = offline.complete("the cat", max_tokens=5, temperature=0.0)
    answer = client(small).completions.create(model=NAME, prompt="the cat", max_tokens=5, temperature=0)
    assert answer.choices[0].text == expected.text
    assert metric(small.url, "tformer_kv_blocks_in_use") == 0 and small.engine.is_running


# ---- real weights -------------------------------------------------------------------------------------------------


def test_smollm2_answers_equal_the_offline_engine(one_thread, smollm2_pretrained) -> None:
    model, tokenizer = smollm2_pretrained
    config = EngineConfig(num_blocks=24, max_model_len=256)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [tokenizer.apply_chat_template(messages), "The capital of France is"]
    expected = Engine(model, tokenizer, config).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    server = LiveServer(model, tokenizer, config, name="smollm2")
    try:
        api = client(server)
        chat = api.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
        chunks = api.completions.create(model="smollm2", prompt=prompts[1], max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks)
    finally:
        server.stop()
    assert chat.choices[0].message.content == expected[0].text and "Paris" in expected[0].text
    assert streamed == expected[1].text


# ---- `tformer serve` as a process: API key, disconnects, SIGTERM -------------------------------------------------

AUTH = {"Authorization": f"Bearer {KEY}"}
QUANTIZE = "int8"  # the served model's weights (bf16 activations): the offline reference does the same to its copy


class CliServer:
    """`python -m tformer serve` on a tiny checkpoint with a 1024-token context and INT8 weights (bf16 activations),
    started when the module starts."""

    def __init__(self, path: Path, log: Path) -> None:
        self.path, self.log = path, log
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "tformer", "serve", "--model", str(path), "--port", self.url.rsplit(":", 1)[1],
                   "--api-key", KEY, "--model-name", NAME, "--quantize", QUANTIZE, "--max-seqs", "16",
                   "--kv-cache-mb", "64"]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"`tformer serve` exited:\n{self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError(f"`tformer serve` did not come up:\n{self.log.read_text()}")


@pytest.fixture(scope="module", autouse=True)
def _cli_process(request, tmp_path_factory) -> Iterator[CliServer | None]:
    """Starts the process with the module (if a selected test needs it), so its imports overlap the other tests."""
    if not any("cli" in item.fixturenames for item in request.session.items):
        yield None
        return
    directory = tmp_path_factory.mktemp("long")
    server = CliServer(save_tiny_checkpoint(directory / "model", max_seq_len=1024), directory / "serve.log")
    yield server
    if server.process.poll() is None:
        server.process.terminate()
        server.process.wait(30)


@pytest.fixture(scope="module")
def cli(_cli_process) -> CliServer:
    _cli_process.wait_ready()
    return _cli_process


def test_api_key_is_required_on_v1(cli) -> None:
    assert_openai_error(httpx.get(f"{cli.url}/v1/models"), 401)
    assert_openai_error(httpx.get(f"{cli.url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    assert_openai_error(httpx.post(f"{cli.url}{CMPL}", content=b"{not json"), 401)  # the key is checked first
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{cli.url}/v1", api_key="nope", max_retries=0).models.list()
    api = openai.OpenAI(base_url=f"{cli.url}/v1", api_key=KEY, max_retries=0)
    expected = Offline(cli.path, QUANTIZE).complete("the cat", max_tokens=6, temperature=0.0)
    assert api.completions.create(model=NAME, prompt="the cat", max_tokens=6, temperature=0).choices[0].text == \
        expected.text
    unauthorized = 'tformer_requests_total{endpoint="/v1/models",status="401"}'
    assert metric(cli.url, unauthorized) == 3  # two by hand, one by the client


def test_disconnected_clients_free_their_kv_blocks(cli) -> None:
    aborted = metric(cli.url, "tformer_requests_aborted_total")
    body = {"model": NAME, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}

    async def open_streams_then_leave(n: int) -> float:
        async with httpx.AsyncClient(base_url=cli.url, headers=AUTH, timeout=60) as http:
            streams = [http.stream("POST", CMPL, json={**body, "prompt": f"the cat {i}"}) for i in range(n)]
            readers = []  # kept alive: a line iterator closes its connection when it is garbage-collected
            for stream in streams:
                readers.append((await stream.__aenter__()).aiter_lines())
                while not (await anext(readers[-1])).startswith("data: {"):
                    pass  # until generation has started: the request holds KV blocks
            in_use = metric(cli.url, "tformer_kv_blocks_in_use")
            for stream in streams:
                await stream.__aexit__(None, None, None)  # unread: httpx closes the connection
        return in_use

    assert asyncio.run(open_streams_then_leave(6)) >= 6
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{cli.url}{CMPL}", headers=AUTH, json={**body, "stream": False, "prompt": "a dog"},
                   timeout=httpx.Timeout(30, read=0.5))
    deadline = time.monotonic() + 30
    while metric(cli.url, "tformer_kv_blocks_in_use") > 0:
        assert time.monotonic() < deadline, "KV blocks were not freed after the clients left"
        time.sleep(0.1)
    assert metric(cli.url, "tformer_requests_aborted_total") == aborted + 7
    assert metric(cli.url, "tformer_requests_running") == 0


def test_sigterm_lets_streams_finish_then_exits(cli) -> None:
    """Runs last: the server stops accepting, finishes the stream in flight, stops the engine and exits."""
    expected = Offline(cli.path, QUANTIZE).complete("a dog", max_tokens=80, temperature=0.0, ignore_eos=True)
    body = {"model": NAME, "prompt": "a dog", "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cli.url}{CMPL}", headers=AUTH, json=body, timeout=60) as response:
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        cli.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        with pytest.raises(httpx.ConnectError):  # no new connections once shutdown began
            while time.monotonic() < deadline:
                httpx.get(f"{cli.url}/health", timeout=5)
                time.sleep(0.05)
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert cli.process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after shutting down
    log = cli.log.read_text()
    assert "Traceback" not in log and "Finished server process" in log, log
