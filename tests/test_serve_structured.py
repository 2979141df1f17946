"""Structured outputs and tool calls through `tformer serve` on SmolLM2, with the official openai client and httpx.

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` and `guided_*` parameters, and
tool calls (tool_choice "required" or a named function). Each answer equals what the offline `Engine` generates
under the same constraint for the same prompt; the constraints themselves are tested in test_structured.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import LiveServer, client

from tformer.engine import Engine, EngineConfig, SamplingParams, StructuredOutput
from tformer.serve.tools import Tool, ToolCalls

NAME = "smollm2"
BOOK = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"}},
    "required": ["title", "year"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CONFIG = EngineConfig(num_blocks=48, max_model_len=512)


@pytest.fixture(scope="module")
def served(smollm2_pretrained):
    model, tokenizer = smollm2_pretrained
    server = LiveServer(model, tokenizer, CONFIG, name=NAME)
    yield server, Engine(model, tokenizer, CONFIG)
    server.stop()


def offline(engine: Engine, messages: list[dict], spec: StructuredOutput, tools: list | None = None, **kw) -> str:
    """The offline engine's greedy answer to a chat under `spec` (the tools rendered by the template, as served)."""
    extra = {} if tools is None else {"tools": tools}
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, True, **extra))
    params = SamplingParams(max_tokens=kw.get("max_tokens", 60), temperature=0.0, structured=spec)
    return engine.generate([prompt], params)[0].text


def test_response_format_json_schema_and_object_equal_the_offline_engine(served) -> None:
    """OpenAI's response_format: a JSON schema (whole and streamed) and any JSON object, as the offline engine
    answers under the same constraint; the schema's answer parses and has its two keys."""
    server, engine = served
    api = client(server)
    messages = [{"role": "user", "content": "Give me a book as JSON."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK, "strict": True}}
    whole = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=60, temperature=0, response_format=schema_format
    )
    expected = offline(engine, messages, StructuredOutput(json=BOOK))
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "stop"
    assert set(json.loads(expected)) == {"title", "year"}
    chunks = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=60, temperature=0, response_format=schema_format, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    obj = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content == offline(engine, messages, StructuredOutput(json_object=True))


@pytest.mark.parametrize(
    ("extra", "spec"),
    [
        ({"guided_regex": r"[0-9]{1,3} (cats|dogs)"}, {"regex": r"[0-9]{1,3} (cats|dogs)"}),
        ({"guided_choice": ["red", "green", "blue"]}, {"choice": ["red", "green", "blue"]}),
        ({"structured_outputs": {"grammar": 'root ::= "Answer: " [a-z]+'}}, {"grammar": 'root ::= "Answer: " [a-z]+'}),
        ({"guided_json": BOOK}, {"json": BOOK}),
    ],
    ids=["guided_regex", "guided_choice", "structured_outputs-gbnf", "guided_json"],
)
def test_vllm_structured_parameters_on_completions_equal_the_offline_engine(served, extra, spec) -> None:
    """vLLM's `guided_*` and `structured_outputs` on /v1/completions: the text the offline engine gives."""
    server, engine = served
    prompt = "Question: what do you see? Answer in a few words.\n"
    answer = client(server).completions.create(
        model=NAME, prompt=prompt, max_tokens=40, temperature=0, extra_body=extra
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput(**spec))
    assert answer.choices[0].text == engine.generate([prompt], params)[0].text


def test_a_named_tool_call_is_the_offline_answer_under_its_schema(served) -> None:
    """tool_choice naming a function: one call whose arguments are the offline engine's text under the function's
    parameters schema (finish_reason "stop", as OpenAI's forced calls); streamed, the first delta names the call
    and the argument deltas add up to the same arguments."""
    server, engine = served
    api = client(server)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = api.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60, temperature=0
    )
    message = answer.choices[0].message
    expected = offline(engine, ASK, StructuredOutput(json=WEATHER["function"]["parameters"]), tools=[WEATHER, TIME])
    assert message.content is None and answer.choices[0].finish_reason == "stop"
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == expected and call.id.startswith("call_")
    assert set(json.loads(expected)) == {"city", "unit"}
    chunks = list(
        api.chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments for d in deltas) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_tool_calls_are_the_offline_answer_under_the_calls_schema(served) -> None:
    """tool_choice "required": the calls the offline engine writes under the list-of-calls schema, each with its
    arguments (finish_reason "tool_calls"), whole and streamed (the calls go out whole in the last chunk)."""
    server, engine = served
    api = client(server)
    tools = [WEATHER, TIME]
    calls = ToolCalls([Tool.model_validate(t) for t in tools], None, parallel=True)
    expected = json.loads(offline(engine, ASK, calls.constraint, tools=tools, max_tokens=80))
    answer = api.chat.completions.create(
        model=NAME, messages=ASK, tools=tools, tool_choice="required", max_tokens=80, temperature=0
    )
    got = [(c.function.name, json.loads(c.function.arguments)) for c in answer.choices[0].message.tool_calls]
    assert got == [(call["name"], call["parameters"]) for call in expected]
    assert answer.choices[0].finish_reason == "tool_calls"
    chunks = list(
        api.chat.completions.create(
            model=NAME, messages=ASK, tools=tools, tool_choice="required", max_tokens=80, temperature=0, stream=True
        )
    )
    streamed = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(streamed) == 1 and streamed[0].choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed[0].choices[0].delta.tool_calls] == got


def test_a_conversation_with_a_tool_result_is_answered(served) -> None:
    """The assistant's earlier call and the tool's answer (role "tool") reach the chat template; the reply is text."""
    server, engine = served
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    answer = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    rendered = [{**m, "content": m["content"] or ""} for m in messages]  # the server reads a null content as ""
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(rendered, True))
    [expected] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert answer.choices[0].message.content == expected.text and expected.text


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [WEATHER]}, "tool_choice", "needs a parser"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "needs a parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not among",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools", ""),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools", "drop"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "does not compile"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json", "does not compile"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "one structured output"),
        ({"structured_outputs": {"shape": "round"}}, "structured_outputs", "takes one of"),
        ({"functions": [{"name": "f"}]}, "functions", "tools"),
    ],
)
def test_bad_structured_requests_are_400s_naming_the_parameter(served, body, param, words) -> None:
    """Each is a 400 naming the parameter at fault and saying why; the server keeps serving."""
    server, _ = served
    payload = {"model": NAME, "messages": ASK, "max_tokens": 4, **body}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] is None or error["param"].startswith(param), error
    assert words in error["message"], error
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={"model": NAME, "messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200
