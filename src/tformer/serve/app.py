"""The FastAPI application: OpenAI's /v1 routes, /health and /metrics, on top of one `AsyncEngine`; the web
playground's page and routes come from `tformer.serve.playground`.

A handler validates the body, renders and tokenizes the prompt, hands the request to the engine thread and
either streams server-sent events or waits for the whole text. A client that goes away cancels its request:
the stream's generator is closed (streaming) or a watcher sees `http.disconnect` (non-streaming), and either
way the engine aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tformer.data import DataError
from tformer.data.tokenizer import Tokenizer
from tformer.engine import ContextLengthError, RequestOutput, SamplingParams
from tformer.engine.async_engine import AsyncEngine, EngineBusy, EngineStopped, RequestFailed
from tformer.serve.embeddings import add_embedding_routes
from tformer.serve.errors import APIError, error_body, install_error_handlers
from tformer.serve.formats import ChatFormat, CompletionFormat, Echo, Sample, new_id, usage
from tformer.serve.metrics import Metrics
from tformer.serve.middleware import RequestCounter, ServerLimits, add_guards
from tformer.serve.playground import add_playground
from tformer.serve.protocol import UNION_FORMS, ChatMessage, ChatRequest, CompletionRequest
from tformer.serve.tokenize import add_tokenizer_routes

SSE_DONE = "data: [DONE]\n\n"
RETRY_AFTER = "1"  # seconds a client turned away by --max-waiting should wait before it tries again


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Server:
    """What the routes share: the engine, the tokenizer, the served model's name and the metrics."""

    def __init__(
        self, engine: AsyncEngine, tokenizer: Tokenizer | None, model_name: str, limits: ServerLimits | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or ServerLimits()
        self.metrics = Metrics()
        self.created = int(time.time())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tformer",
            "max_model_len": self.engine.max_model_len,
        }

    def encode(self, text: str, param: str, add_bos: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids", param=param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON's "\ud800" escapes decode to lone surrogates
            raise APIError(400, f"{param} is not valid Unicode ({err.reason} at {err.start})", param=param) from None
        return self.tokenizer.encode(text, add_bos=add_bos)

    def check_ids(self, ids: list[int], param: str) -> None:
        """A 400 naming `param` when a token id is outside the model's vocabulary (checked before any is decoded)."""
        vocab = self.engine.engine.model.config.vocab_size
        if ids and not 0 <= min(ids) <= max(ids) < vocab:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}", param=param)

    def checked(self, params: SamplingParams) -> SamplingParams:
        """The parameters, once every token id they name is in the vocabulary (a 400 naming the parameter before the
        request is queued; the engine checks again)."""
        self.check_ids(params.stop_token_ids, "stop_token_ids")
        self.check_ids(list(params.logit_bias), "logit_bias")
        return params

    def token_text(self, token: int | list[int], whole: bool = False) -> str:
        """One token's text, for log-probabilities (a byte-level piece of a character decodes to U+FFFD, as in
        vLLM; a special token reads as itself), or with `whole` a list of tokens' text; `token_id:<id>` without a
        tokenizer."""
        tokens = token if isinstance(token, list) else [token]
        if self.tokenizer is None:
            return "".join(f"token_id:{t}" for t in tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(
                400,
                f"the model {self.model_name!r} has no chat template, so /v1/chat/completions cannot "
                "render messages; use /v1/completions with a plain prompt, or serve a tokenizer whose "
                "tokenizer_config.json (or GGUF metadata) carries a chat template",
                param="messages",
            )
        try:
            variables = {} if tools is None else {"tools": tools}
            text = self.tokenizer.apply_chat_template(
                [m.as_dict() for m in messages], add_generation_prompt, **variables
            )
        except DataError as err:  # e.g. the template's raise_exception("roles must alternate")
            raise APIError(400, str(err), param="messages") from None
        except Exception as err:  # noqa: BLE001 -- the template is the model's code, not ours
            raise APIError(
                400, f"the chat template failed on these messages ({type(err).__name__}: {err})", param="messages"
            ) from None
        return self.encode(text, "messages")

    def check_generates(self) -> None:
        """A 400 for a generation request to a model that only embeds (an encoder)."""
        if not self.engine.engine.generates:
            raise APIError(
                400,
                f"the model {self.model_name!r} is an encoder: it embeds text and generates none; use /v1/embeddings",
                param="model",
            )

    def check_fits(self, prompt_len: int, max_tokens: int, prompt_param: str, tokens_param: str) -> None:
        """Names the parameter at fault when a request overflows the context (the engine's rule, applied before the
        request is queued)."""
        try:
            self.engine.context.check(prompt_len, max_tokens, tokens_param)
        except ContextLengthError as err:
            param = prompt_param if err.param == "prompt" else tokens_param
            raise APIError(400, str(err), param=param, code="context_length_exceeded") from None

    async def run(
        self,
        request: Request,
        prompts: list[list[int]],
        params: SamplingParams,
        fmt: CompletionFormat,
        stream: bool,
        include_usage: bool = False,
        continuous_usage: bool = False,
    ) -> Response:
        """Hands the prompts to the engine, a request each, and answers with an SSE stream or the whole
        completion: prompt i's samples are choices i * n .. i * n + n - 1."""
        started = time.perf_counter()
        one = len(prompts) == 1
        request_ids = [fmt.request_id] if one else [f"{fmt.request_id}-{i}" for i in range(len(prompts))]
        added: list[str] = []

        def release() -> None:
            for request_id in added:
                self.engine.release(request_id)

        try:
            for request_id, ids in zip(request_ids, prompts, strict=True):
                await self.engine.add(request_id, ids, params)
                added.append(request_id)
        except EngineStopped as err:
            release()
            raise APIError(503, str(err)) from None
        except EngineBusy as err:
            release()
            raise APIError(503, str(err), code="server_busy", headers={"Retry-After": RETRY_AFTER}) from None
        except RequestFailed as err:  # the engine could not add it (its fault, not the request's)
            release()
            raise APIError(_status(err), str(err)) from None
        except BaseException:
            release()
            raise
        prompt_tokens, choices = sum(len(ids) for ids in prompts), len(prompts) * params.n
        self.metrics.prompt_tokens.inc(prompt_tokens)
        outputs = self._tracked(self.engine.stream_all(added, params.n), fmt.endpoint, started, choices)
        if fmt.echo is not None and fmt.echo.prompt_only:
            outputs = _prompt_only(outputs)
        if stream:
            return _EventStream(
                self._sse(outputs, fmt, prompt_tokens, include_usage, choices, continuous_usage), release
            )
        try:
            return await self._complete(request, outputs, fmt, prompt_tokens, choices)
        finally:
            release()

    async def _tracked(
        self, outputs: AsyncIterator[RequestOutput], endpoint: str, started: float, n: int
    ) -> AsyncIterator[RequestOutput]:
        """Passes outputs through; times the first and the end of the last of `n` samples, counts the tokens."""
        first, unfinished = True, n
        async with aclosing(outputs):
            async for out in outputs:
                now = time.perf_counter()
                if first:
                    self.metrics.ttft.observe(now - started, endpoint)
                    first = False
                self.metrics.generation_tokens.inc(len(out.token_ids))
                unfinished -= out.finished
                if not unfinished:
                    self.metrics.latency.observe(now - started, endpoint)
                yield out

    async def _sse(
        self,
        outputs: AsyncIterator[RequestOutput],
        fmt: CompletionFormat,
        prompt_tokens: int,
        include_usage: bool,
        n: int,
        continuous_usage: bool = False,
    ) -> AsyncIterator[str]:
        """Server-sent events: OpenAI chunks as text arrives, a last chunk per sample with its finish reason
        (samples interleave, told apart by their choice index), then [DONE]. With `continuous_usage` every chunk
        carries the usage so far (vLLM's `continuous_usage_stats`): the playground's live token counts."""
        generated = 0

        def event(chunk: dict[str, Any]) -> str:
            return _event({**chunk, "usage": usage(prompt_tokens, generated)} if continuous_usage else chunk)

        async with aclosing(outputs):
            for chunk in fmt.first_chunks(n):
                yield event(chunk)
            try:
                async for out in outputs:
                    generated += len(out.token_ids)
                    # a token held back (a stop string may follow) keeps its logprob; an echo goes out at once
                    if out.text or out.logprobs or fmt.echoes(out.index):
                        chunk = fmt.chunk(
                            out.text, index=out.index, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs
                        )
                        if chunk is not None:  # None: held back (tool calls under "required" go out whole)
                            yield event(chunk)
                    if out.finished:
                        yield event(fmt.last_chunk(out.finish_reason, out.index))
            except (EngineStopped, RequestFailed) as err:  # the request ended early: say why, then end the stream
                yield _event(error_body(_status(err), str(err)))
                yield SSE_DONE
                return
            if include_usage:
                yield _event(fmt.usage_chunk(usage(prompt_tokens, generated)))
            yield SSE_DONE

    async def _complete(
        self, request: Request, outputs: AsyncIterator[RequestOutput], fmt: CompletionFormat, prompt_tokens: int, n: int
    ) -> Response:
        """The whole completion; if the client disconnects first, the request is cancelled instead."""
        collect = asyncio.ensure_future(_collect(outputs, n))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()  # the client left (or this handler was cancelled): abort the request
                await asyncio.wait({collect})  # and let the abort happen now
        if collect.cancelled() or not collect.done():
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        try:
            samples, generated = collect.result()
        except (EngineStopped, RequestFailed) as err:
            raise APIError(_status(err), str(err)) from None
        return JSONResponse(fmt.response(samples, usage(prompt_tokens, generated)))


def _status(err: EngineStopped | RequestFailed) -> int:
    """The HTTP status of a request that ended early: 400 when its own parameters failed it, 503 when the engine
    stopped, 500 when the engine failed it."""
    if isinstance(err, EngineStopped):
        return 503
    return 400 if err.client_error else 500


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed, and request released, however the response ends."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]
            self.on_close()


async def _collect(outputs: AsyncIterator[RequestOutput], n: int) -> tuple[list[Sample], int]:
    """Each of a request's `n` samples whole, and the number of tokens of all of them."""
    samples = [Sample("", None) for _ in range(n)]
    generated = 0
    async with aclosing(outputs):
        async for out in outputs:
            sample = samples[out.index]
            sample.text += out.text
            sample.finish_reason = out.finish_reason
            if out.logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + out.logprobs
            if out.prompt_logprobs is not None:
                sample.prompt_logprobs = out.prompt_logprobs
            generated += len(out.token_ids)
    return samples, generated


async def _prompt_only(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """max_tokens 0 with echo: the outputs without the one token the engine generated (nor its log-probability),
    finished for length."""
    async with aclosing(outputs):
        async for out in outputs:
            reason = "length" if out.finished else None
            logprobs = None if out.logprobs is None else []
            yield replace(out, token_ids=[], text="", logprobs=logprobs, finish_reason=reason)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so `receive` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_info_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health() -> Response:
        if server.engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(503, "the engine is not running"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = server.metrics.render(server.engine.stats, server.engine.num_cancelled)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [server.model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        server.check_model(model_id)
        return JSONResponse(server.model_card())


def _add_generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        server.check_generates()
        body.check_supported()
        given = body.prompts()
        for p in given:
            if not isinstance(p, str):
                server.check_ids(p, "prompt")  # before an echo decodes them
        prompts = await asyncio.to_thread(
            lambda: [server.encode(p, "prompt") if isinstance(p, str) else p for p in given]
        )
        max_tokens = body.tokens_to_generate()
        for ids in prompts:
            server.check_fits(len(ids), max(max_tokens, 1), "prompt", "max_tokens")
        echo = None
        if body.echo:
            texts = [p if isinstance(p, str) else server.token_text(p, whole=True) for p in given]
            echo = Echo(texts, prompts, body.n, prompt_only=max_tokens == 0)
        fmt = CompletionFormat(new_id(CompletionFormat.id_prefix), server.model_name, server.token_text, echo)
        params = server.checked(body.sampling_params(max(max_tokens, 1)))  # the engine generates at least one token
        return await server.run(request, prompts, params, fmt, body.stream, body.include_usage, body.continuous_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        server.check_model(body.model)
        server.check_generates()
        body.check_supported()
        tools = body.tool_calls()
        ids = await asyncio.to_thread(server.chat_prompt, body.messages, True, body.template_tools())
        tokens_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = (
            body.max_completion_tokens or body.max_tokens or max(server.engine.context.max_new_tokens(len(ids)), 1)
        )
        server.check_fits(len(ids), max_tokens, "messages", tokens_param)
        fmt = ChatFormat(new_id(ChatFormat.id_prefix), server.model_name, server.token_text, tools=tools)
        params = server.checked(body.sampling_params(max_tokens, tools))
        return await server.run(request, [ids], params, fmt, body.stream, body.include_usage, body.continuous_usage)


def create_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer | None,
    model_name: str,
    api_key: str | None = None,
    runs_dir: str | os.PathLike[str] | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The ASGI app; its lifespan starts the engine thread and stops it when the server shuts down. The web
    playground is at `/`; its dashboard lists the training runs under `runs_dir`, if given. `limits` bound what a
    client may ask (the engine's own, `max_waiting` and `request_timeout`, are the AsyncEngine's)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    server = Server(engine, tokenizer, model_name, limits)
    app = FastAPI(title="tformer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    install_error_handlers(app, UNION_FORMS)
    _add_info_routes(app, server)
    _add_generation_routes(app, server)
    add_tokenizer_routes(app, server)
    add_embedding_routes(app, server)
    add_playground(app, server, runs_dir)
    add_guards(app, api_key, server.limits)
    app.add_middleware(RequestCounter, metrics=server.metrics)  # added last: the outermost, so it counts 401s
    return app
