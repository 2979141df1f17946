"""Longformer sparse attention (layers/sparse_attention.py) against the dense masked formula, and whole models
against transformers' LongformerModel / LongformerForMaskedLM with the same random weights (interop/hf_longformer.py).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_model, tiny_config

from tformer import ConfigError, ModelConfig, TransformerModel
from tformer.interop.hf import DroppedWeightsWarning, from_hf, to_hf
from tformer.interop.hf_spec import UnsupportedHFConfig
from tformer.layers.attention import repeat_kv
from tformer.layers.masks import AttentionMask
from tformer.layers.positions import apply_rotary, make_positions
from tformer.layers.sparse_attention import LongformerAttention

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |difference| of fp32 hidden states and logits against transformers
PAD = 1  # RoBERTa's and Longformer's pad id, from which they number positions


# ---- the module against the dense formula ---------------------------------------------------------------------------


def dense_longformer(attn: LongformerAttention, x: torch.Tensor, real: torch.Tensor, glob: torch.Tensor, rotary=None):
    """The plain formula with a full (T, T) mask: a local row i sees real keys j with |i - j| <= w or j global;
    a global row sees every real key through the global projections. Both share out_proj."""
    B, T, _ = x.shape
    H, D = attn.n_heads, attn.head_dim
    glob = glob & real

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, T, -1, D).transpose(1, 2)

    def attend(q, k, v, allowed):
        k, v = repeat_kv(k, H // attn.n_kv_heads), repeat_kv(v, H // attn.n_kv_heads)
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, torch.finfo(q.dtype).min)
        return torch.softmax(scores, -1) @ v  # (B, H, T, D)

    i = torch.arange(T)
    near = (i[:, None] - i[None, :]).abs() <= attn.window  # (T, T)
    local_ok = (near | glob[:, None, :]) & real[:, None, :]  # (B, T, T)
    local = attend(heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x)), local_ok[:, None])
    everywhere = real[:, None, None, :].expand(B, 1, T, T)
    full = attend(heads(attn.q_global_proj(x)), heads(attn.k_global_proj(x)), heads(attn.v_global_proj(x)), everywhere)
    out = torch.where(glob[:, None, :, None], full, local)
    return attn.out_proj(out.transpose(1, 2).reshape(B, T, -1))


def module_and_inputs(window: int, T: int, position: str = "learned", n_kv_heads: int = 4):
    config = tiny_config(
        "tiny-bert", attention="longformer", attention_window=window, position=position, n_kv_heads=n_kv_heads
    )
    attn = LongformerAttention(config).double()
    for p in attn.parameters():  # weights large enough for peaked attention, so a wrong mask shows
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, T, config.d_model, dtype=torch.float64, requires_grad=True)
    real = torch.ones(3, T, dtype=torch.bool)
    real[1, T - 3 :] = False  # right padding
    real[2, :2] = False  # left padding
    glob = torch.zeros(3, T, dtype=torch.bool)
    glob[0, [0, T // 2]] = True
    glob[1, [1, T - 1]] = True  # the second one is padding, so not global
    glob[2, 2] = True
    rotary = None
    if position == "rope":
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        rotary = tuple(t.double() for t in make_positions(config).rotary(positions))
    return attn, x, real, glob, rotary


@pytest.mark.parametrize(
    ("window", "T"),
    [(2, 13), (4, 13), (6, 16), (8, 5), (16, 17), (4, 40)],
    ids=["w2-T13", "w4-T13", "w6-T16", "window-over-T", "w16-T17", "w4-T40"],
)
@pytest.mark.parametrize("with_global", [False, True], ids=["local", "global"])
def test_sparse_attention_equals_the_dense_masked_formula(window: int, T: int, with_global: bool) -> None:
    attn, x, real, glob, _ = module_and_inputs(window, T)
    glob = glob if with_global else torch.zeros_like(glob)
    mask = AttentionMask(key_padding=real, global_tokens=glob if with_global else None)
    ours, reference = attn(x, mask), dense_longformer(attn, x, real, glob)
    assert (ours - reference)[real].abs().max() < 1e-10
    (grad,) = torch.autograd.grad((ours[real] ** 2).sum(), x)
    (grad_reference,) = torch.autograd.grad((reference[real] ** 2).sum(), x)
    assert (grad - grad_reference).abs().max() < 1e-9


def test_sparse_attention_with_rope_and_grouped_kv_heads() -> None:
    attn, x, real, glob, rotary = module_and_inputs(4, 19, position="rope", n_kv_heads=2)
    ours = attn(x, AttentionMask(key_padding=real, global_tokens=glob), rotary)
    assert (ours - dense_longformer(attn, x, real, glob, rotary))[real].abs().max() < 1e-10


def test_window_and_global_tokens_change_the_output() -> None:
    """The parity tests could not pass by accident: the window and the global tokens both matter."""
    attn, x, real, glob, _ = module_and_inputs(4, 24)
    local = attn(x, AttentionMask(key_padding=real))
    with_global = attn(x, AttentionMask(key_padding=real, global_tokens=glob))
    attn.window = 3
    narrower = attn(x, AttentionMask(key_padding=real))
    assert (local - with_global)[real].abs().max() > 1e-2
    assert (local - narrower)[real].abs().max() > 1e-2


# ---- whole models against transformers -------------------------------------------------------------------------------

HF_CONFIG = dict(
    vocab_size=61,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    attention_window=6,
    max_position_embeddings=40,
    type_vocab_size=2,
    initializer_range=0.2,  # larger than 0.02 so that attention is far from uniform
    pad_token_id=PAD,
)
ARCHITECTURES = ("LongformerModel", "LongformerForMaskedLM")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """architecture -> (its transformers model with random weights, the directory save_pretrained wrote)."""
    saved = {}
    for architecture in ARCHITECTURES:
        torch.manual_seed(0)
        config = transformers.LongformerConfig(**HF_CONFIG)
        model = getattr(transformers, architecture)(config).eval()
        path = tmp_path_factory.mktemp(architecture)
        model.save_pretrained(path)
        saved[architecture] = model, path
    return saved


def load(path: Path) -> TransformerModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedWeightsWarning)  # LongformerModel's pooler
        return from_hf(path)


def batch(side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of 17, 11 and 4 real tokens (17 is no multiple of the window), padded with PAD; global tokens on a few
    positions, one of them on padding; token types 0 then 1."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(PAD + 1, HF_CONFIG["vocab_size"], (3, 17), generator=generator)
    mask = torch.zeros_like(ids)
    for row, n in enumerate((17, 11, 4)):
        mask[row, :n] = 1
    mask = mask if side == "right" else mask.flip(-1)
    ids[mask == 0] = PAD
    glob = torch.zeros_like(ids)
    glob[0, [0, 8, 16]] = 1
    glob[1, [3, 15]] = 1
    glob[2, 1] = 1
    types = (torch.arange(17) >= 6).long().expand(3, 17)
    return ids, mask, glob, types


def max_difference(ours: TransformerModel, theirs: Any, with_global: bool) -> float:
    worst = 0.0
    for side in ("right", "left"):
        ids, mask, glob, types = batch(side)
        glob = glob if with_global else None
        with torch.no_grad():
            out = theirs(input_ids=ids, attention_mask=mask, global_attention_mask=glob, token_type_ids=types)
            reference = out.logits if "logits" in out else out.last_hidden_state
            mine = ours(ids, mask, types, global_tokens=glob)
        real = mask.bool()  # transformers' padding positions read another position row
        worst = max(worst, (mine[real] - reference[real]).abs().max().item())
    return worst


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("with_global", [False, True], ids=["local", "global"])
def test_from_hf_gives_the_outputs_of_transformers(architecture: str, with_global: bool, hf_dirs) -> None:
    theirs, path = hf_dirs[architecture]
    ours = load(path)
    assert ours.config.attention == "longformer" and ours.config.attention_window == 6
    assert ours.config.max_seq_len == HF_CONFIG["max_position_embeddings"] - PAD - 1
    assert max_difference(ours, theirs, with_global) <= TOLERANCE


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_to_hf_writes_a_longformer_that_transformers_loads(architecture: str, hf_dirs, tmp_path: Path) -> None:
    ours = load(hf_dirs[architecture][1])
    to_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [architecture]
    assert written["max_position_embeddings"] == HF_CONFIG["max_position_embeddings"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(transformers, architecture).from_pretrained(tmp_path).eval()
    assert max_difference(ours, theirs, with_global=True) <= TOLERANCE


def test_to_hf_picks_bert_or_longformer_by_the_attention(tmp_path: Path) -> None:
    for attention, model_type in (("softmax", "bert"), ("longformer", "longformer")):
        model = make_model(tiny_config("tiny-bert", attention=attention, attention_window=4))
        to_hf(model, tmp_path / attention)
        assert json.loads((tmp_path / attention / "config.json").read_text())["model_type"] == model_type


def test_different_windows_per_layer_are_refused(hf_dirs, tmp_path: Path) -> None:
    _, path = hf_dirs["LongformerModel"]
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_window": [4, 8]}))
    with pytest.raises(UnsupportedHFConfig, match="attention_window .* differs between layers"):
        load(tmp_path)


# ---- configuration errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(family="decoder", n_decoder_layers=2), "applies to family 'encoder', got 'decoder'"),
        (dict(family="encoder-decoder", n_decoder_layers=2), "applies to family 'encoder', got 'encoder-decoder'"),
        (dict(attention_window=5), "attention_window must be a positive even number .* got 5"),
        (dict(attention_window=0), "attention_window must be a positive even number .* got 0"),
        (dict(position="alibi"), "cannot add ALiBi's bias"),
    ],
    ids=["decoder", "encoder-decoder", "odd-window", "zero-window", "alibi"],
)
def test_bad_longformer_configs_are_config_errors(overrides: dict[str, Any], message: str) -> None:
    base = tiny_config("tiny-bert").to_dict()
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**base, "attention": "longformer", **overrides})
