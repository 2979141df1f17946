"""Which parameters AdamW decays: matrices only, and none of the SSM's state parameters or its depthwise conv
(Mamba's rule), written out by name as the reference, also after a checkpoint round trip (new parameter objects)."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import make_model, tiny_config

import tformer
from tformer import ModelConfig
from tformer.training.optim import adamw_cosine

SSM_DECAYED = {"in_proj.weight", "x_proj.weight", "dt_proj.weight", "out_proj.weight"}
SSM_NOT_DECAYED = {"A_log", "D", "dt_bias", "conv.weight", "conv.bias"}


def groups_by_name(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """(decayed, not decayed) parameter names of the optimizer the trainer builds."""
    optimizer, _ = adamw_cosine(model, 1e-3, 10, 100, weight_decay=0.1)
    names = {id(p): name for name, p in model.named_parameters()}
    decayed, not_decayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and not_decayed["weight_decay"] == 0.0
    return {names[id(p)] for p in decayed["params"]}, {names[id(p)] for p in not_decayed["params"]}


def ssm_model() -> torch.nn.Module:
    config = ModelConfig(family="ssm", vocab_size=97, d_model=32, n_decoder_layers=2, dropout=0.0, norm="rmsnorm")
    return tformer.build_model(config)


def test_ssm_state_parameters_and_conv_are_not_decayed(tmp_path: Path) -> None:
    model = ssm_model()
    layers = [f"layers.{i}.mixer." for i in range(2)]
    expected_decayed = {layer + name for layer in layers for name in SSM_DECAYED}
    expected_not_decayed = {layer + name for layer in layers for name in SSM_NOT_DECAYED}
    expected_not_decayed |= {"tokens.weight", "norm.weight", "layers.0.norm.weight", "layers.1.norm.weight"}
    assert groups_by_name(model) == (expected_decayed, expected_not_decayed)
    assert model.layers[0].mixer.A_log.ndim == 2 and model.layers[0].mixer.conv.weight.ndim == 3  # once decayed
    model.save(tmp_path)
    assert groups_by_name(tformer.load(tmp_path)) == (expected_decayed, expected_not_decayed)


def test_a_transformer_decays_exactly_its_non_embedding_matrices() -> None:
    model = make_model(tiny_config("tiny-llama"))
    decayed, not_decayed = groups_by_name(model)
    embeddings = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    names = {name: p for name, p in model.named_parameters()}  # tied weights appear once, under their first name
    assert decayed == {n for n, p in names.items() if p.ndim >= 2 and n not in embeddings}
    assert not_decayed == set(names) - decayed
    assert decayed and embeddings & set(names)
