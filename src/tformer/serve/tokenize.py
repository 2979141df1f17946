"""vLLM's tokenizer routes beside the OpenAI ones: `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`.

A client that scores or budgets prompts tokenizes them exactly as the server does, with no copy of the tokenizer
of its own: lm-evaluation-harness's `local-completions` model, for one, finds these routes and then sends token
ids (its remote tokenizer), which a machine without a model hub needs. The bodies and answers are vLLM's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from tformer.data.tokenizer import Tokenizer
from tformer.serve.errors import APIError
from tformer.serve.protocol import ChatMessage

if TYPE_CHECKING:
    from tformer.serve.app import Server


class TokenizeRequest(BaseModel):
    """A prompt, or chat messages rendered by the chat template, to token ids."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # the bos token first, where the tokenizer puts one
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def _tokenizer(server: Server, param: str) -> Tokenizer:
    if server.tokenizer is None:
        raise APIError(400, "this model has no tokenizer; it takes and gives token ids only", param=param)
    return server.tokenizer


def _tokenized(server: Server, tokenizer: Tokenizer, body: TokenizeRequest) -> dict[str, Any]:
    if body.messages is not None:
        ids = server.chat_prompt(body.messages, body.add_generation_prompt)
    else:
        ids = server.encode(body.prompt or "", "prompt", add_bos=None if body.add_special_tokens else False)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = [tokenizer.decode([token], skip_special_tokens=False) for token in ids]
    return answer


def add_tokenizer_routes(app: FastAPI, server: Server) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        server.check_model(body.model)
        tokenizer = _tokenizer(server, "prompt")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either a prompt or messages", param="prompt")
        # off the event loop: a long text takes seconds to tokenize, and every other client would wait
        return JSONResponse(await asyncio.to_thread(_tokenized, server, tokenizer, body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        server.check_model(body.model)
        tokenizer = _tokenizer(server, "tokens")
        if body.tokens and not 0 <= min(body.tokens) <= max(body.tokens) < tokenizer.vocab_size:
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", param="tokens")
        return JSONResponse({"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        tokenizer = _tokenizer(server, "model")
        return JSONResponse(
            {
                "tokenizer_class": "tformer.Tokenizer",
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "pad_token": tokenizer.special_tokens.get("pad"),
                "add_bos_token": tokenizer.add_bos,
                "chat_template": tokenizer.chat_template,
                "vocab_size": tokenizer.vocab_size,
                "model_max_length": server.engine.max_model_len,
            }
        )
