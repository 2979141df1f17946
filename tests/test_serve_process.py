"""`python -m tformer serve` as a process: the API key, clients that disconnect (their KV blocks are freed) and
SIGTERM (the stream in flight finishes, then the process exits).

The process serves a tiny checkpoint with INT8 weights; every answer is compared with what the offline `Engine`
generates for the same request on its own copy, quantized the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import free_port
from serve_helpers import CMPL, NAME, Offline, assert_openai_error, metric, save_tiny_checkpoint

# ---- `tformer serve` as a process: API key, disconnects, SIGTERM -------------------------------------------------

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUANTIZE = "int8"  # the served model's weights (bf16 activations): the offline reference does the same to its copy


class CliServer:
    """`python -m tformer serve` on a tiny checkpoint with a 1024-token context and INT8 weights (bf16 activations),
    started when the module starts."""

    def __init__(self, path: Path, log: Path) -> None:
        self.path, self.log = path, log
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [
            sys.executable,
            "-m",
            "tformer",
            "serve",
            "--model",
            str(path),
            "--port",
            self.url.rsplit(":", 1)[1],
            "--model-name",
            NAME,
            "--quantize",
            QUANTIZE,
            "--max-seqs",
            "16",
            "--kv-cache-mb",
            "64",
        ]
        env = {**os.environ, "TFORMER_API_KEY": KEY}  # the documented way: a --api-key flag shows in `ps`
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

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
    assert (
        api.completions.create(model=NAME, prompt="the cat", max_tokens=6, temperature=0).choices[0].text
        == expected.text
    )
    unauthorized = 'tformer_requests_total{endpoint="/v1/models",status="401"}'
    assert metric(cli.url, unauthorized, AUTH) == 3  # two by hand, one by the client


def test_disconnected_clients_free_their_kv_blocks(cli) -> None:
    aborted = metric(cli.url, "tformer_requests_aborted_total", AUTH)
    body = {"model": NAME, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}

    async def open_streams_then_leave(n: int) -> float:
        async with httpx.AsyncClient(base_url=cli.url, headers=AUTH, timeout=60) as http:
            streams = [http.stream("POST", CMPL, json={**body, "prompt": f"the cat {i}"}) for i in range(n)]
            readers = []  # kept alive: a line iterator closes its connection when it is garbage-collected
            for stream in streams:
                readers.append((await stream.__aenter__()).aiter_lines())
                while not (await anext(readers[-1])).startswith("data: {"):
                    pass  # until generation has started: the request holds KV blocks
            in_use = metric(cli.url, "tformer_kv_blocks_in_use", AUTH)
            for stream in streams:
                await stream.__aexit__(None, None, None)  # unread: httpx closes the connection
        return in_use

    assert asyncio.run(open_streams_then_leave(6)) >= 6
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(
            f"{cli.url}{CMPL}",
            headers=AUTH,
            json={**body, "stream": False, "prompt": "a dog"},
            timeout=httpx.Timeout(30, read=0.5),
        )
    deadline = time.monotonic() + 30
    while metric(cli.url, "tformer_kv_blocks_in_use", AUTH) > 0:
        assert time.monotonic() < deadline, "KV blocks were not freed after the clients left"
        time.sleep(0.1)
    assert metric(cli.url, "tformer_requests_aborted_total", AUTH) == aborted + 7
    assert metric(cli.url, "tformer_requests_running", AUTH) == 0


def test_sigterm_lets_streams_finish_then_exits(cli) -> None:
    """Runs last: the server stops accepting, finishes the stream in flight, stops the engine and exits."""
    expected = Offline(cli.path, QUANTIZE).complete("a dog", max_tokens=80, temperature=0.0, ignore_eos=True)
    body = {"model": NAME, "prompt": "a dog", "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cli.url}{CMPL}", headers=AUTH, json=body, timeout=60) as response:
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        cli.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        # No new connections once shutdown began: refused, or reset when a probe reached the listen backlog just
        # as the socket closed.
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
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


def test_the_server_runs_on_uvloop_and_httptools() -> None:
    """`tformer serve` leaves uvicorn's loop and parser on "auto": with tformer's dependencies installed, that is
    uvloop and httptools, not asyncio's loop and the pure-Python h11."""
    import uvloop
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from tformer.serve.server import uvicorn_config

    config = uvicorn_config(lambda scope, receive, send: None, "127.0.0.1", 0, 1.0)
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
    assert config.get_loop_factory() is uvloop.new_event_loop
