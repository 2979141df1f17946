"""The serving tests' helpers: a tiny checkpoint, a live server in a thread, the offline Engine as the reference,
and the client-side checks of /metrics and OpenAI's error shape."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import torch
import uvicorn

from tformer import ModelConfig, build_model
from tformer.checkpoints import load_pretrained
from tformer.data.tokenizer import Tokenizer
from tformer.engine import Completion, Engine, EngineConfig, SamplingParams
from tformer.engine.async_engine import AsyncEngine
from tformer.kernels.quantize import set_precision
from tformer.serve import create_app
from tformer.serve.middleware import ServerLimits
from tformer.serve.server import FLUSH_SECONDS, GracefulServer

# ---- serving: a tiny checkpoint, a live server, and the offline reference ---------------------------------------

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today", "birds sing at dawn"] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NAME = "tiny"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


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

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        name: str = NAME,
        draft: torch.nn.Module | None = None,
        engine: Any = None,
        limits: ServerLimits | None = None,
        api_key: str | None = None,
        shutdown_timeout: float = 5.0,
    ) -> None:
        """`engine` (an `EmbeddingEngine`, say) replaces the `Engine` built from the model; `limits`, `api_key` and
        `shutdown_timeout` are `tformer serve`'s."""
        self.tokenizer = tokenizer
        limits = limits or ServerLimits()
        built = engine or Engine(model, tokenizer, config, draft=draft)
        self.engine = AsyncEngine(built, max_waiting=limits.max_waiting, request_timeout=limits.request_timeout)
        self.app = create_app(self.engine, tokenizer, name, api_key, limits=limits)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        graceful = shutdown_timeout + FLUSH_SECONDS
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=graceful)
        self.server = GracefulServer(config, self.engine, shutdown_timeout)
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


def client(server: LiveServer, cls: type = openai.OpenAI) -> Any:
    return cls(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers).text
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
