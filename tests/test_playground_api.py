"""The playground's server side without a browser: POST /v1/translations (answers and errors in OpenAI's shape), the
runs reader behind GET /v1/runs, live usage in streams, the dashboard-only server and `tformer serve --runs`.

The app runs in this process (Starlette's TestClient); answers are compared with the offline search and engine.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playground_helpers import SENTENCE, save_translator
from serve_helpers import CHAT, assert_openai_error
from starlette.testclient import TestClient

from tformer import load
from tformer.checkpoints import load_pretrained
from tformer.cli import main as tformer_main
from tformer.data.tokenizer import Tokenizer
from tformer.decoding import translate_ids
from tformer.engine import Engine, SamplingParams
from tformer.engine.async_engine import AsyncEngine
from tformer.engine.requests import ContextLengthError
from tformer.serve import create_app
from tformer.serve.playground import create_dashboard_app
from tformer.serve.runs import RunsDir

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
TRANSLATIONS = "/v1/translations"


def serve(path: Path, api_key: str | None = None, runs_dir: Path | None = None) -> TestClient:
    engine = AsyncEngine(Engine(*load_pretrained(path)))
    return TestClient(create_app(engine, engine.engine.tokenizer, path.name, api_key, runs_dir))


@pytest.fixture(scope="module")
def translator_dir(tmp_path_factory) -> Path:
    return save_translator(tmp_path_factory.mktemp("translator") / "model")


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for run in ("a", "group/b", "group/b/checkpoints/step-00000010", "x/y/z/too-deep"):
        (root / run).mkdir(parents=True)
        (root / run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    return root


@pytest.fixture(scope="module")
def translator(translator_dir, runs_dir) -> Iterator[TestClient]:
    with serve(translator_dir, KEY, runs_dir) as client:
        client.headers.update(AUTH)
        yield client


def test_a_translation_is_the_searchs_with_its_attention_rows_summing_to_one(translator, translator_dir) -> None:
    model, tokenizer = load(translator_dir).eval(), Tokenizer.load(translator_dir)
    expected = translate_ids(model, [tokenizer.encode(SENTENCE)], 1, 2, 0, beam_size=2, alpha=1.0)[0]
    answer = translator.post(TRANSLATIONS, json={"input": SENTENCE, "beam_size": 2, "alpha": 1.0}).json()
    assert answer["object"] == "translation" and answer["model"] == "model"
    assert answer["translation"] == tokenizer.decode(expected)
    source_len = len(tokenizer.encode(SENTENCE)) + 1
    assert answer["usage"]["prompt_tokens"] == len(answer["source_tokens"]) == source_len
    out_len = answer["usage"]["completion_tokens"]
    assert out_len == len(answer["output_tokens"]) >= len(expected)
    weights = answer["attention"]  # [layer][head][output][source]
    assert [len(weights), len(weights[0])] == [model.config.n_decoder_layers, model.config.n_heads]
    for row in (row for layer in weights for head in layer for row in head):
        assert len(row) == source_len and math.isclose(sum(row), 1.0, abs_tol=1e-5)
    short = translator.post(TRANSLATIONS, json={"input": SENTENCE, "beam_size": 2, "alpha": 1.0, "attention": False})
    assert short.json()["attention"] is None and short.json()["translation"] == answer["translation"]


def test_a_target_at_the_context_limit_is_the_offline_searchs_through_the_engine_and_the_route(
    translator, translator_dir
) -> None:
    """An encoder-decoder's target has the decoder's positions to itself, whatever the source's length: the engine
    allows max_seq_len output tokens, as translate_ids does (it allowed one fewer, and the route searched such
    sources offline)."""
    model, tokenizer = load(translator_dir).eval(), Tokenizer.load(translator_dir)
    limit = model.config.max_seq_len
    engine = Engine(model, tokenizer)
    sources = [tokenizer.encode(SENTENCE), tokenizer.encode(" ".join([SENTENCE] * 4))[: limit - 1]]  # + </s>: 48
    assert engine.context.max_new_tokens(1) == engine.context.max_new_tokens(limit) == limit
    with pytest.raises(ContextLengthError, match=f"use max_tokens <= {limit}"):
        engine.add_request(sources[1] + [tokenizer.eos_id], SamplingParams(max_tokens=limit + 1))
    reached = 0
    for beam in (1, 2):
        expected = translate_ids(model, sources, 1, 2, 0, beam_size=beam, alpha=1.0)
        params = SamplingParams(max_tokens=limit, temperature=0.0, beam_width=beam, length_penalty=1.0)
        served = engine.generate([source + [tokenizer.eos_id] for source in sources], params)
        for source, ids, completion in zip(sources, expected, served, strict=True):
            assert completion.token_ids == ids + [tokenizer.eos_id] * (len(ids) < limit)
            reached += len(ids) == limit
            text = tokenizer.decode(source)
            answer = translator.post(TRANSLATIONS, json={"input": text, "beam_size": beam, "alpha": 1.0}).json()
            assert answer["translation"] == tokenizer.decode(ids)
            assert answer["usage"]["completion_tokens"] == len(completion.token_ids)
    assert reached >= 2  # the random model runs to the limit: the last position is used


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({}, "input", "input is required"),
        ({"input": 7}, "input", "valid string"),
        ({"input": " \n"}, "input", "input is empty"),
        ({"input": " ".join([SENTENCE] * 5)}, "input", "but the model reads at most 48"),
        ({"input": "x", "beam_size": 0}, "beam_size", "greater than or equal to 1"),
        ({"input": "x", "beam_size": 17}, "beam_size", "less than or equal to 16"),
        ({"input": "x", "alpha": -1}, "alpha", "greater than or equal to 0"),
        ({"input": "x", "alpha": "0.6"}, "alpha", "valid number"),
    ],
)
def test_bad_translation_requests_get_openai_errors_naming_the_parameter(translator, body, param, says) -> None:
    response = translator.post(TRANSLATIONS, json=body)
    assert_openai_error(response, 400, param)
    assert says in response.json()["error"]["message"]


def test_translation_errors_for_the_model_and_the_key(translator, tiny_dir) -> None:
    assert_openai_error(translator.post(TRANSLATIONS, json={"input": "x", "model": "other"}), 404, "model")
    for path in ("/v1/playground", "/v1/runs", "/v1/runs/a"):
        assert_openai_error(translator.get(path, headers={"Authorization": ""}), 401)
    assert_openai_error(translator.post(TRANSLATIONS, json={"input": "x"}, headers={"Authorization": ""}), 401)
    assert translator.get("/", headers={"Authorization": ""}).status_code == 200  # the page asks for the key
    assert translator.get("/static/js/main.js", headers={"Authorization": ""}).status_code == 200
    with serve(tiny_dir) as decoder:
        response = decoder.post(TRANSLATIONS, json={"input": "the cat"})
        assert_openai_error(response, 400, "model")
        assert response.json()["error"]["code"] == "unsupported_model"
        assert decoder.get("/v1/playground").json() == {
            "object": "playground",
            "model": tiny_dir.name,
            "family": "decoder",
            "runs": False,
            "max_model_len": 64,
            "chat_template": True,
            "text": True,
        }
        assert_openai_error(decoder.get("/v1/runs"), 404)


def test_the_runs_routes_list_runs_read_records_after_an_offset_and_refuse_others(translator, runs_dir) -> None:
    listed = translator.get("/v1/runs").json()
    assert listed["root"] == str(runs_dir.resolve())
    assert sorted(run["id"] for run in listed["data"]) == ["a", "group/b"]  # not checkpoints/, not 4 levels down
    first = translator.get("/v1/runs/group/b").json()
    assert first["records"] == [{"step": 1, "loss": 2.0}] and first["offset"] == first["size"] == 25
    assert translator.get("/v1/runs/group/b?offset=25").json()["records"] == []
    assert_openai_error(translator.get("/v1/runs/group/b?offset=-1"), 400, "offset")
    assert_openai_error(translator.get("/v1/runs/../a"), 404)
    assert_openai_error(translator.get("/v1/runs/nope"), 404, "id")


def test_the_runs_reader_keeps_whole_lines_and_sees_a_rewritten_file(tmp_path) -> None:
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1, "loss": NaN}\n[1, 2]\nnot json\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    runs = RunsDir(tmp_path)
    read = runs.read("run")
    assert read.records == [{"step": 1, "loss": None}, {"step": 2, "loss": 1.5}]  # NaN is not JSON: null
    assert read.skipped == 2 and read.offset == metrics.stat().st_size - len('{"step": 3, "lo') and not read.reset
    with open(metrics, "a") as f:
        f.write('ss": 1.25}\n')
    again = runs.read("run", read.offset)
    assert again.records == [{"step": 3, "loss": 1.25}] and again.offset == metrics.stat().st_size
    metrics.write_text('{"step": 1, "loss": 3.0}\n')  # a resumed run rewrote it shorter
    rewritten = runs.read("run", again.offset)
    assert rewritten.reset and rewritten.records == [{"step": 1, "loss": 3.0}]
    assert runs.read("other") is None and [r["id"] for r in runs.list()] == ["run"]


def test_continuous_usage_counts_every_token_of_a_stream(tiny, offline) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    prompt = offline.tokenizer.apply_chat_template(body["messages"])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    generated, expected = 0, []  # (text, tokens so far) of each output of the offline engine that carries text
    for out in offline.engine.stream(prompt, params):
        generated += len(out.token_ids)
        expected += [(out.text, generated)] if out.text else []
    with httpx.stream("POST", f"{tiny.url}{CHAT}", json=body, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    role, *content, finish, last = chunks
    shown = [(c["choices"][0]["delta"]["content"], c["usage"]["completion_tokens"]) for c in content]
    assert shown == expected and generated == 8
    assert role["usage"]["completion_tokens"] == 0 and finish["usage"]["completion_tokens"] == 8
    assert finish["choices"][0]["finish_reason"] == "length" and last["choices"] == []
    assert all(c["usage"]["prompt_tokens"] == len(offline.tokenizer.encode(prompt)) for c in chunks)
    assert last["usage"] == {
        "prompt_tokens": len(offline.tokenizer.encode(prompt)),
        "completion_tokens": 8,
        "total_tokens": len(offline.tokenizer.encode(prompt)) + 8,
    }


def test_the_engine_thread_runs_calls_between_steps(tiny_dir) -> None:
    with serve(tiny_dir) as client:
        engine = client.app.state.server.engine
        thread = client.portal.call(engine.call, lambda: threading.current_thread().name)
        assert thread == "tformer-engine"
        with pytest.raises(ZeroDivisionError):
            client.portal.call(engine.call, lambda: 1 / 0)
        assert client.get("/health").json() == {"status": "ok"}  # the thread lives on


def test_a_dashboard_without_a_model(runs_dir) -> None:
    with TestClient(create_dashboard_app(runs_dir, api_key=KEY), headers=AUTH) as client:
        assert client.get("/v1/playground").json() == {
            "object": "playground",
            "model": None,
            "family": None,
            "runs": True,
        }
        assert sorted(r["id"] for r in client.get("/v1/runs").json()["data"]) == ["a", "group/b"]
        assert_openai_error(client.post(TRANSLATIONS, json={"input": "x"}), 400)
        assert_openai_error(client.get("/v1/runs", headers={"Authorization": "Bearer no"}), 401)


def test_tformer_serve_needs_a_model_or_runs_and_serves_a_runs_best_checkpoint(tmp_path, monkeypatch, capsys) -> None:
    assert tformer_main(["serve"]) == 2
    assert "nothing to serve: pass --model PATH" in capsys.readouterr().err
    assert tformer_main(["serve", "--runs", str(tmp_path / "none")]) == 2
    assert f"--runs {tmp_path / 'none'}: no such directory" in capsys.readouterr().err

    run = tmp_path / "en-de"
    for step in (10, 20):
        (run / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step:08d}" / "model.safetensors").write_bytes(b"")
    (run / "best.json").write_text('{"step": 10, "bleu": 1.0, "dev_sentences": 4}\n')
    served = {}
    monkeypatch.setattr("tformer.serve.run_server", lambda model, **kw: served.update(model=model, **kw))
    assert tformer_main(["serve", "--model", str(run), "--runs", str(tmp_path)]) == 0
    assert served["model"] == str(run / "checkpoints" / "step-00000010")  # best.json's, not the latest
    assert served["model_name"] == "en-de" and served["runs_dir"] == str(tmp_path)
