"""`run_server`: load a model, build the app and serve it with uvicorn until SIGINT or SIGTERM.

Without a model but with a runs directory it serves the playground's training dashboard alone.

On either signal uvicorn stops accepting connections and lets in-flight requests finish for up to
`shutdown_timeout` seconds; then the engine stops, and every request still running ends with an error (a
stream's last events are an error chunk and [DONE]) and frees its KV blocks; the app's lifespan then joins the
engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import replace
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from tformer.engine import Engine, EngineConfig
from tformer.engine.async_engine import AsyncEngine
from tformer.engine.embedding import EmbeddingEngine
from tformer.engine.loading import load_engine, warm_up
from tformer.errors import ConfigError
from tformer.serve.app import create_app
from tformer.serve.middleware import LOOPBACK_HOSTS, ServerLimits
from tformer.serve.playground import create_dashboard_app

API_KEY_ENV = "TFORMER_API_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
FLUSH_SECONDS = 5.0  # after the engine stops at shutdown: time for the streams' last events to go out
logger = logging.getLogger(__name__)


def default_model_name(path: str | os.PathLike[str]) -> str:
    """The id clients pass as `model`: the file name without .gguf, or the directory's name."""
    path = Path(path).resolve()
    return path.stem if path.suffix == ".gguf" else path.name


def run_server(
    model: str | os.PathLike[str] | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    engine_config: EngineConfig | None = None,
    shutdown_timeout: float = 10.0,
    quantize: str | None = None,
    dtype: str = "auto",
    draft_model: str | os.PathLike[str] | None = None,
    draft_quantize: str | None = None,
    runs_dir: str | os.PathLike[str] | None = None,
    limits: ServerLimits | None = None,
    device: str = "cpu",
) -> None:
    """Serves `model`, and the playground's dashboard of the runs under `runs_dir`, until interrupted; see
    `load_engine` for the other arguments. `limits` bound what clients may ask; on a loopback bind the Host
    header must name loopback too."""
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    limits = limits or ServerLimits()
    if host in LOOPBACK and limits.allowed_hosts is None:
        limits = replace(limits, allowed_hosts=LOOPBACK_HOSTS)
    if runs_dir is not None and not Path(runs_dir).is_dir():
        raise ConfigError(f"--runs {runs_dir}: no such directory; pass the directory the training runs are in")
    if model is None:
        if runs_dir is None:
            raise ConfigError("nothing to serve: pass --model PATH (a model), --runs DIR (training runs), or both")
        _serve(create_dashboard_app(runs_dir, api_key, limits), host, port, api_key, shutdown_timeout)
        return

    def build() -> Engine | EmbeddingEngine:
        loaded = load_engine(
            model, engine_config, quantize, dtype, draft_model, draft_quantize, embeddings_only=True, device=device
        )
        if loaded.generates and loaded.config.compile:
            logger.info("compiling the decode steps before serving (cached for the next start)")
            warm_up(loaded)  # /health answers only once the server listens: 200 means a compiled engine is ready
        return loaded

    # built on the thread that runs it: see AsyncEngine.launch
    engine = AsyncEngine.launch(build, max_waiting=limits.max_waiting, request_timeout=limits.request_timeout)
    name = model_name or default_model_name(model)
    app = create_app(engine, engine.engine.tokenizer, name, api_key, runs_dir, limits)
    try:
        _serve(app, host, port, api_key, shutdown_timeout, engine)
    finally:
        engine.shutdown()


def _serve(
    app: ASGIApp,
    host: str,
    port: int,
    api_key: str | None,
    shutdown_timeout: float,
    engine: AsyncEngine | None = None,
) -> None:
    if host not in LOOPBACK and not api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    try:
        GracefulServer(uvicorn_config(app, host, port, shutdown_timeout), engine, shutdown_timeout).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose graceful shutdown stops the engine `drain` seconds in: every request still running then
    ends with an error, so a stream's client reads an error chunk and [DONE] instead of a cut connection."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine | None, drain: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain = drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        stop = None if self.engine is None else asyncio.get_running_loop().call_later(self.drain, self.engine.stop)
        try:
            await super().shutdown(sockets)
        finally:
            if stop is not None:
                stop.cancel()


def uvicorn_config(app: ASGIApp, host: str, port: int, shutdown_timeout: float) -> uvicorn.Config:
    """uvicorn's settings for `tformer serve`. Its event loop and HTTP parser stay "auto", which picks uvloop and
    httptools (both dependencies of tformer): less of the event loop's time per streamed token than asyncio and h11
    (docs/design-notes.md, "serve/server.py")."""
    # uvicorn cancels what still runs FLUSH_SECONDS after the engine stopped (GracefulServer)
    graceful = shutdown_timeout + FLUSH_SECONDS
    return uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=graceful, log_level="info")
