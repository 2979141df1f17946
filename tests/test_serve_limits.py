"""`tformer serve`'s limits and guards, as a client meets them: the API key on every route but /health and the
page, the Host check of a loopback bind, the page's frame-ancestors, --max-waiting's 503 with Retry-After, the
body cap's 413 before the body is read, --request-timeout's "timeout" with its blocks freed, --shutdown-timeout's
error chunk and [DONE], and the embeddings' token cap and step-sized chunks.

References: the offline `Engine` for the text a request produces (a timed-out one's is a prefix of it), the
offline `Embedder` for vectors, and the observable facts (status codes, headers, KV blocks in use).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
from serve_helpers import CHAT, CMPL, NAME, USER, LiveServer, assert_openai_error

from tformer.checkpoints import load_pretrained
from tformer.engine import EngineConfig
from tformer.engine.embedding import Embedder
from tformer.serve.middleware import LOOPBACK_HOSTS, ServerLimits

KEY = "the-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GENERATE = {"model": NAME, "prompt": "the cat", "max_tokens": 2, "temperature": 0}
# every route of the app, with a request that reaches it
ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{NAME}", None),
    ("POST", CMPL, GENERATE),
    ("POST", CHAT, {"model": NAME, "messages": USER, "max_tokens": 2}),
    ("POST", "/v1/embeddings", {"input": "the cat"}),
    ("POST", "/tokenize", {"prompt": "the cat"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/tokenizer_info", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/playground", None),
    ("POST", "/v1/translations", {"input": "the cat"}),
    ("GET", "/v1/runs", None),
    ("GET", "/v1/runs/x", None),
    ("GET", "/no/such/route", None),
]
OPEN_ROUTES = [("GET", "/health", None), ("GET", "/", None), ("GET", "/static/style.css", None)]


def slow_steps(server: LiveServer, seconds: float) -> None:
    """Each engine step takes at least `seconds`: requests stay in flight long enough to meet the limits."""
    engine = server.engine.engine
    step = engine.step

    def slow() -> list:
        time.sleep(seconds)
        return step()

    engine.step = slow  # type: ignore[method-assign]


def wait_for(condition: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def sse(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def keyed(tiny_dir, one_thread):
    live = LiveServer(*load_pretrained(tiny_dir), api_key=KEY, limits=ServerLimits(allowed_hosts=LOOPBACK_HOSTS))
    yield live
    live.stop()


def test_every_route_needs_the_key_but_health_and_the_page(keyed) -> None:
    app_routes = {route.path for route in keyed.app.routes}  # a route added later must join the lists above
    listed = {path for _, path, _ in ROUTES + OPEN_ROUTES}
    served = {p.replace("{model_id:path}", NAME).replace("{run_id:path}", "x") for p in app_routes}
    assert served <= listed | {"/static"}
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        for method, path, body in ROUTES:
            without = http.request(method, path, json=body)
            assert_openai_error(without, 401)
            assert without.headers["WWW-Authenticate"] == "Bearer"
            assert http.request(method, path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            given = http.request(method, path, json=body, headers=AUTH)
            assert given.status_code != 401, (path, given.text)
            assert given.status_code < 500, (path, given.text)
        for method, path, body in OPEN_ROUTES:
            assert http.request(method, path, json=body).status_code == 200, path
        page = http.get("/")
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]


def test_a_loopback_server_answers_only_its_own_host_names(keyed) -> None:
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        assert http.get("/health").status_code == 200  # Host: 127.0.0.1:<port>
        for host in ("localhost:8000", "[::1]:8000", "LOCALHOST"):
            assert http.get("/health", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", ""):
            assert_openai_error(http.get("/health", headers={"Host": host}), 400)
            assert_openai_error(http.post(CMPL, json=GENERATE, headers={**AUTH, "Host": host}), 400)


@pytest.fixture
def limited(tiny_dir, one_thread):
    """A server of one running request and two waiting, a 1 KiB body cap and half a second per request."""
    limits = ServerLimits(max_body_bytes=1024, max_waiting=2, request_timeout=0.5, max_embedding_tokens=16)
    config = EngineConfig(max_seqs=1, max_batched_tokens=8)
    live = LiveServer(*load_pretrained(tiny_dir), config, limits=limits, shutdown_timeout=0.5)
    yield live
    if live.thread.is_alive():
        live.stop()


def test_max_waiting_turns_the_next_request_away_with_retry_after(limited, offline) -> None:
    slow_steps(limited, 0.005)
    limited.engine.request_timeout = None  # the last of the three waits for the two before it
    body = {**GENERATE, "max_tokens": 30, "ignore_eos": True, "stream": True}
    expected = offline.complete("the cat", max_tokens=30, temperature=0.0, ignore_eos=True).text
    texts: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{limited.url}{CMPL}", json=body, timeout=30) as response:
            events = sse(response)
        texts.append("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]))

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: limited.engine.stats.running == 1 and limited.engine.stats.waiting == 2)
    turned_away = httpx.post(f"{limited.url}{CMPL}", json=GENERATE, timeout=30)
    assert_openai_error(turned_away, 503)
    assert turned_away.headers["Retry-After"] == "1" and turned_away.json()["error"]["code"] == "server_busy"
    for thread in threads:
        thread.join(30)
    assert texts == [expected] * 3  # the three in flight were served whole
    assert httpx.post(f"{limited.url}{CMPL}", json=GENERATE, timeout=30).status_code == 200  # room again


def test_a_body_over_the_cap_is_refused_before_it_is_read(limited) -> None:
    big = {**GENERATE, "prompt": "the cat " * 200}
    assert_openai_error(httpx.post(f"{limited.url}{CMPL}", json=big, timeout=30), 413)
    chunked = httpx.post(f"{limited.url}{CMPL}", content=iter([json.dumps(big).encode()]), timeout=30)
    assert_openai_error(chunked, 413)  # no Content-Length: counted as it arrives
    # a declared length of 1 GB with no body sent at all: the answer comes without waiting for a byte of it
    host, port = limited.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1000000000\r\n\r\n".encode())
        assert raw.recv(4096).split(b"\r\n")[0] == b"HTTP/1.1 413 Request Entity Too Large"
    assert httpx.post(f"{limited.url}{CMPL}", json=GENERATE, timeout=30).status_code == 200


def test_a_slow_request_times_out_and_frees_its_blocks(limited, offline) -> None:
    slow_steps(limited, 0.05)
    body = {**GENERATE, "max_tokens": 40, "ignore_eos": True}
    expected = offline.complete("the cat", max_tokens=40, temperature=0.0, ignore_eos=True).text
    whole = httpx.post(f"{limited.url}{CMPL}", json=body, timeout=30).json()["choices"][0]
    assert whole["finish_reason"] == "timeout" and expected.startswith(whole["text"]) and whole["text"] != expected
    with httpx.stream("POST", f"{limited.url}{CMPL}", json={**body, "stream": True}, timeout=30) as response:
        events = sse(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "timeout"
    assert expected.startswith("".join(c["choices"][0]["text"] for c in chunks))
    limited.engine.request_timeout = 0.0  # out of time before its first step: its two samples end, unforked
    choices = httpx.post(f"{limited.url}{CMPL}", json={**body, "n": 2}, timeout=30).json()["choices"]
    assert [(c["index"], c["finish_reason"], c["text"]) for c in choices] == [(0, "timeout", ""), (1, "timeout", "")]
    wait_for(lambda: limited.engine.stats.blocks_in_use == 0)


def test_shutdown_ends_running_streams_with_an_error_chunk_and_done(limited, offline) -> None:
    slow_steps(limited, 0.05)
    limited.engine.request_timeout = None
    body = {**GENERATE, "max_tokens": 40, "ignore_eos": True, "stream": True}
    expected = offline.complete("the cat", max_tokens=40, temperature=0.0, ignore_eos=True).text
    with httpx.stream("POST", f"{limited.url}{CMPL}", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        stopper = threading.Thread(target=limited.stop)
        stopper.start()
        events = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
    stopper.join(30)
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert expected.startswith(text) and text != expected
    assert not limited.engine.is_running and limited.engine.stats.blocks_in_use == 0


def test_embeddings_are_capped_per_request_and_run_in_step_sized_chunks(limited, tiny_dir) -> None:
    """max_batched_tokens 8: five inputs run on the engine thread in chunks of at most 8 tokens, equal to the
    offline embedder's vectors; more than 16 tokens in one request is a 400."""
    model, tokenizer = load_pretrained(tiny_dir)
    embedder = Embedder(model, tokenizer)
    inputs = ["the cat", "a dog ran", "sun", "birds sing at", "the"]
    calls: list[int] = []
    call = limited.engine.call

    async def counted(fn: Any) -> Any:
        calls.append(1)
        return await call(fn)

    limited.engine.call = counted  # type: ignore[method-assign]
    answer = httpx.post(f"{limited.url}/v1/embeddings", json={"input": inputs}, timeout=30).json()
    vectors = np.array([item["embedding"] for item in answer["data"]])
    np.testing.assert_allclose(vectors, embedder.embed(inputs).numpy(), atol=1e-6)
    assert answer["usage"]["prompt_tokens"] == 14 and len(calls) == 3  # 1 + 2 + 2 tokens, then 4, then 5
    too_many = httpx.post(f"{limited.url}/v1/embeddings", json={"input": inputs * 3}, timeout=30)
    assert_openai_error(too_many, 400, "input")
