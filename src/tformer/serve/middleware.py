"""Plain ASGI middlewares: the guards (API key, Host header, body size) and the request counter.

Plain ASGI (rather than Starlette's BaseHTTPMiddleware) leaves `receive` untouched, so a handler still sees
the client's disconnect, and the guards answer before the body is even read.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tformer.serve.errors import error_response
from tformer.serve.metrics import Metrics

ENDPOINTS = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/translations",
    "/v1/playground",
    "/v1/runs",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/health",
    "/metrics",
    "/",
)
OPEN_PATHS = ("/health", "/")  # with an API key, every other route needs it, but these and the page's files
OPEN_PREFIXES = ("/static/",)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class ServerLimits:
    """What one client may ask of the server (`tformer serve`'s limit options; docs/serving.md, "Limits and
    security"). `allowed_hosts` None accepts any Host header; a loopback bind allows the loopback names only, so
    that a web page elsewhere cannot reach the server through DNS rebinding."""

    max_body_bytes: int = 8 << 20
    max_waiting: int | None = 512
    request_timeout: float | None = 600.0
    max_embedding_tokens: int = 65536
    allowed_hosts: frozenset[str] | None = None


def add_guards(app: FastAPI, api_key: str | None, limits: ServerLimits) -> None:
    """The guards every app of `tformer serve` wears, outermost first: Host header, API key, body size."""
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if limits.allowed_hosts is not None:
        app.add_middleware(HostCheck, hosts=limits.allowed_hosts)


class ApiKeyMiddleware:
    """Answers 401 to a request without `Authorization: Bearer <api_key>`, on every route but /health, the page at
    / and its /static files (an allow-list: a route added later is covered without a thought)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _open(scope["path"]) and not self._authorized(scope):
            given = any(name == b"authorization" for name, _ in scope["headers"])
            message = "the API key is wrong" if given else "an API key is required"
            response = error_response(
                401, f"{message}: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False


def _open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class HostCheck:
    """Answers 400 to a request whose Host header names no host of `hosts` (the port aside)."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _host(scope) not in self.hosts:
            response = error_response(
                400, f"the Host header must name this server ({', '.join(sorted(self.hosts))})", code="invalid_host"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _host(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1").strip().lower()
            if host.startswith("["):  # [::1]:8000
                return host[1 : host.find("]")] if "]" in host else None
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return None


class BodyLimit:
    """Answers 413 to a body over `max_bytes`: by its Content-Length before a byte is read, or, for a chunked body,
    as soon as the bytes received pass the limit (the handler then sees the client leave)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> ASGIApp:
        mib = self.max_bytes / (1 << 20)
        return error_response(413, f"the request body is over the server's limit of {mib:g} MiB", code="too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large()(scope, receive, send)
            return
        received, refused = 0, False

        async def counted() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._too_large()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, unless_refused)


class RequestCounter:
    """Counts every HTTP request by endpoint and response status (unknown paths count as "other")."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.inc(1, endpoint, str(status))
