"""`tformer serve` against bad requests: each malformed or unsupported one gets OpenAI's error shape and status,
and hypothesis fuzzing never gets a 5xx.

A real server on loopback answers. The reference is OpenAI's error format (message, type, param, code), and after
the fuzzing the server must still answer what the offline `Engine` generates for the same request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import CHAT, CMPL, NAME, USER, LiveServer, assert_openai_error, client, metric

from tformer.checkpoints import load_pretrained
from tformer.engine import EngineConfig

# ---- errors: OpenAI's shape and status, never a 5xx --------------------------------------------------------------

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
    (CMPL, {"prompt": ["a"] * 20, "n": 16}, 400, "prompt"),  # 320 choices: more than 256
    (CMPL, {"prompt": ["hi", ""]}, 400, None),  # one prompt of the batch is empty
    (CMPL, {"prompt": ["hi", " ".join(["sun"] * 100)]}, 400, "prompt"),  # one overflows the context
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
    (CMPL, {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),  # OpenAI's legacy limit is 5
    (CMPL, {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),  # the prompt alone needs echo
    (CMPL, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (CMPL, {"prompt": "hi", "stop": ""}, 400, None),
    (CMPL, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "logit_bias": {"the": 5}}, 400, "logit_bias"),  # keys are token ids
    (CMPL, {"prompt": "hi", "logit_bias": {"\u00b2": 5}}, 400, "logit_bias"),  # a digit int() reads, not an id
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, None),  # outside the vocabulary
    (CMPL, {"prompt": "hi", "beam_width": 3, "logprobs": 1}, 400, None),  # beams rank by the model's own scores
    (CMPL, {"prompt": "hi", "beam_width": 0}, 400, "beam_width"),
    (CMPL, {"prompt": "hi", "beam_width": 3, "n": 2}, 400, None),  # beam search returns one hypothesis
    (CMPL, {"prompt": "hi", "beam_width": 3, "stop": "."}, 400, None),
    (CHAT, {"max_tokens": 2}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": USER, "n": "3"}, 400, "n"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": USER, "modalities": ["text", "audio"]}, 400, "modalities"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "model": "other"}, 404, "model"),
    (CHAT, {"messages": USER, "max_completion_tokens": 500}, 400, "max_completion_tokens"),
    ("/v1/embeddings", {"input": []}, 400, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 2}, 400, "dimensions"),
]


ERROR_IDS = [
    f"{i}-{path.removeprefix('/v1/').replace('/', '-')}-{param}" for i, (path, _, _, param) in enumerate(ERROR_CASES)
]


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


def test_chat_without_a_template_is_a_400_that_says_why(tiny, monkeypatch) -> None:
    monkeypatch.setattr(tiny.tokenizer, "chat_template", None)
    response = httpx.post(f"{tiny.url}{CHAT}", json={"messages": USER})
    assert_openai_error(response, 400, "messages")
    assert "no chat template" in response.json()["error"]["message"]


# ---- fuzzing ------------------------------------------------------------------------------------------------------

SPECIAL = st.sampled_from(
    [
        0,
        -1,
        1,
        2**31,
        2**63,
        2**64,
        10**40,
        -(10**40),
        1e308,
        -1e308,
        5e-324,
        1e-300,
        "",
        "\x00",
        "\ud800",
        "🙂" * 50,
        "tiny",
        "user",
        [],
        {},
        [0],
        [[1, 2]],
        ["a"],
        True,
    ]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | SPECIAL,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "x"]) | JSON, "content": st.text(max_size=20) | JSON}
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "echo",
    "logprobs",
    "best_of",
    "ignore_eos",
    "presence_penalty",
    "logit_bias",
    "top_logprobs",
    "frequency_penalty",
    "repetition_penalty",
    "user",
    "unknown",
]
BASES = [
    {"model": NAME, "prompt": "the cat", "max_tokens": 2, "temperature": 0},
    {"model": NAME, "messages": USER, "max_tokens": 2, "temperature": 0},
]


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
    st.sampled_from(
        [
            ("POST", CMPL),
            ("POST", CHAT),
            ("GET", "/v1/models"),
            ("GET", "/v1/models/x%00"),
            ("POST", "/v1/models"),
            ("GET", "/health"),
            ("DELETE", CHAT),
            ("POST", "/v1/../v1/completions"),
        ]
    ),
    st.one_of(mutated_body().map(encode_json), JSON.map(encode_json), st.binary(max_size=40)),
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "text/plain",
            "",
            "application/x-www-form",
            "multipart/form-data; boundary=x",
            "application/vnd+json",
        ]
    ),
    st.dictionaries(
        st.sampled_from(["authorization", "x-request-id", "accept", "content-encoding", "expect"]),
        st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=20),
        max_size=2,
    ),
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
