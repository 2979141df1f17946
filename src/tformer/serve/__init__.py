"""An OpenAI-compatible HTTP server on top of the engine (`tformer serve`); HTTP only, the engine lives in
`tformer.engine` (`AsyncEngine`, `load_engine`).

- `protocol`: the request bodies (pydantic) and the OpenAI response and stream-chunk shapes.
- `app`: the FastAPI routes (/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics).
- `errors`, `middleware`, `metrics`: OpenAI-shaped errors, the API-key check, Prometheus metrics.
- `playground`, `runs`, `static/`: the web page at `/` and its routes (/v1/translations, /v1/runs, /v1/playground).
- `server`: `run_server`, which loads a model and runs uvicorn.

The names below load on first use, so importing the package costs neither FastAPI nor uvicorn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tformer.serve.app import create_app
    from tformer.serve.server import run_server

LAZY_NAMES: dict[str, str] = {"create_app": "tformer.serve.app", "run_server": "tformer.serve.server"}


def __getattr__(name: str) -> Any:
    if name not in LAZY_NAMES:
        raise AttributeError(f"module 'tformer.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(LAZY_NAMES[name]), name)


__all__ = ["create_app", "run_server"]
