"""The web playground at `/` and the routes only it needs, beside OpenAI's under /v1.

- `/` and `/static/...`: the page, plain HTML, CSS and JavaScript modules from `serve/static/` (no build step,
  nothing fetched from elsewhere; a Content-Security-Policy keeps it to this origin).
- `GET /v1/playground`: what the page shows: the model, its family and context, and whether runs are served.
- `POST /v1/translations`: an encoder-decoder model's translation of one sentence with its cross-attention map.
- `GET /v1/runs` and `GET /v1/runs/{id}?offset=N`: the training runs under `--runs DIR` and their metrics.jsonl
  records after a byte offset, which the page polls to draw a running training live.

The /v1 routes take the API key, validate their input and answer errors in OpenAI's shape, as the others do.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from tformer.decoding.attention_map import EXTRA_LEN, attention_of
from tformer.engine.async_engine import EngineBusy, EngineStopped, RequestFailed
from tformer.engine.sampling import SamplingParams
from tformer.errors import TformerError
from tformer.serve.errors import APIError, install_error_handlers
from tformer.serve.formats import new_id, usage
from tformer.serve.middleware import ServerLimits, add_guards
from tformer.serve.protocol import UNION_FORMS, TranslationRequest
from tformer.serve.runs import LIVE_SECONDS, RunsDir

if TYPE_CHECKING:
    from tformer.serve.app import Server

STATIC_DIR = Path(__file__).parent / "static"
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    # this origin only: no CDN, no inline script or style (the heat map colours its cells through the CSSOM)
    # frame-ancestors 'none': no other site may frame the page (clickjacking)
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
}
TRANSLATIONS = "/v1/translations"


def add_playground(app: FastAPI, server: Server | None, runs_dir: str | os.PathLike[str] | None) -> None:
    """Adds the page, its static files and its /v1 routes; `server` is None for a dashboard without a model."""
    runs = RunsDir(runs_dir) if runs_dir is not None else None

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/v1/playground")
    async def playground() -> Response:
        return JSONResponse(describe(server, runs))

    @app.post(TRANSLATIONS)
    async def translations(body: TranslationRequest) -> Response:
        if server is None:
            raise APIError(400, "this server has no model (it was started with --runs only)", code="no_model")
        return JSONResponse(await translate(server, body))

    _add_runs_routes(app, runs)


def describe(server: Server | None, runs: RunsDir | None) -> dict[str, Any]:
    """The page's first question: which views to offer and the limits to show."""
    info: dict[str, Any] = {"object": "playground", "model": None, "family": None, "runs": runs is not None}
    if server is None:
        return info
    model = server.engine.engine.model
    tokenizer = server.tokenizer
    info.update(
        model=server.model_name,
        family=model.config.family,
        max_model_len=server.engine.max_model_len,
        chat_template=bool(tokenizer is not None and tokenizer.chat_template),
        text=tokenizer is not None,
    )
    return info


async def translate(server: Server, body: TranslationRequest) -> dict[str, Any]:
    """The answer to POST /v1/translations: the translation is an engine request, so that concurrent ones are
    searched together (an encoder-decoder's beam requests go to the offline beam search in batches, engine/beams.py;
    beam 1 is the engine's greedy decoding); the attention map is replayed on the engine thread, when asked."""
    server.check_model(body.model)
    model, tokenizer = server.engine.engine.model, server.tokenizer
    if not model.config.is_seq2seq:  # the LSTM encoder-decoder has no engine runner: this is the Transformer
        raise APIError(
            400,
            f"the model {server.model_name!r} is a {model.config.family} model; {TRANSLATIONS} needs an "
            "encoder-decoder (translation) checkpoint: use /v1/chat/completions or /v1/completions instead",
            param="model",
            code="unsupported_model",
        )
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot read text to translate", param="input")
    if not body.input.strip():
        raise APIError(400, "input is empty; give the sentence to translate", param="input")
    source_ids = [*server.encode(body.input, "input"), tokenizer.eos_id]  # the source as `tformer translate` reads it
    source_len, context = len(source_ids), server.engine.max_model_len
    if source_len > context:
        raise APIError(
            400,
            f"the input has {source_len} tokens with </s> but the model reads at most {context}; "
            "shorten it (or split it into sentences)",
            param="input",
            code="context_length_exceeded",
        )
    # as `tformer translate` allows (translate_ids), within the engine's context (the model's max_seq_len unless
    # --max-model-len lowers it)
    limit = min(source_len + EXTRA_LEN, server.engine.context.max_new_tokens(source_len))
    params = SamplingParams(max_tokens=limit, temperature=0.0)  # beam 1: greedy
    if body.beam_size > 1:
        params = SamplingParams(max_tokens=limit, beam_width=body.beam_size, length_penalty=body.alpha)
    started = time.perf_counter()
    output_ids: list[int] = []
    try:
        async for output in server.engine.generate(source_ids, params):
            output_ids += output.token_ids
        weights = None
        if body.attention:
            weights = await server.engine.call(lambda: attention_of(model, tokenizer, source_ids, output_ids))
    except EngineBusy as err:
        raise APIError(503, str(err), code="server_busy") from None
    except (EngineStopped, RequestFailed) as err:
        raise APIError(400 if getattr(err, "client_error", False) else 503, str(err)) from None
    except TformerError as err:  # what the search refuses despite the checks above
        raise APIError(400, str(err), param="input") from None
    server.metrics.prompt_tokens.inc(source_len)
    server.metrics.generation_tokens.inc(len(output_ids))
    server.metrics.latency.observe(time.perf_counter() - started, TRANSLATIONS)
    labels = [tokenizer.decode([i], skip_special_tokens=False) for i in (*source_ids, *output_ids)]
    return {
        "id": new_id("trans"),
        "object": "translation",
        "created": int(time.time()),
        "model": server.model_name,
        "translation": tokenizer.decode(output_ids),
        "source_tokens": labels[:source_len],
        "output_tokens": labels[source_len:],
        "attention": None if weights is None else weights.weights.tolist(),  # [layer][head][output][source]
        "usage": usage(source_len, len(output_ids)),
    }


def _add_runs_routes(app: FastAPI, runs: RunsDir | None) -> None:
    def need_runs() -> RunsDir:
        if runs is None:
            raise APIError(
                404, "this server lists no training runs; start it with --runs DIR (the runs' parent directory)"
            )
        return runs

    @app.get("/v1/runs")
    async def list_runs() -> Response:
        found = await asyncio.to_thread(need_runs().list)
        return JSONResponse({"object": "list", "root": str(need_runs().root), "data": found})

    @app.get("/v1/runs/{run_id:path}")
    async def run_metrics(run_id: str, offset: str = "0") -> Response:
        if not (offset.isascii() and offset.isdigit() and len(offset) <= 20):  # '²'.isdigit() is True, int() fails
            raise APIError(400, f"offset must be a byte offset (an integer >= 0), got {offset!r}", param="offset")
        read = await asyncio.to_thread(need_runs().read, run_id, int(offset))
        if read is None:
            raise APIError(404, f"no run {run_id!r} under {need_runs().root}; GET /v1/runs lists them", param="id")
        return JSONResponse(
            {
                "object": "run.metrics",
                "id": run_id,
                "records": read.records,
                "offset": read.offset,
                "size": read.size,
                "updated": read.updated,
                "running": time.time() - read.updated < LIVE_SECONDS,
                "reset": read.reset,
                "skipped": read.skipped,
            }
        )


def create_dashboard_app(
    runs_dir: str | os.PathLike[str], api_key: str | None = None, limits: ServerLimits | None = None
) -> FastAPI:
    """The playground with only its dashboard, for `tformer serve --runs DIR` without a model: nothing to load."""

    app = FastAPI(title="tformer", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, UNION_FORMS)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    add_playground(app, None, runs_dir)
    add_guards(app, api_key, limits or ServerLimits())
    return app
