"""bf16 and int8 weights for the translator (`Translator.load(path, dtype, quantize)`): the layers really change, and
BLEU on sentences of a tiny run trained here stays within `MARGIN` of the fp32 model's (benchmarks/
translation_vs_ctranslate2.py measures the main job's model on the whole dev set)."""

from __future__ import annotations

import pytest
import sacrebleu
import torch
from helpers import trainer, write_recipe

from tformer.cli import main
from tformer.decoding.translator import Translator
from tformer.kernels.w8a8 import W8A8Linear

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = 40
MARGIN = 2.0  # BLEU points on 40 short sentences: one changed word moves BLEU by about 1
MODES = [("bfloat16", None), ("auto", "int8"), ("auto", "w8a8"), ("float32", "int8")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny encoder-decoder trained on the reversal task until it translates, its sentences and references."""
    directory = tmp_path_factory.mktemp("precision")
    recipe = write_recipe(directory, max_steps=300, lr=3e-3, warmup=20, save_every=10_000, max_tokens=512)
    trainer(recipe, "model.dropout=0.0").fit()
    lines = (directory / "corpus.tsv").read_text(encoding="utf-8").splitlines()[-SENTENCES:]
    return directory / "run", [line.split("\t")[0] for line in lines], [line.split("\t")[1] for line in lines]


def bleu(hypotheses: list[str], references: list[str]) -> float:
    return sacrebleu.corpus_bleu(hypotheses, [references]).score


@pytest.mark.parametrize("dtype, quantize", MODES)
def test_low_precision_weights_keep_bleu_within_the_margin_of_fp32(run, dtype: str, quantize: str | None) -> None:
    path, sentences, references = run
    reference = Translator.load(path)
    expected = reference.translate_batch(sentences)
    fp32_bleu = bleu(expected, references)
    assert fp32_bleu > 30  # the run translates (52.7 when written): a margin around noise could not fail
    translator = Translator.load(path, dtype=dtype, quantize=quantize)
    model = translator.model
    weights = {p.dtype for p in model.parameters() if p.is_floating_point()}
    assert weights == {torch.bfloat16 if dtype != "float32" else torch.float32}
    quantized = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    if quantize is None:
        assert not quantized
    else:  # every linear layer, the output head too; int8 rounds activations in two steps (fine), w8a8 in one
        assert not [m for m in model.modules() if type(m) is torch.nn.Linear] and model.lm_head in quantized
        assert all(m.fine == (quantize == "int8") for m in quantized)
    got = translator.translate_batch(sentences)
    assert abs(bleu(got, references) - fp32_bleu) <= MARGIN  # 1.0 at most when written
    assert sum(a == b for a, b in zip(got, expected, strict=True)) >= 0.85 * SENTENCES  # 39 or 40 of 40 then


def test_translate_and_eval_take_dtype_and_quantize(run, tmp_path, capsys) -> None:
    path, sentences, _ = run
    expected = Translator.load(path, dtype="bfloat16", quantize="int8").translate_batch(sentences[:5])
    source = tmp_path / "in.txt"
    source.write_text("\n".join(sentences[:5]) + "\n", encoding="utf-8")
    args = ["translate", "--model", str(path), "--input", str(source), "--dtype", "bfloat16", "--quantize", "int8"]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines() == expected
    assert main(["translate", "--model", str(path), "x", "--quantize", "int9"]) == 2
    assert "unknown quantization mode 'int9'" in capsys.readouterr().err
