"""Tool calls in /v1/chat/completions by constrained decoding, as vLLM serves them without a model-specific parser.

With `tool_choice` set to a named function, the answer is held (engine/structured.py) to that function's
`parameters` schema and comes back as one call with those arguments. With "required", it is held to a JSON list of
one or more calls, each {"name": one of the tools, "parameters": that tool's arguments}, and comes back as those
calls (`parallel_tool_calls: false` allows one). "none" leaves the tools to the chat template only. "auto", where
the model decides between text and a call, needs a parser for each model family's own call format, which tformer
does not have: it is a 400 that says so.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tformer.engine import StructuredOutput
from tformer.serve.errors import APIError

NO_ARGUMENTS = {"type": "object", "properties": {}}
AUTO_ADVICE = (
    'tool_choice "auto" needs a parser for the model\'s own tool-call format, which tformer does not have; use '
    '"required" or {"type": "function", "function": {"name": ...}} (the call is then decoded under its JSON '
    'schema), or "none"'
)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class ToolCalls:
    """One request's tool choice: the constraint its answer is decoded under, and the calls its text becomes."""

    def __init__(self, tools: list[Tool], named: str | None, parallel: bool) -> None:
        self.tools = {tool.function.name: tool.function for tool in tools}
        self.named = named
        if named is not None:
            self.constraint = StructuredOutput(json=self.tools[named].parameters or NO_ARGUMENTS)
        else:
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": function.parameters or NO_ARGUMENTS},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, function in self.tools.items()
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not parallel:
                schema["maxItems"] = 1
            self.constraint = StructuredOutput(json=schema)
        self._ids: dict[tuple[int, int], str] = {}  # (choice, call) -> the call's id, the same in every chunk

    @classmethod
    def choose(cls, tools: list[Tool] | None, choice: str | dict[str, Any] | None, parallel: bool) -> ToolCalls | None:
        """The tool choice of a request, or None when it calls no tool (APIError for a choice tformer cannot
        serve, or one that names no given tool)."""
        if choice == "none" or (choice is None and not tools):
            return None
        if not tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        if choice in (None, "auto"):
            raise APIError(400, AUTO_ADVICE, param="tool_choice")
        if choice == "required":
            return cls(tools, None, parallel)
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                'tool_choice is "none", "required" or {"type": "function", "function": {"name": ...}}, '
                f"got {choice!r}",
                param="tool_choice",
            )
        if name not in {tool.function.name for tool in tools}:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return cls(tools, name, parallel)

    def call_id(self, index: int, call: int) -> str:
        return self._ids.setdefault((index, call), f"call_{uuid.uuid4().hex[:24]}")

    def calls(self, text: str, index: int = 0) -> list[dict[str, Any]] | None:
        """The calls an answer's text makes; None when it is not a complete call (cut short by max_tokens)."""
        if self.named is not None:
            pairs = [(self.named, text)]  # the arguments as generated, even cut short (OpenAI's behaviour)
        else:
            try:
                decoded = json.loads(text)
            except ValueError:
                return None
            pairs = [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in decoded]
        return [
            {"id": self.call_id(index, i), "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(pairs)
        ]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call ("required"), "stop" for a forced named call."""
        return "tool_calls" if reason == "stop" and self.named is None else reason

    def message(self, text: str, reason: str | None, index: int = 0) -> tuple[dict[str, Any], str | None]:
        """A whole answer's assistant message and finish reason."""
        calls = self.calls(text, index)
        if calls is None:  # a list of calls cut short: the text as it came
            return {"role": "assistant", "content": text}, reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, self.finish_reason(reason)

    def delta(self, text: str, index: int, first: bool) -> dict[str, Any] | None:
        """A stream's delta for a named call's new argument text (its first carries the call's id and name); None
        for "required", whose calls go out whole at the end (`last_delta`)."""
        if self.named is None:
            return None
        function = {"name": self.named, "arguments": text} if first else {"arguments": text}
        call: dict[str, Any] = {"index": 0, "function": function}
        if first:
            call = {"index": 0, "id": self.call_id(index, 0), "type": "function", "function": function}
        return {"tool_calls": [call]}

    def last_delta(self, text: str, index: int) -> dict[str, Any]:
        """The stream's last delta under "required": the whole calls (or the text, if they were cut short)."""
        calls = self.calls(text, index)
        if calls is None:
            return {"content": text}
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
