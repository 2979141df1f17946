"""The OpenAI wire format's request bodies (pydantic, strict types); the answers are in formats.py.

Parameters tformer cannot honour (best_of, suffix, the older function calls, audio) are declared, so that a request
using them gets a 400 naming the parameter instead of being silently ignored. Unknown fields are
ignored, as OpenAI's SDKs send new optional fields before servers know them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tformer.engine import SamplingParams, StructuredOutput
from tformer.engine.sampling import MAX_LENGTH_PENALTY, REPETITION_PENALTY_RANGE
from tformer.errors import RequestError
from tformer.serve.errors import APIError
from tformer.serve.tools import Tool, ToolCalls

MAX_SAMPLES = 16  # n: more parallel samples of one prompt than this is a 400
MAX_CHOICES = 256  # a batch of prompts times n: more choices than this in one completion is a 400
MIN_TEMPERATURE = 0.01  # below this, logits / T overflows float32; the distribution is already one-hot
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what torch.Generator.manual_seed takes
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]  # OpenAI's presence and frequency range
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]


UNION_FORMS = {  # what a field of several accepted types takes, for error messages
    "prompt": "a string, a list of token ids, or a one-element list of either",
    "stop": "a string or a list of at most 4 strings",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # an extension (vLLM's): usage so far in every chunk


class _GenerationRequest(BaseModel):
    """The parameters completions and chat completions share."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None  # None: the model this server serves
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)  # an extension (vLLM's); 0 or -1 disables it
    seed: Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    ignore_eos: bool = False  # an extension (vLLM's): generate max_tokens tokens even past end-of-sequence
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_SAMPLES)  # samples of one prompt: they share its KV blocks (copy-on-write)
    beam_width: int = Field(1, ge=1, le=MAX_SAMPLES)  # an extension: beam search, the best hypothesis returned
    # an extension: beam search's GNMT alpha, bounded so that the penalty stays finite
    length_penalty: float = Field(0.6, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, allow_inf_nan=False)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # an extension (vLLM's); 1 disables it; bounded so that finite logits stay finite
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)  # an extension (vLLM's, llama.cpp's); 0: off
    min_tokens: int = Field(0, ge=0)  # an extension (vLLM's): no end-of-sequence or stop token before this many
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None  # vLLM's
    logit_bias: dict[str, Bias] | None = None  # {token id as a string: a bias added to its logit}
    user: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict[str, Any] | None = None  # {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """Raises APIError (400, naming the parameter) for a value tformer does not support."""
        for name, (supported, advice) in UNSUPPORTED.items():
            if name in type(self).model_fields and not supported(getattr(self, name)):
                raise APIError(400, f"{name}={getattr(self, name)!r} is not supported: {advice}", param=name)

    def sampling_params(self, max_tokens: int, tools: ToolCalls | None = None) -> SamplingParams:
        """The engine's parameters (RequestError for a value the engine refuses); a tool choice's constraint holds
        the answer when `tools` is given."""
        structured = self.structured_output()
        if tools is not None and structured is not None:
            raise APIError(400, "a tool choice already holds the answer: drop the structured output", param="tools")
        temperature = max(self.temperature, MIN_TEMPERATURE) if self.temperature > 0 else 0.0
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {}
        for token, value in (self.logit_bias or {}).items():
            if not (token.isascii() and token.isdigit()):  # int() also reads digits like '²' and '٣'
                raise APIError(400, f"logit_bias keys are token ids, got {token!r}", param="logit_bias")
            bias[int(token)] = value
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            n=self.n,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty,
            logprobs=self.logprobs_asked(),
            prompt_logprobs=self.prompt_logprobs_asked(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            structured=structured if tools is None else tools.constraint,
        )

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match, from whichever one of the structured-output parameters is given."""
        given: dict[str, dict[str, Any]] = {}
        if self.response_format is not None:
            kind = self.response_format.get("type")
            if kind == "json_object":
                given["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                schema = (self.response_format.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise APIError(
                        400,
                        'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": {...}}',
                        param="response_format",
                    )
                given["response_format"] = {"json": schema}
            elif kind != "text":
                raise APIError(
                    400, f"response_format type {kind!r}: use text, json_object or json_schema", param="response_format"
                )
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given[f"guided_{kind}"] = {kind: value}
        if len(given) > 1:
            raise APIError(400, f"give one structured output, not {' and '.join(given)}", param=next(iter(given)))
        if not given:
            return None
        param, spec = next(iter(given.items()))
        try:
            return StructuredOutput(**spec)
        except TypeError:
            fields = "json, json_object, regex, choice or grammar"
            raise APIError(400, f"{param} takes one of {fields}, got {sorted(spec)}", param=param) from None
        except RequestError as err:
            raise APIError(400, str(err), param=param) from None

    def logprobs_asked(self) -> int | None:
        """How many alternatives each token's log-probabilities list, or None when none are asked."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        """The same for the prompt's tokens."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, as text or token ids (a batch of one is unwrapped)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: the prompt alone, scored
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # the sampled token's and this many likeliest tokens'
    suffix: str | None = None

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs if self.echo else None  # echoed prompts come with their log-probabilities

    def tokens_to_generate(self) -> int:
        """max_tokens (16 when not given); 0 only with echo, which then answers the prompt alone."""
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 answers the prompt alone, so it needs echo: true", param="max_tokens")
        return 16 if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of strings or of token-id lists), answered as one
        completion whose choices are prompt i's samples at indices i * n .. i * n + n - 1."""
        prompt = self.prompt
        if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)):
            return [prompt]  # type: ignore[list-item]
        if len(prompt) * self.n > MAX_CHOICES:
            raise APIError(
                400,
                f"{len(prompt)} prompts x n={self.n} is more than {MAX_CHOICES} choices; split the batch",
                param="prompt",
            )
        return list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (tool calls and call ids included when present)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatRequest(_GenerationRequest):
    """POST /v1/chat/completions: a conversation, rendered to a prompt by the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # the older name of tools
    function_call: str | dict[str, Any] | None = None  # the older name of tool_choice
    parallel_tool_calls: bool = True  # with tool_choice "required": False allows one call only
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_calls(self) -> ToolCalls | None:
        """The request's tool choice (tools.py), or None when the answer calls no tool."""
        return ToolCalls.choose(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (HF's `tools` variable)."""
        return None if not self.tools else [tool.model_dump(exclude_none=True) for tool in self.tools]


class TranslationRequest(BaseModel):
    """POST /v1/translations (tformer's, beside OpenAI's routes): a source sentence for an encoder-decoder model,
    translated by beam search as `tformer translate` does, with the cross-attention weights of the result."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    input: str
    beam_size: int = Field(4, ge=1, le=MAX_SAMPLES)  # 1 is greedy search
    alpha: float = Field(0.6, ge=0.0, le=10.0, allow_inf_nan=False)  # GNMT length penalty ((5 + len) / 6) ** alpha
    attention: bool = True  # False: no attention map (the decoder is not replayed), only the translation


def _is(*allowed: object) -> Callable[[object], bool]:
    return lambda value: any(value is a or (type(value) is type(a) and value == a) for a in allowed)


UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (_is(None, 1), "only best_of=1"),
    "suffix": (_is(None), "insertion (suffix) is not supported"),
    "functions": (lambda v: not v, "the older function calls are not supported: send tools and tool_choice"),
    "function_call": (lambda v: v in (None, "none"), "the older function calls are not supported: use tool_choice"),
    "modalities": (lambda v: v is None or v == ["text"], 'only ["text"]: the model reads and writes text'),
    "audio": (_is(None), "audio output is not supported"),
}
