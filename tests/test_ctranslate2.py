"""`tformer convert RUN --to ctranslate2`: CTranslate2 runs the converted model as tformer runs its own.

The reference is tformer itself on a tiny run trained here: CTranslate2's per-token log-probabilities of tformer's
translations, its greedy outputs, and its beam n-best re-ranked with tformer's length penalty.
"""

import pytest
import torch
from helpers import tformer_train, write_recipe

from tformer.checkpoints import load_translation_model
from tformer.cli import main
from tformer.decoding.search import length_penalty, translate_ids
from tformer.errors import ConfigError

ctranslate2 = pytest.importorskip("ctranslate2")
from tformer.interop.ctranslate2 import decode_tokens, source_tokens, to_ctranslate2  # noqa: E402

SENTENCES = 40
MAX_DECODING = 64  # above every sentence's limit in tformer's search (len(source) + 1 + 50)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny encoder-decoder trained until it ends its translations, its sentences and its CTranslate2 copy."""
    directory = tmp_path_factory.mktemp("ct2")
    recipe = write_recipe(directory, max_steps=300, lr=3e-3, warmup=20, save_every=10_000, max_tokens=512)
    result = tformer_train(recipe, "model.dropout=0.0", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = directory / "run"
    out = directory / "ct2"
    assert main(["convert", str(run_dir), "--to", "ctranslate2", "--out", str(out)]) == 0
    model, tokenizer = load_translation_model(run_dir)
    lines = (directory / "corpus.tsv").read_text(encoding="utf-8").splitlines()
    sentences = [line.split("\t")[0] for line in lines[-SENTENCES:]]
    return model.eval(), tokenizer, sentences, ctranslate2.Translator(str(out), device="cpu", intra_threads=1)


def tformer_log_probs(model, tokenizer, sentence: str, target: list[int]) -> list[float]:
    """log p(y_t | x, y_<t) of each target token and the final </s>, by teacher forcing."""
    src = torch.tensor([[*tokenizer.encode(sentence), tokenizer.eos_id]])
    tgt = torch.tensor([[tokenizer.bos_id, *target]])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(src, tgt).float(), -1)[0]
    return [log_probs[t, token].item() for t, token in enumerate([*target, tokenizer.eos_id])]


def test_ctranslate2_scores_tformer_translations_as_tformer_does(run):
    model, tokenizer, sentences, translator = run
    ids = translate_ids(model, tokenizer.encode_batch(sentences), tokenizer.bos_id, tokenizer.eos_id, 0, 1)
    assert sum(map(len, ids)) > 3 * len(sentences)  # the run translates: a test of empty outputs cannot fail
    targets = [[tokenizer.backend.id_to_token(i) for i in row] for row in ids]
    scored = translator.score_batch([source_tokens(tokenizer, s) for s in sentences], targets)
    for sentence, row, result in zip(sentences, ids, scored, strict=True):
        assert result.log_probs == pytest.approx(tformer_log_probs(model, tokenizer, sentence, row), abs=1e-4)


def test_greedy_outputs_are_token_identical(run):
    model, tokenizer, sentences, translator = run
    ours = translate_ids(model, tokenizer.encode_batch(sentences), tokenizer.bos_id, tokenizer.eos_id, 0, 1)
    results = translator.translate_batch(
        [source_tokens(tokenizer, s) for s in sentences],
        beam_size=1,
        min_decoding_length=0,
        max_decoding_length=MAX_DECODING,
    )
    assert [decode_tokens(tokenizer, r.hypotheses[0]) for r in results] == ours


def test_beam_outputs_are_identical_after_reranking_with_tformers_length_penalty(run):
    model, tokenizer, sentences, translator = run
    beam, alpha = 4, 0.6
    ours = translate_ids(model, tokenizer.encode_batch(sentences), tokenizer.bos_id, tokenizer.eos_id, 0, beam, alpha)
    # length_penalty 0: CTranslate2's scores are the summed log-probabilities, </s> included, which tformer
    # divides by ((5 + |y| + 1) / 6) ** alpha
    results = translator.translate_batch(
        [source_tokens(tokenizer, s) for s in sentences],
        beam_size=beam,
        num_hypotheses=beam,
        length_penalty=0.0,
        return_scores=True,
        min_decoding_length=0,
        max_decoding_length=MAX_DECODING,
    )
    reranked = []
    for result in results:
        ranked = [
            (score / length_penalty(len(tokens) + 1, alpha), decode_tokens(tokenizer, tokens))
            for score, tokens in zip(result.scores, result.hypotheses, strict=True)
        ]
        reranked.append(max(ranked, key=lambda pair: pair[0])[1])
    assert reranked == ours


def test_what_ctranslate2_cannot_express_is_a_clear_error(run, tmp_path):
    model, tokenizer, _, _ = run
    with pytest.raises(ConfigError, match="unknown quantization 'int3'"):
        to_ctranslate2(model, tokenizer, tmp_path / "x", quantization="int3")
    model.config.norm_placement = "sandwich"
    try:
        with pytest.raises(ConfigError, match="norm_placement 'sandwich'"):
            to_ctranslate2(model, tokenizer, tmp_path / "y")
    finally:
        model.config.norm_placement = "post"
