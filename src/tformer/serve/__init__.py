"""An OpenAI-compatible HTTP server on top of `Engine` (`tformer serve`).

- `async_engine`: `AsyncEngine`, one background thread that owns the engine, fed through a queue.
- `protocol`: the request bodies (pydantic) and the OpenAI response and stream-chunk shapes.
- `app`: the FastAPI routes (/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics).
- `errors`, `middleware`, `metrics`: OpenAI-shaped errors, the API-key check, Prometheus metrics.
- `loading`: `load_engine`, the model behind an `Engine` (also used by `tformer generate`).
- `playground`, `runs`, `static/`: the web page at `/` and its routes (/v1/translations, /v1/runs, /v1/playground).
- `server`: `run_server`, which loads a model and runs uvicorn.

The names below load on first use, so `tformer.serve.loading` comes without FastAPI and uvicorn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tformer.serve.app import create_app
    from tformer.serve.async_engine import AsyncEngine, EngineStats, EngineStopped
    from tformer.serve.server import run_server

LAZY_NAMES: dict[str, str] = {
    "AsyncEngine": "tformer.serve.async_engine",
    "EngineStats": "tformer.serve.async_engine",
    "EngineStopped": "tformer.serve.async_engine",
    "create_app": "tformer.serve.app",
    "run_server": "tformer.serve.server",
}


def __getattr__(name: str) -> Any:
    if name not in LAZY_NAMES:
        raise AttributeError(f"module 'tformer.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(LAZY_NAMES[name]), name)


__all__ = ["AsyncEngine", "EngineStats", "EngineStopped", "create_app", "run_server"]
