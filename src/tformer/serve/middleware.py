"""Two plain ASGI middlewares: the API-key check and the request counter.

Plain ASGI (rather than Starlette's BaseHTTPMiddleware) leaves `receive` untouched, so a handler still sees
the client's disconnect, and the key is checked before the body is even read.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tformer.serve.errors import error_response
from tformer.serve.metrics import Metrics

ENDPOINTS = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/translations",
    "/v1/playground",
    "/v1/runs",
    "/health",
    "/metrics",
    "/",
)


class ApiKeyMiddleware:
    """Answers 401 to a /v1 request without `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
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
