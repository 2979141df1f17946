"""Sequence- and token-classification heads against transformers' BertForSequenceClassification and
BertForTokenClassification with the same random weights, loaded both ways (from_hf, and to_hf then transformers),
and the config errors of the heads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_config, tokens

from tformer import ModelConfig, build_model
from tformer.config import ConfigError
from tformer.interop.hf import from_hf, to_hf

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
# case -> (architecture, config fields): the "-odd" cases have odd widths, 3 token types, another activation and
# named labels, which must come back as the same id2label
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sequence": ("BertForSequenceClassification", dict(BASE, num_labels=3)),
    "sequence-odd": (
        "BertForSequenceClassification",
        dict(
            BASE,
            hidden_size=33,
            num_attention_heads=3,
            intermediate_size=50,
            type_vocab_size=3,
            hidden_act="gelu_new",
            id2label={0: "law", 1: "history", 2: "wisdom", 3: "prophets", 4: "gospels"},
            label2id={"law": 0, "history": 1, "wisdom": 2, "prophets": 3, "gospels": 4},
        ),
    ),
    "token": ("BertForTokenClassification", dict(BASE, num_labels=5)),
    "token-odd": (
        "BertForTokenClassification",
        dict(BASE, hidden_size=33, num_attention_heads=11, num_hidden_layers=1, hidden_act="relu", num_labels=1),
    ),
}
HEADS = {
    "BertForSequenceClassification": "sequence-classification",
    "BertForTokenClassification": "token-classification",
}
AUTO = {
    "BertForSequenceClassification": "AutoModelForSequenceClassification",
    "BertForTokenClassification": "AutoModelForTokenClassification",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """Each case's transformers model (its head weights drawn at scale 1, so that the logits are not all near
    zero) and the directory save_pretrained wrote."""
    models = {}
    for case, (architecture, fields) in CASES.items():
        torch.manual_seed(0)
        model = getattr(transformers, architecture)(transformers.BertConfig(**fields)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.startswith(("classifier", "bert.pooler")):
                    param.normal_()
        path = tmp_path_factory.mktemp(case)
        model.save_pretrained(path)
        models[case] = model, path
    return models


def difference(ours: torch.nn.Module, theirs: Any) -> float:
    """max |tformer - transformers| over a right-padded batch (for token logits: over the real tokens)."""
    ids = tokens(3, 12, ours.config.vocab_size)
    mask = (torch.arange(12) < torch.tensor([12, 9, 5])[:, None]).long()
    types = (torch.arange(12) >= 4).long().expand(3, 12) % ours.config.type_vocab_size
    with torch.no_grad():
        mine = ours(ids, mask, types)
        reference = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    assert mine.shape == reference.shape
    if mine.dim() == 3:
        mine, reference = mine[mask.bool()], reference[mask.bool()]
    assert reference.abs().max() > 0.1  # logits large enough for the tolerance to mean something
    return (mine - reference).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_from_hf_gives_the_logits_of_transformers(case: str, saved) -> None:
    theirs, path = saved[case]
    ours = from_hf(path)
    assert ours.config.encoder_head == HEADS[CASES[case][0]]
    assert ours.config.num_labels == theirs.config.num_labels
    assert difference(ours, theirs) <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_to_hf_then_transformers_gives_the_same_logits(case: str, saved, tmp_path: Path) -> None:
    architecture = CASES[case][0]
    theirs, path = saved[case]
    ours = from_hf(path)
    to_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [architecture]
    assert {int(k): v for k, v in written["id2label"].items()} == theirs.config.id2label
    exported = getattr(transformers, AUTO[architecture]).from_pretrained(tmp_path).eval()
    assert type(exported).__name__ == architecture
    assert difference(ours, exported) <= TOLERANCE


def test_label_names_survive_from_hf_and_to_hf(saved, tmp_path: Path) -> None:
    ours = from_hf(saved["sequence-odd"][1])
    assert ours.config.label_names == ["law", "history", "wisdom", "prophets", "gospels"]
    assert from_hf(saved["sequence"][1]).config.label_names is None  # transformers' LABEL_i defaults
    to_hf(ours, tmp_path)
    assert from_hf(tmp_path).config.label_names == ours.config.label_names


def test_a_tformer_trained_head_exports_and_matches(tmp_path: Path) -> None:
    """A head built and initialized by tformer (not read from transformers) exports to the same logits."""
    config = tiny_config("tiny-bert", encoder_head="sequence-classification", num_labels=4, type_vocab_size=2)
    ours = build_model(config).eval()
    with torch.no_grad():
        for param in ours.task_head.parameters():
            param.normal_()
    to_hf(ours, tmp_path)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert difference(ours, theirs) <= TOLERANCE


BAD_CONFIGS = [
    (dict(encoder_head="sequence-classification"), "needs num_labels"),
    (dict(encoder_head="token-classification", num_labels=0), "needs num_labels"),
    (dict(encoder_head="mlm", num_labels=3), "apply to the classification heads"),
    (dict(encoder_head="sequence-classification", num_labels=3, label_names=["a", "b"]), "label_names must be 3"),
    (dict(encoder_head="sequence-classificaton", num_labels=3), "did you mean 'sequence-classification'"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CONFIGS)
def test_bad_head_configs_are_config_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_preset("tiny-bert", **overrides)


def test_a_decoder_refuses_a_classification_head() -> None:
    with pytest.raises(ConfigError, match="applies to family 'encoder' only"):
        ModelConfig.from_preset("tiny-gpt2", encoder_head="sequence-classification", num_labels=2)
