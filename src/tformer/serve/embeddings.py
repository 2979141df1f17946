"""OpenAI's `POST /v1/embeddings` on the served model: one vector per input, pooled from its last hidden states
(engine/embedding.py: a decoder's last token, an encoder-decoder's mean encoder state, an encoder's mean state or
its sentence-transformers directory's own pooling; unit length).

Inputs are a string, a list of strings, a list of token ids or a list of such lists (at most 2,048, OpenAI's
limit). `encoding_format` "base64" sends each vector as its float32 bytes (little-endian) in base64, which the
official openai client asks for by default and decodes itself. The forward runs on the engine thread between two
engine steps, so it never computes beside a step, a step's worth of tokens at a time (`max_batched_tokens`), so
that a large request delays the streams running beside it by a step's time per chunk rather than its whole time;
a client that leaves stops its request at the next chunk. A request embeds at most `max_embedding_tokens` tokens.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from tformer.engine.async_engine import EngineStopped
from tformer.engine.embedding import Embedder
from tformer.errors import RequestError
from tformer.serve.errors import APIError

if TYPE_CHECKING:
    from tformer.serve.app import Server

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
TOKENS_PER_CALL = 2048  # an encoder's engine has no step budget: the tokens of one call on its thread


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The request's inputs as a list: a single string or token-id list is one input."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            return [given]  # type: ignore[list-item]
        if not given or len(given) > MAX_INPUTS:
            raise APIError(400, f"input takes 1 to {MAX_INPUTS} inputs, got {len(given)}", param="input")
        return list(given)  # type: ignore[arg-type]


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def add_embedding_routes(app: FastAPI, server: Server) -> None:
    engine = server.engine.engine  # an encoder's EmbeddingEngine brings its own pooling; a generating engine's
    embedder = engine.embedder if not engine.generates else Embedder(engine.model, server.tokenizer)

    config = getattr(engine, "config", None)
    per_call = config.max_batched_tokens if config is not None else TOKENS_PER_CALL

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        server.check_model(body.model)
        if body.dimensions not in (None, embedder.dimensions):
            raise APIError(
                400,
                f"this model's vectors have {embedder.dimensions} dimensions; it cannot shorten them to "
                f"{body.dimensions} (leave dimensions out)",
                param="dimensions",
            )
        inputs = body.inputs()
        try:
            rows = await asyncio.to_thread(embedder.token_ids, inputs)  # tokenizing is off the event loop
        except RequestError as err:
            raise APIError(400, str(err), param="input") from None
        total, cap = sum(len(row) for row in rows), server.limits.max_embedding_tokens
        if total > cap:
            raise APIError(400, f"the inputs hold {total} tokens; one request embeds at most {cap}", param="input")
        vectors = np.empty((len(rows), embedder.dimensions), dtype=np.float32)
        for chunk in _chunks(rows, per_call):
            if await request.is_disconnected():
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
            part = [rows[i] for i in chunk]
            try:
                vectors[chunk] = await server.engine.call(lambda part=part: embedder.embed_ids(part).numpy())
            except EngineStopped as err:
                raise APIError(503, str(err)) from None
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
            for i, vector in enumerate(vectors)
        ]
        tokens = sum(len(row) for row in rows)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": server.model_name, "usage": usage})


def _chunks(rows: list[list[int]], budget: int) -> list[list[int]]:
    """Row indices in chunks of at most `budget` tokens (a longer row alone), by length so that little is padded."""
    chunks: list[list[int]] = []
    tokens = budget
    for i in sorted(range(len(rows)), key=lambda i: len(rows[i])):
        if tokens + len(rows[i]) > budget:
            chunks.append([])
            tokens = 0
        chunks[-1].append(i)
        tokens += len(rows[i])
    return chunks
