"""OpenAI-style errors: every failure a client can cause becomes `{"error": {message, type, param, code}}`.

FastAPI's own answers (422 for a body that does not validate, `{"detail": ...}` for 404 and 405) are replaced
by handlers that give OpenAI's shape and status codes: 400 for a bad body, whatever its kind.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tformer.data import DataError
from tformer.engine import RequestError

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error"}


class APIError(Exception):
    """An error to send to the client as an OpenAI error object with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message quoting a client's lone surrogate still encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    headers = {**({"WWW-Authenticate": "Bearer"} if status == 401 else {}), **(headers or {})}
    return _AsciiJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _api_error(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, APIError)
    return error_response(err.status, err.message, err.param, err.code, err.headers)


def _validation_handler(union_forms: dict[str, str]) -> Callable[[Request, Exception], JSONResponse]:
    def handle(_: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, RequestValidationError)
        errors = err.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON ({detail}); send a JSON object")
        message, param = describe_validation_error(first, union_forms)
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 and "must be" not in message else ""
        return error_response(400, message + more, param)

    return handle


def describe_validation_error(error: Mapping[str, Any], union_forms: dict[str, str]) -> tuple[str, str | None]:
    """(message, top-level parameter) of one pydantic error; a union field is described by its accepted forms.

    Pydantic names the union member it tried in the location (`prompt.list[int].0`); that is noise to a client,
    so the path stops at the union field and the message lists what the field accepts.
    """
    loc = [str(part) for part in error.get("loc", ())]
    path = loc[1:] if loc[:1] == ["body"] else loc
    param = path[0] if path else None
    if error.get("type") == "missing":
        return f"{'.'.join(path)} is required", param
    for i, part in enumerate(path):
        if part in union_forms:
            return f"{'.'.join(path[: i + 1])} must be {union_forms[part]}", param
    return f"{'.'.join(path) or 'body'}: {error.get('msg', 'invalid value')}", param


def _http_error(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, HTTPException)
    message = str(err.detail)
    if err.status_code == 400:  # FastAPI could not read the body (not UTF-8, nested too deep, ...)
        message = "the request body could not be parsed; send a UTF-8 JSON object"
    elif err.status_code == 404:
        message = "no such route; the API lives under /v1 (/v1/models, /v1/completions, /v1/chat/completions)"
    elif err.status_code == 405:
        message = "this route does not accept that HTTP method"
    return error_response(err.status_code, message)


def _request_error(_: Request, err: Exception) -> JSONResponse:
    return error_response(400, str(err))


def _internal_error(_: Request, err: Exception) -> JSONResponse:
    logger.error("unhandled error", exc_info=err)
    return error_response(500, f"internal server error: {type(err).__name__}")


def install_error_handlers(app: FastAPI, union_forms: dict[str, str]) -> None:
    """Routes every error kind to its OpenAI-shaped response; `union_forms` describes fields of several types."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_handler(union_forms))
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestError, _request_error)  # the engine refused the request
    app.add_exception_handler(DataError, _request_error)  # e.g. the chat template rejected the messages
    app.add_exception_handler(Exception, _internal_error)
