"""`tformer serve` as clients see it: a real server on loopback, the official openai client and httpx; completions,
chat, streams, n samples, beam search, a draft model, 64 concurrent streams and SmolLM2.

Every answer is compared with what the offline `Engine` generates for the same request. Bad requests and fuzzing
are in test_serve_errors.py, `tformer serve` as a process in test_serve_process.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest
from serve_helpers import CMPL, NAME, TEXTS, USER, LiveServer, assert_openai_error, client, metric

from tformer.checkpoints import load_pretrained
from tformer.engine import Engine, EngineConfig, RequestError, SamplingParams
from tformer.engine.async_engine import AsyncEngine, EngineStopped
from tformer.errors import ConfigError
from tformer.kernels.quantize import set_precision


def test_async_engine_streams_then_cancels_everything_on_shutdown(tiny_dir, offline, one_thread) -> None:
    engine = AsyncEngine(Engine(*load_pretrained(tiny_dir)))
    expected = offline.complete("the cat", max_tokens=6, temperature=0.0)

    async def main() -> None:
        engine.start()
        outputs = [o async for o in engine.generate("the cat", SamplingParams(max_tokens=6, temperature=0.0))]
        assert "".join(o.text for o in outputs) == expected.text and outputs[-1].finished
        with pytest.raises(RequestError, match="empty"):
            await engine.add("empty", [], SamplingParams())
        stream = engine.generate("a dog", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)  # what the server's lifespan does at the end
        with pytest.raises(EngineStopped, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineStopped):
            await engine.add("late", [5], SamplingParams())

    asyncio.run(main())
    assert not engine.is_running and engine.stats.blocks_in_use == 0 and engine.num_cancelled == 1


def test_launch_builds_the_engine_on_the_thread_that_steps_it(tiny_dir, offline, one_thread) -> None:
    """The server's engine is loaded, warmed up and stepped on one thread (one OpenMP team: see `launch`)."""
    built_on = []

    def build() -> Engine:
        built_on.append(threading.current_thread())
        return Engine(*load_pretrained(tiny_dir))

    engine = AsyncEngine.launch(build)
    expected = offline.complete("the cat", max_tokens=6, temperature=0.0)

    async def main() -> tuple[str, threading.Thread]:
        text = "".join([o.text async for o in engine.generate("the cat", SamplingParams(max_tokens=6, temperature=0))])
        return text, await engine.call(threading.current_thread)

    try:
        text, stepped_on = asyncio.run(main())
    finally:
        engine.shutdown()
    assert text == expected.text
    assert stepped_on is built_on[0] is not threading.main_thread()

    def broken() -> Engine:
        raise ConfigError("no such model")

    with pytest.raises(ConfigError, match="no such model"):  # a failed build reaches the caller
        AsyncEngine.launch(broken)


# ---- the openai client against the tiny model ------------------------------------------------------------------


def test_models_health_and_metrics(tiny) -> None:
    assert [m.id for m in client(tiny).models.list().data] == [NAME]
    assert client(tiny).models.retrieve(NAME).id == NAME
    assert httpx.get(f"{tiny.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{tiny.url}/metrics").text
    for name in (
        "tformer_requests_waiting",
        "tformer_requests_running",
        "tformer_kv_blocks_in_use",
        "tformer_prompt_tokens_total",
        "tformer_generation_tokens_total",
    ):
        assert re.search(rf"^# TYPE {name} (gauge|counter)$", text, re.MULTILINE), name
    assert re.search(r'^tformer_requests_total\{endpoint="/v1/models",status="200"\} [1-9]', text, re.MULTILINE)


def test_a_server_with_a_draft_streams_the_models_own_greedy_text(tiny_dir, offline, one_thread) -> None:
    model, tokenizer = load_pretrained(tiny_dir)
    draft = set_precision(load_pretrained(tiny_dir)[0], "float32", "int8")  # as `--draft-quantize int8`
    server = LiveServer(model, tokenizer, EngineConfig(num_speculative_tokens=3), draft=draft)
    try:
        expected = offline.complete("the cat", max_tokens=12, temperature=0.0, ignore_eos=True)
        stream = client(server).completions.create(
            model=NAME, prompt="the cat", max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected.text
        drafted = metric(server.url, "tformer_spec_decode_draft_tokens_total")
        assert 0 < metric(server.url, "tformer_spec_decode_accepted_tokens_total") <= drafted
    finally:
        server.stop()


@pytest.mark.parametrize("prompt", ["the cat", [5, 17, 42, 9]], ids=["text", "token-ids"])
def test_completions_equal_the_offline_engine(tiny, offline, prompt) -> None:
    expected = offline.complete(prompt, max_tokens=10, temperature=0.0)
    result = client(tiny).completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert result.object == "text_completion" and result.model == NAME and result.id.startswith("cmpl-")
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    prompt_tokens = len(prompt) if isinstance(prompt, list) else len(offline.tokenizer.encode(prompt))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, len(expected.token_ids))
    chunks = list(client(tiny).completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_stop_strings_and_seeded_sampling_equal_the_offline_engine(tiny, offline) -> None:
    expected = offline.complete("a dog", max_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=7)
    result = client(tiny).completions.create(
        model=NAME, prompt="a dog", max_tokens=12, temperature=0.9, top_p=0.9, seed=7, extra_body={"top_k": 20}
    )
    assert result.choices[0].text == expected.text
    stop = expected.text[3:5] or "x"
    expected = offline.complete("a dog", max_tokens=12, temperature=0.0, stop=[stop])
    result = client(tiny).completions.create(model=NAME, prompt="a dog", max_tokens=12, temperature=0, stop=stop)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (expected.text, expected.finish_reason)


def test_chat_completions_equal_the_offline_engine(tiny, offline) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sun is"}]
    expected = offline.chat(messages, max_tokens=8, temperature=0.0)
    result = client(tiny).chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage.completion_tokens == len(expected.token_ids)
    stream = client(tiny).chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_logprobs_and_penalties_equal_the_offline_engine(tiny, offline) -> None:
    """Completions' legacy `logprobs` (tokens, their log-probabilities, the top ones with the sampled token among
    them, text offsets) and chat's `logprobs` / `top_logprobs` (token, log-probability, UTF-8 bytes), whole and
    streamed, are the offline engine's; the penalties and logit_bias reach the engine."""
    adjust = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {"7": 3.0}}
    expected = offline.complete(
        "the cat", max_tokens=8, temperature=0.0, logprobs=2, **{**adjust, "logit_bias": {7: 3.0}}
    )
    text_of = [offline.tokenizer.decode([item.token_id], skip_special_tokens=False) for item in expected.logprobs]
    result = client(tiny).completions.create(
        model=NAME, prompt="the cat", max_tokens=8, temperature=0, logprobs=2, **adjust
    )
    choice = result.choices[0]
    assert choice.text == expected.text and choice.logprobs.tokens == text_of
    close = dict(abs=1e-5)  # the server's engine batches and threads as it will: the last bits may differ
    assert choice.logprobs.token_logprobs == pytest.approx([item.logprob for item in expected.logprobs], **close)
    assert choice.logprobs.text_offset == [sum(len(t) for t in text_of[:i]) for i in range(len(text_of))]
    for top, item in zip(choice.logprobs.top_logprobs, expected.logprobs, strict=True):
        pairs = [*item.top, (item.token_id, item.logprob)]
        assert top == pytest.approx(
            {offline.tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in pairs}, **close
        )
    chunks = list(
        client(tiny).completions.create(
            model=NAME, prompt="the cat", max_tokens=8, temperature=0, logprobs=2, stream=True, **adjust
        )
    )
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(choice.logprobs.token_logprobs, **close)
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == (
        choice.logprobs.text_offset
    )

    messages = [{"role": "user", "content": "the sun is"}]
    expected = offline.chat(messages, max_tokens=6, temperature=0.0, logprobs=3)
    answer = client(tiny).chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert [c.token for c in content] == [
        offline.tokenizer.decode([i.token_id], skip_special_tokens=False) for i in expected.logprobs
    ]
    assert [c.logprob for c in content] == pytest.approx([i.logprob for i in expected.logprobs], **close)
    assert all(c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 3 for c in content)
    tops = [t.logprob for c in content for t in c.top_logprobs]
    assert tops == pytest.approx([lp for i in expected.logprobs for _, lp in i.top], **close)
    stream = client(tiny).chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [t.logprob for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([i.logprob for i in expected.logprobs], **close)
    plain = client(tiny).chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(tiny, offline) -> None:
    """lm-evaluation-harness's loglikelihood request (`echo`, `logprobs`, one new token): the text starts with the
    prompt, and the tokens are the prompt's then the new one, the first with no log-probability and the rest the
    offline engine's `prompt_logprobs`; the same streamed, for a batch of two prompts, and plain echo without
    log-probabilities."""
    close = dict(abs=1e-5)
    prompts = ["the cat sat on", "a dog"]
    expected = [offline.complete(p, max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1) for p in prompts]
    result = client(tiny).completions.create(
        model=NAME, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    for choice, prompt, completion in zip(result.choices, prompts, expected, strict=True):
        assert choice.text == prompt + completion.text
        ids = [*completion.prompt_token_ids, *completion.token_ids]
        assert choice.logprobs.tokens == [offline.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        scored = [*completion.prompt_logprobs[1:], *completion.logprobs]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx([item.logprob for item in scored], **close)
        tokens = choice.logprobs.tokens
        assert choice.logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    texts, logprobs = ["", ""], [[], []]
    for chunk in client(tiny).completions.create(
        model=NAME, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True, stream=True
    ):
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        logprobs[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
    assert texts == [c.text for c in result.choices]
    assert logprobs[0][0] is None and logprobs[0][1:] == pytest.approx(result.choices[0].logprobs.token_logprobs[1:])
    scored = client(tiny).completions.create(model=NAME, prompt=prompts, max_tokens=0, logprobs=1, echo=True)
    for choice, prompt in zip(scored.choices, prompts, strict=True):
        assert (choice.text, choice.finish_reason) == (prompt, "length")  # max_tokens 0: the prompt alone
        assert choice.logprobs.token_logprobs == result.choices[choice.index].logprobs.token_logprobs[:-1]
    assert scored.usage.completion_tokens == 0
    streamed = client(tiny).completions.create(model=NAME, prompt="a dog", max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "a dog"
    for stream in (False, True):  # n = 2: both samples of a prompt carry its log-probabilities
        answer = client(tiny).completions.create(
            model=NAME, prompt="a dog", max_tokens=2, temperature=1.0, seed=3, n=2, logprobs=1, echo=True, stream=stream
        )
        by_choice = [[], []]
        for part in answer if stream else [answer]:
            for choice in part.choices:
                by_choice[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
        prompt_length = len(offline.tokenizer.encode("a dog"))
        assert by_choice[0][:prompt_length] == by_choice[1][:prompt_length] and by_choice[0][0] is None
        assert by_choice[0][1:prompt_length] == pytest.approx(
            result.choices[1].logprobs.token_logprobs[1:prompt_length]
        )
    plain = client(tiny).completions.create(model=NAME, prompt="a dog", max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == "a dog" + offline.complete("a dog", max_tokens=3, temperature=0.0).text
    assert plain.choices[0].logprobs is None


def test_tokenizer_routes_tokenize_as_the_server_does(tiny, offline) -> None:
    """vLLM's /tokenize (a prompt, with or without the bos token; chat messages through the template),
    /detokenize and /tokenizer_info give the server's own tokenizer's answers; a bad body is a 400."""
    tokenizer = offline.tokenizer
    answer = httpx.post(f"{tiny.url}/tokenize", json={"prompt": "the cat sat", "return_token_strs": True}).json()
    assert answer["tokens"] == tokenizer.encode("the cat sat") and answer["count"] == len(answer["tokens"])
    assert answer["token_strs"] == [tokenizer.decode([t], skip_special_tokens=False) for t in answer["tokens"]]
    assert answer["max_model_len"] == 64
    bare = httpx.post(f"{tiny.url}/tokenize", json={"prompt": "the cat", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("the cat", add_bos=False)
    chat = httpx.post(f"{tiny.url}/tokenize", json={"messages": USER}).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(USER))
    text = httpx.post(f"{tiny.url}/detokenize", json={"tokens": answer["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(answer["tokens"])
    info = httpx.get(f"{tiny.url}/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["chat_template"]) == (
        tokenizer.eos_token,
        tokenizer.bos_token,
        tokenizer.chat_template,
    )
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        assert_openai_error(httpx.post(f"{tiny.url}{path}", json=body), 400, param)


def test_vllm_sampling_extensions_reach_the_engine(tiny, offline) -> None:
    """vLLM's `min_p`, `min_tokens` and `stop_token_ids` give the offline engine's text; min_tokens above
    max_tokens is a 400."""
    first = offline.complete("the cat", max_tokens=1, temperature=0.0).token_ids[0]
    extras = {"min_p": 0.2, "min_tokens": 3, "stop_token_ids": [first]}
    expected = offline.complete("the cat", max_tokens=8, temperature=0.9, seed=4, **extras)
    result = client(tiny).completions.create(
        model=NAME, prompt="the cat", max_tokens=8, temperature=0.9, seed=4, extra_body=extras
    )
    assert (result.choices[0].text, result.choices[0].finish_reason) == (expected.text, expected.finish_reason)
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 2, "min_tokens": 3}
    assert_openai_error(httpx.post(f"{tiny.url}{CMPL}", json=body), 400)
    plain_text = {"messages": USER, "max_tokens": 2, "response_format": {"type": "text"}, "tool_choice": "none"}
    assert httpx.post(f"{tiny.url}/v1/chat/completions", json=plain_text).status_code == 200


def test_raw_stream_is_openai_sse_ending_with_done(tiny) -> None:
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{tiny.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_64_concurrent_streams_each_get_their_own_tokens(tiny, offline) -> None:
    prompts = [f"{TEXTS[i % 4]} {i}" for i in range(64)]
    lengths = [4 + i % 7 for i in range(64)]  # a misrouted token would also break the token counts
    expected = offline.engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths])
    assert len({e.text for e in expected}) > 40, "the reference outputs must differ for misrouting to show"

    async def one(api: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, str | None, int]:
        stream = await api.completions.create(
            model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        text, reason, tokens = "", None, -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, reason, tokens

    async def run_all() -> list[tuple[str, str | None, int]]:
        api = client(tiny, openai.AsyncOpenAI)
        return await asyncio.gather(*(one(api, p, n) for p, n in zip(prompts, lengths, strict=True)))

    results = asyncio.run(run_all())
    assert results == [(e.text, e.finish_reason, len(e.token_ids)) for e in expected]
    assert metric(tiny.url, "tformer_kv_blocks_in_use") == 0


def test_n_samples_equal_the_offline_engine_whole_and_streamed(tiny, offline) -> None:
    params = {"max_tokens": 10, "temperature": 1.0, "seed": 3}
    expected = offline.engine.generate(["the moon"], SamplingParams(n=3, **params))
    assert [c.index for c in expected] == [0, 1, 2] and len({c.text for c in expected}) > 1
    result = client(tiny).completions.create(model=NAME, prompt="the moon", n=3, **params)
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [
        (c.index, c.text, c.finish_reason) for c in expected
    ]
    assert result.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    stream = client(tiny).chat.completions.create(model=NAME, messages=USER, n=2, stream=True, **params)
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    expected = offline.engine.generate([offline.tokenizer.apply_chat_template(USER)], SamplingParams(n=2, **params))
    assert texts == [c.text for c in expected] and reasons == [c.finish_reason for c in expected]
    assert metric(tiny.url, "tformer_kv_blocks_in_use") == 0


def test_a_batch_of_prompts_equals_the_offline_engine_whole_and_streamed(tiny, offline) -> None:
    """A list of prompts (strings, or token-id lists) is one completion: prompt i's n samples are choices i * n + j,
    each the offline engine's, the usage sums them, and every block returns to the pool, also after a stream is
    left early."""
    params = {"max_tokens": 6, "temperature": 1.0, "seed": 11}
    prompts = ["the moon", "a dog", "the cat"]
    expected = [c for p in prompts for c in offline.engine.generate([p], SamplingParams(n=2, **params))]
    result = client(tiny).completions.create(model=NAME, prompt=prompts, n=2, **params)
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [
        (i, c.text, c.finish_reason) for i, c in enumerate(expected)
    ]
    assert result.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in prompts)
    assert result.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    ids = [offline.tokenizer.encode(p) for p in prompts]
    texts = [""] * 6
    for chunk in client(tiny).completions.create(model=NAME, prompt=ids, n=2, stream=True, **params):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in expected]
    with client(tiny).completions.create(model=NAME, prompt=prompts, max_tokens=40, stream=True) as stream:
        next(iter(stream))  # then leave
    deadline = time.monotonic() + 10
    while metric(tiny.url, "tformer_kv_blocks_in_use") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(tiny.url, "tformer_kv_blocks_in_use") == 0


def test_beam_search_extension_equals_the_offline_engine_whole_and_streamed(tiny, offline) -> None:
    params = {"max_tokens": 10, "beam_width": 3, "length_penalty": 0.6}
    expected = offline.engine.generate(["the moon"], SamplingParams(**params))[0]
    body = {"model": NAME, "prompt": "the moon", **params}
    whole = httpx.post(f"{tiny.url}{CMPL}", json=body).json()
    assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == (
        expected.text,
        expected.finish_reason,
    )
    streamed = client(tiny).completions.create(
        model=NAME, prompt="the moon", stream=True, extra_body=params, max_tokens=10
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert metric(tiny.url, "tformer_kv_blocks_in_use") == 0


# ---- real weights -------------------------------------------------------------------------------------------------


def test_smollm2_answers_equal_the_offline_engine(one_thread, smollm2_pretrained) -> None:
    model, tokenizer = smollm2_pretrained
    config = EngineConfig(num_blocks=24, max_model_len=256)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [tokenizer.apply_chat_template(messages), "The capital of France is"]
    expected = Engine(model, tokenizer, config).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    server = LiveServer(model, tokenizer, config, name="smollm2")
    try:
        api = client(server)
        chat = api.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
        chunks = api.completions.create(model="smollm2", prompt=prompts[1], max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks)
    finally:
        server.stop()
    assert chat.choices[0].message.content == expected[0].text and "Paris" in expected[0].text
    assert streamed == expected[1].text
