"""T5 against `transformers.T5ForConditionalGeneration` with the same random weights (the original layout and v1.1,
tied and untied heads), through from_hf and to_hf; T5's relative buckets against transformers' own function; cached
decoding against uncached forwards; and the chunked (block-by-block bias) path on inputs past 512 tokens against
the dense reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import right_padded, seq2seq_max_difference, tokens, with_config

from tformer import ModelConfig, build_model
from tformer.decoding.search import greedy_search
from tformer.errors import ConfigError
from tformer.interop.hf import from_hf, to_hf
from tformer.layers.masks import DENSE_BIAS_MAX_ENTRIES
from tformer.layers.relative_position import relative_position_bucket

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |difference| of fp32 logits against transformers
SMALL = dict(vocab_size=96, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, decoder_start_token_id=0)
# case -> (T5Config fields, whether the head gets its own weights). v1.1's tie_word_embeddings=False means, in
# transformers 5, no output scaling and a head still tied unless the checkpoint holds its own lm_head.weight.
CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "original": (dict(SMALL, feed_forward_proj="relu"), False),
    "v1.1": (dict(SMALL, feed_forward_proj="gated-gelu", tie_word_embeddings=False), False),
    "v1.1-untied": (dict(SMALL, feed_forward_proj="gated-gelu", tie_word_embeddings=False), True),
    "odd": (  # odd widths, d_kv * heads != d_model, more decoder layers, few buckets: the log buckets and the cap
        dict(
            vocab_size=101,
            d_model=30,
            d_kv=7,
            num_heads=3,
            d_ff=50,
            num_layers=1,
            num_decoder_layers=3,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=6,
            layer_norm_epsilon=1e-5,
            feed_forward_proj="gated-gelu",
            decoder_start_token_id=0,
        ),
        False,
    ),
}


def t5_reference(case: str) -> Any:
    """T5ForConditionalGeneration with every weight moved off its initial value (norm gains away from 1)."""
    fields, untied_head = CASES[case]
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**fields))
    if untied_head:
        model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def t5_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """case -> (the transformers model, the directory save_pretrained wrote), each built once per module."""
    saved: dict[str, tuple[Any, Path]] = {}

    def get(case: str) -> tuple[Any, Path]:
        if case not in saved:
            model, path = t5_reference(case), tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            saved[case] = model, path
        return saved[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_from_hf_gives_the_logits_of_transformers(case: str, t5_checkpoint) -> None:
    theirs, path = t5_checkpoint(case)
    ours = from_hf(path)
    untied = CASES[case][1]
    assert ours.config.tie_embeddings is not untied
    assert ours.config.scale_decoder_output is theirs.config.scale_decoder_outputs
    assert seq2seq_max_difference(ours, theirs) <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_to_hf_then_transformers_gives_the_same_logits(case: str, t5_checkpoint, tmp_path: Path) -> None:
    _, path = t5_checkpoint(case)
    ours = from_hf(path)
    to_hf(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["T5ForConditionalGeneration"]
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == "T5ForConditionalGeneration"
    assert (theirs.lm_head.weight is theirs.shared.weight) is ours.config.tie_embeddings
    assert theirs.config.scale_decoder_outputs is ours.config.scale_decoder_output
    assert seq2seq_max_difference(ours, theirs) <= TOLERANCE


def test_a_model_trained_in_tformer_exports_both_head_settings(tmp_path: Path) -> None:
    """An untied head with the output scaling (no T5 release has it) still round-trips through transformers."""
    torch.manual_seed(0)
    ours = build_model(ModelConfig.from_preset("tiny-t5", scale_decoder_output=True, dropout=0.0)).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    to_hf(ours, tmp_path)
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert theirs.config.scale_decoder_outputs and theirs.lm_head.weight is not theirs.shared.weight
    assert seq2seq_max_difference(ours, theirs) <= TOLERANCE


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 6), (10, 40)])
def test_buckets_equal_transformers(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    relative = torch.arange(-300, 301)[None, :]
    theirs = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
        relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(relative_position_bucket(relative, bidirectional, num_buckets, max_distance), theirs)


# ---- decoding with the KV cache ------------------------------------------------------------------------------------

N_NEW = 24


@pytest.mark.parametrize("case", ["original", "v1.1-untied"])
def test_cached_greedy_search_equals_uncached_and_transformers(case: str, t5_checkpoint) -> None:
    theirs, path = t5_checkpoint(case)
    ours = from_hf(path)
    src, src_mask = right_padded([8, 5], ours.config.vocab_size, seed=3)
    cached = greedy_search(ours, src, src_mask, N_NEW, bos_id=0, eos_id=-1)  # -1: no token ends a row
    tgt = torch.zeros(2, 1, dtype=torch.long)
    steps = []
    with torch.no_grad():  # uncached: the whole target prefix through the model at every step
        for _ in range(N_NEW):
            steps.append(ours(src, tgt, src_mask)[:, -1])
            tgt = torch.cat([tgt, steps[-1].argmax(-1, keepdim=True)], 1)
    assert cached == tgt[:, 1:].tolist()
    theirs.generation_config.update(eos_token_id=None, forced_eos_token_id=None)
    generated = theirs.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=N_NEW, do_sample=False)
    assert cached == generated[:, 1:].tolist()


def test_cached_decoder_logits_equal_the_uncached_forward(t5_checkpoint) -> None:
    ours = from_hf(t5_checkpoint("odd")[1])
    src, src_mask = right_padded([9, 6], ours.config.vocab_size, seed=4)
    tgt = tokens(2, 11, ours.config.vocab_size, seed=5)
    with torch.no_grad():
        full = ours(src, tgt, src_mask)
        memory, cache = ours.encode(src, src_mask), ours.new_cache(2, tgt.shape[1])
        chunks = [(0, 4), (4, 5), (5, 11)]  # a prefill of 4, one token, then 6 at once
        stepped = torch.cat([ours.decode(tgt[:, a:b], memory, src_mask, cache=cache, start=a) for a, b in chunks], 1)
    assert (stepped - full).abs().max().item() <= 1e-5


# ---- inputs past the dense bias: chunked blocks against the whole bias ----------------------------------------------


def test_long_inputs_by_blocks_equal_the_dense_bias() -> None:
    """600 x 600 query-key pairs exceed DENSE_BIAS_MAX_ENTRIES: sdpa builds T5's bias per block of queries, the math
    backend (the reference) once for the whole matrix. Padding and distances past max_distance included."""
    length = 600
    assert length * length > DENSE_BIAS_MAX_ENTRIES
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny-t5", dropout=0.0, attn_dropout=0.0, max_seq_len=1024)
    blocks = build_model(config).eval()
    dense = with_config(blocks, attention_backend="math").eval()
    src, src_mask = right_padded([length, length - 37], config.vocab_size, seed=6)
    tgt = tokens(2, length, config.vocab_size, seed=7)
    with torch.no_grad():
        by_blocks, reference = blocks(src, tgt, src_mask), dense(src, tgt, src_mask)
    assert (by_blocks - reference).abs().max().item() <= 1e-5


# ---- presets and configuration errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "fields"),
    [
        ("t5-small", {}),
        ("t5-v1_1-small", dict(d_ff=1024, num_layers=8, num_heads=6, feed_forward_proj="gated-gelu")),
    ],
)
def test_presets_have_the_parameters_of_transformers(preset: str, fields: dict[str, Any]) -> None:
    config = transformers.T5Config(**fields)
    with torch.device("meta"):
        ours = build_model(ModelConfig.from_preset(preset)).num_parameters()
        theirs = transformers.T5ForConditionalGeneration(config)
    untied_head = theirs.lm_head.weight.numel() if preset == "t5-v1_1-small" else 0  # transformers 5 ties it
    assert ours == sum(p.numel() for p in theirs.parameters()) + untied_head


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(attention="performer", attn_dropout=0.0), "attention 'performer'"),
        (dict(relative_attention_buckets=2), "relative_attention_buckets"),
        (dict(relative_attention_max_distance=4), "relative_attention_max_distance"),
    ],
)
def test_configs_t5_cannot_have_are_refused(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_preset("tiny-t5", **fields)
