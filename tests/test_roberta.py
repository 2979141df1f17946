"""RoBERTa against `transformers`' RobertaModel, RobertaForMaskedLM, RobertaFor{Sequence,Token}Classification with
the same random weights, through from_hf and to_hf: hidden states and logits on batches padded with pad_token_id on
either side (transformers numbers positions from pad_token_id + 1, tformer reads its table at position_offset), and
the checkpoint's tensors written back bit for bit.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tformer import ModelConfig, TransformerModel
from tformer.errors import ConfigError
from tformer.interop.hf import FAMILIES, DroppedWeightsWarning, config_from_hf, from_hf, to_hf
from tformer.interop.hf_spec import UnsupportedHFConfig

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # max |difference| of fp32 outputs against transformers
SMALL = dict(
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=40,
    type_vocab_size=1,
    layer_norm_eps=1e-5,
)
# case -> (architecture, RobertaConfig fields)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mlm": ("RobertaForMaskedLM", SMALL),
    "mlm-untied-pad3": (  # another pad id moves the offset; two token types; an untied output layer
        "RobertaForMaskedLM",
        dict(
            SMALL, pad_token_id=3, type_vocab_size=2, tie_word_embeddings=False, hidden_size=36, num_attention_heads=3
        ),
    ),
    "model": ("RobertaModel", SMALL),
    "sequence": ("RobertaForSequenceClassification", dict(SMALL, num_labels=3)),
    "token": ("RobertaForTokenClassification", dict(SMALL, num_labels=5)),
}


def reference(case: str) -> Any:
    """The transformers model with every weight moved off its initial value."""
    architecture, fields = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(transformers.RobertaConfig(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """case -> (the transformers model, the directory save_pretrained wrote), each built once per module."""
    saved: dict[str, tuple[Any, Path]] = {}

    def get(case: str) -> tuple[Any, Path]:
        if case not in saved:
            model, path = reference(case), tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            saved[case] = model, path
        return saved[case]

    return get


def load(path: Path) -> TransformerModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedWeightsWarning)  # RobertaModel's pooler
        return from_hf(path)


def padded(config: ModelConfig, side: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of 12, 9 and 5 tokens that are never pad_token_id, padded with it on one side; random token types."""
    generator = torch.Generator().manual_seed(seed)
    pad, lengths = config.pad_token_id, [12, 9, 5]
    ids = torch.randint(pad + 1, config.vocab_size, (3, 12), generator=generator)
    mask = (torch.arange(12) < torch.tensor(lengths)[:, None]).long()
    mask = mask if side == "right" else mask.flip(-1)
    types = torch.randint(0, config.type_vocab_size, (3, 12), generator=generator)
    return ids.masked_fill(mask == 0, pad), mask, types


def max_difference(ours: TransformerModel, theirs: Any) -> float:
    """max |tformer - transformers| over the real tokens (or rows, for a classifier) of padded batches. A classifier
    reads the first token, which left padding makes a padding token (unspecified): it gets right padding only."""
    worst = 0.0
    sides = ("right",) if ours.config.encoder_head == "sequence-classification" else ("right", "left")
    for side in sides:
        ids, mask, types = padded(ours.config, side)
        with torch.no_grad():
            mine = ours(ids, mask, types)
            out = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
        reference = out.logits if "logits" in out else out.last_hidden_state
        real = mask.bool() if mine.dim() == 3 else slice(None)  # padded positions are unspecified in transformers
        worst = max(worst, (mine[real] - reference[real]).abs().max().item())
    return worst


@pytest.mark.parametrize("case", CASES)
def test_from_hf_gives_the_outputs_of_transformers(case: str, checkpoint) -> None:
    theirs, path = checkpoint(case)
    ours = load(path)
    pad = theirs.config.pad_token_id
    assert (ours.config.position_offset, ours.config.max_seq_len) == (
        pad + 1,
        SMALL["max_position_embeddings"] - pad - 1,
    )
    assert max_difference(ours, theirs) <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_to_hf_writes_roberta_back(case: str, checkpoint, tmp_path: Path) -> None:
    theirs, path = checkpoint(case)
    ours = load(path)
    to_hf(ours, tmp_path)
    architecture = CASES[case][0]
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [architecture]
    assert written["max_position_embeddings"] == SMALL["max_position_embeddings"]
    original, back = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    dropped = {name for name in original if "pooler" in name}  # RobertaModel's pooler has no place in tformer
    assert back.keys() == original.keys() - dropped
    # untied, transformers 5 never reads lm_head.bias (lm_head.decoder.bias is the output bias): to_hf copies that
    unused = set() if ours.config.tie_embeddings else {"lm_head.bias"}
    assert all(torch.equal(back[name], original[name]) for name in back.keys() - unused)
    reloaded = getattr(transformers, architecture).from_pretrained(tmp_path).eval()
    assert max_difference(ours, reloaded) <= TOLERANCE


def test_bert_still_exports_as_bert(tmp_path: Path) -> None:
    """A BERT model (position_offset 0) is no RoBERTa: to_hf keeps it a BertModel."""
    torch.manual_seed(0)
    config = ModelConfig(
        family="encoder",
        vocab_size=50,
        d_model=32,
        n_heads=4,
        d_ff=64,
        n_encoder_layers=1,
        n_decoder_layers=0,
        max_seq_len=32,
        position="learned",
        norm_placement="post",
        embedding_norm=True,
        scale_embeddings=False,
        encoder_head="none",
        ffn="gelu",
        norm_eps=1e-12,
        type_vocab_size=2,
        init="normal",
    )
    from tformer import build_model

    to_hf(build_model(config), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertModel"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(max_position_embeddings=2), "max_position_embeddings"),
        (dict(hidden_act="relu"), "hidden_act"),
    ],
)
def test_configs_tformer_cannot_hold_are_refused(fields: dict[str, Any], named: str) -> None:
    config = transformers.RobertaConfig(**{**SMALL, **fields}).to_dict()
    with pytest.raises(UnsupportedHFConfig, match=named):
        config_from_hf(FAMILIES["RobertaForMaskedLM"], config, Path("config.json"))


def test_position_offset_needs_learned_positions() -> None:
    with pytest.raises(ConfigError, match="position_offset"):
        ModelConfig(position_offset=2)
