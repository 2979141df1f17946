"""mT5 and umT5 against `transformers`' MT5ForConditionalGeneration and UMT5ForConditionalGeneration with the same
random weights: logits on padded batches through from_hf, to_hf back (tensors bit for bit, logits through
transformers again), and greedy translation by tformer's greedy_search and Engine against transformers' generate.
umT5 gives every layer its own relative bias table (relative_attention_per_layer); mT5 is T5 v1.1's layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import right_padded, seq2seq_max_difference
from safetensors.torch import load_file

from tformer.decoding.search import greedy_search
from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.interop.hf import from_hf, to_hf

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |difference| of fp32 logits against transformers (logits of several units: see test_t5.py)
SMALL = dict(vocab_size=96, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, decoder_start_token_id=0)
# case -> (architecture, config fields, whether the head gets its own weights, as in released mT5 and umT5)
CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "mt5": ("MT5ForConditionalGeneration", SMALL, True),
    "umt5": ("UMT5ForConditionalGeneration", dict(SMALL, tie_word_embeddings=False), True),
    "umt5-odd": (  # a tied, scaled head; more decoder layers than encoder ones; few buckets, so the log ones count
        "UMT5ForConditionalGeneration",
        dict(
            SMALL,
            d_model=30,
            d_kv=7,
            num_heads=3,
            num_layers=2,
            num_decoder_layers=3,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=6,
        ),
        False,
    ),
}
CONFIGS = {"MT5ForConditionalGeneration": "MT5Config", "UMT5ForConditionalGeneration": "UMT5Config"}


def reference(case: str) -> Any:
    """The transformers model with every weight moved off its initial value (each bias table its own)."""
    architecture, fields, untied_head = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, CONFIGS[architecture])(**fields)
    model = getattr(transformers, architecture)(config)
    if untied_head:
        model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
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


@pytest.mark.parametrize("case", CASES)
def test_from_hf_gives_the_logits_of_transformers(case: str, checkpoint) -> None:
    theirs, path = checkpoint(case)
    ours = from_hf(path)
    architecture, _, untied = CASES[case]
    assert ours.config.relative_attention_per_layer is architecture.startswith("UMT5")
    assert ours.config.tie_embeddings is not untied
    assert seq2seq_max_difference(ours, theirs) <= TOLERANCE


def test_umt5_layers_read_their_own_tables(checkpoint) -> None:
    """Each umT5 layer's bias table is in use: loading it with the first layer's table everywhere changes the logits."""
    theirs, path = checkpoint("umt5")
    ours = from_hf(path)
    with torch.no_grad():
        for stack in (ours.encoder, ours.decoder):
            for table in stack.positions.relative_biases[1:]:
                table.embedding.weight.copy_(stack.positions.relative_biases[0].embedding.weight)
    assert seq2seq_max_difference(ours, theirs) > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("case", "architecture", "written"),
    [
        ("mt5", None, "T5ForConditionalGeneration"),  # the same layout: the first architecture that holds it
        ("mt5", "MT5ForConditionalGeneration", "MT5ForConditionalGeneration"),
        ("umt5", None, "UMT5ForConditionalGeneration"),
        ("umt5-odd", None, "UMT5ForConditionalGeneration"),
    ],
)
def test_to_hf_writes_the_checkpoint_back(
    case: str, architecture: str | None, written: str, checkpoint, tmp_path: Path
) -> None:
    _, path = checkpoint(case)
    ours = from_hf(path)
    to_hf(ours, tmp_path, architecture=architecture)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [written]
    original, back = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], original[name]) for name in back)
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == written
    assert seq2seq_max_difference(ours, theirs) <= TOLERANCE


N_NEW = 12


@pytest.mark.parametrize("case", CASES)
def test_greedy_translation_equals_transformers_generate(case: str, checkpoint) -> None:
    theirs, path = checkpoint(case)
    ours = from_hf(path)
    src, src_mask = right_padded([8, 5, 11], ours.config.vocab_size, seed=3)
    mine = greedy_search(ours, src, src_mask, N_NEW, bos_id=0, eos_id=-1)  # -1: no token ends a row
    theirs.generation_config.update(eos_token_id=None, forced_eos_token_id=None)
    # transformers' cache for umT5 sizes the decoder by num_layers: with more decoder layers, generate without it
    use_cache = theirs.config.num_decoder_layers == theirs.config.num_layers
    generated = theirs.generate(
        input_ids=src, attention_mask=src_mask, max_new_tokens=N_NEW, do_sample=False, use_cache=use_cache
    )
    assert mine == generated[:, 1:].tolist()


@pytest.mark.parametrize("case", CASES)
def test_engine_translation_equals_transformers_generate(case: str, checkpoint) -> None:
    """The engine's paged decoder (each layer's bias over paged keys) against generate. Without a tokenizer the
    engine starts the target from id 1, so generate is told the same start."""
    theirs, path = checkpoint(case)
    ours = from_hf(path)
    src, src_mask = right_padded([8, 5, 11], ours.config.vocab_size, seed=4)
    sources = [row[: int(n)].tolist() for row, n in zip(src, src_mask.sum(-1), strict=True)]
    engine = Engine(ours, config=EngineConfig(block_size=4, num_blocks=64))
    results = engine.generate(sources, SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True))
    theirs.generation_config.update(eos_token_id=None, forced_eos_token_id=None)
    use_cache = theirs.config.num_decoder_layers == theirs.config.num_layers  # as above
    generated = theirs.generate(
        input_ids=src,
        attention_mask=src_mask,
        max_new_tokens=N_NEW,
        do_sample=False,
        use_cache=use_cache,
        decoder_start_token_id=1,
    )
    assert [result.token_ids for result in results] == generated[:, 1:].tolist()
