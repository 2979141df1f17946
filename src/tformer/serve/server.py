"""`run_server`: load a model, build the app and serve it with uvicorn until SIGINT or SIGTERM.

Without a model but with a runs directory it serves the playground's training dashboard alone.

On either signal uvicorn stops accepting connections, lets in-flight requests finish for up to
`shutdown_timeout` seconds and cancels the rest (their KV blocks are freed), then the app's lifespan stops the
engine thread.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from tformer.engine import Engine, EngineConfig
from tformer.engine.async_engine import AsyncEngine
from tformer.engine.embedding import EmbeddingEngine
from tformer.engine.loading import load_engine, warm_up
from tformer.errors import ConfigError
from tformer.serve.app import create_app
from tformer.serve.playground import create_dashboard_app

API_KEY_ENV = "TFORMER_API_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
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
) -> None:
    """Serves `model`, and the playground's dashboard of the runs under `runs_dir`, until interrupted; see
    `load_engine` for the other arguments."""
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    if runs_dir is not None and not Path(runs_dir).is_dir():
        raise ConfigError(f"--runs {runs_dir}: no such directory; pass the directory the training runs are in")
    if model is None:
        if runs_dir is None:
            raise ConfigError("nothing to serve: pass --model PATH (a model), --runs DIR (training runs), or both")
        _serve(create_dashboard_app(runs_dir, api_key), host, port, api_key, shutdown_timeout)
        return

    def build() -> Engine | EmbeddingEngine:
        loaded = load_engine(model, engine_config, quantize, dtype, draft_model, draft_quantize, embeddings_only=True)
        if loaded.generates and loaded.config.compile:
            logger.info("compiling the decode steps before serving (cached for the next start)")
            warm_up(loaded)  # /health answers only once the server listens: 200 means a compiled engine is ready
        return loaded

    engine = AsyncEngine.launch(build)  # built on the thread that runs it: see AsyncEngine.launch
    app = create_app(engine, engine.engine.tokenizer, model_name or default_model_name(model), api_key, runs_dir)
    try:
        _serve(app, host, port, api_key, shutdown_timeout)
    finally:
        engine.shutdown()


def _serve(app: ASGIApp, host: str, port: int, api_key: str | None, shutdown_timeout: float) -> None:
    if host not in LOOPBACK and not api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    try:
        uvicorn.Server(uvicorn_config(app, host, port, shutdown_timeout)).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass


def uvicorn_config(app: ASGIApp, host: str, port: int, shutdown_timeout: float) -> uvicorn.Config:
    """uvicorn's settings for `tformer serve`. Its event loop and HTTP parser stay "auto", which picks uvloop and
    httptools (both dependencies of tformer): less of the event loop's time per streamed token than asyncio and h11
    (docs/design-notes.md, "serve/server.py")."""
    return uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout, log_level="info")
