"""An OpenAI-compatible HTTP server on top of `Engine` (`tformer serve`).

- `async_engine`: `AsyncEngine`, one background thread that owns the engine, fed through a queue.
- `protocol`: the request bodies (pydantic) and the OpenAI response and stream-chunk shapes.
- `app`: the FastAPI routes (/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics).
- `errors`, `middleware`, `metrics`: OpenAI-shaped errors, the API-key check, Prometheus metrics.
- `server`: `run_server`, which loads a model and runs uvicorn.
"""

from tformer.serve.app import create_app
from tformer.serve.async_engine import AsyncEngine, EngineStats, EngineStopped
from tformer.serve.server import run_server

__all__ = ["AsyncEngine", "EngineStats", "EngineStopped", "create_app", "run_server"]
