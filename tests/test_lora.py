"""LoRA against PEFT on the Hugging Face model of the same weights, and merged, saved and trained adapters against the
adapted model they came from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tokens
from safetensors import safe_open

from tformer import TransformerModel
from tformer.errors import CheckpointError, ConfigError
from tformer.interop.hf import from_hf
from tformer.training.lora import (
    ADAPTERS_FILE,
    CONFIG_FILE,
    LoRAConfig,
    apply_lora,
    load_adapters,
    lora_layers,
    lora_state_dict,
    merge_lora,
    save_adapters,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOLERANCE = 1e-5  # max |difference| of fp32 logits
ALL = ("q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj", "down_proj")
HF_NAMES = {"out_proj": "o_proj", "ffn": "mlp", "decoder": "model"}  # tformer name -> LLaMA name, where they differ
CONFIG = LoRAConfig(rank=4, alpha=8.0, target_modules=ALL)


def adapted(hf_dir: Path, config: LoRAConfig = CONFIG, seed: int = 0) -> TransformerModel:
    """The tformer model of `hf_dir` with LoRA applied and random non-zero A and B (so that B A matters)."""
    model = apply_lora(from_hf(hf_dir).eval(), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in lora_state_dict(model).values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    return model


def max_difference(a: TransformerModel, b: TransformerModel) -> float:
    ids = tokens(2, 12, a.config.vocab_size)
    with torch.no_grad():
        return (a(ids) - b(ids)).abs().max().item()


def peft_name(ours: str) -> str:
    """decoder.layers.0.self_attn.out_proj.lora_A.weight -> PEFT's name of the same tensor in a LlamaForCausalLM."""
    *path, part, _ = ours.split(".")
    return ".".join(["base_model.model", *(HF_NAMES.get(n, n) for n in path), part, "default.weight"])


def test_logits_equal_peft_on_the_same_hf_model_and_adapters(checkpoint) -> None:
    theirs, hf_dir = checkpoint("llama")
    ours = adapted(hf_dir)
    targets = [HF_NAMES.get(t, t) for t in ALL]
    lora = peft.LoraConfig(r=CONFIG.rank, lora_alpha=CONFIG.alpha, lora_dropout=0.0, target_modules=targets)
    theirs = peft.get_peft_model(theirs.eval(), lora).eval()
    their_params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, tensor in lora_state_dict(ours).items():
            their_params[peft_name(name)].copy_(tensor)
    copied = {peft_name(name) for name in lora_state_dict(ours)}
    assert copied == {n for n in their_params if ".lora_" in n}  # every PEFT adapter got ours, and nothing else
    ids = tokens(2, 12, ours.config.vocab_size)
    with torch.no_grad():
        difference = (ours(ids) - theirs(input_ids=ids).logits).abs().max().item()
        with theirs.disable_adapter():
            adapter_effect = (ours(ids) - theirs(input_ids=ids).logits).abs().max().item()
    print(f"PEFT parity: max |logit difference| {difference:.2e}; the adapters move the logits by {adapter_effect:.2e}")
    assert difference <= TOLERANCE
    assert adapter_effect > 100 * TOLERANCE  # the adapters matter, so the comparison can fail


def test_fresh_adapters_are_initialised_as_peft_does(checkpoint) -> None:
    _, hf_dir = checkpoint("llama")
    base, model = from_hf(hf_dir).eval(), apply_lora(from_hf(hf_dir).eval(), CONFIG)
    for layer in lora_layers(model).values():
        bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform(a=sqrt(5)) draws from U(-bound, bound)
        a = layer.lora_A.weight
        assert a.abs().max() <= bound and a.abs().max() > bound / 2 and a.std() > bound / 4
        assert torch.count_nonzero(layer.lora_B.weight) == 0
    assert max_difference(model, base) == 0.0  # B = 0: the adapted model starts as the base model


def test_merged_model_equals_the_adapted_one_and_is_a_plain_model(checkpoint, tmp_path: Path) -> None:
    from tformer import load

    _, hf_dir = checkpoint("llama")
    model = adapted(hf_dir)
    merged = merge_lora(adapted(hf_dir))
    assert not lora_layers(merged)
    assert max_difference(merged, model) <= TOLERANCE
    assert max_difference(merged, from_hf(hf_dir).eval()) > 100 * TOLERANCE
    merged.save(tmp_path / "merged")  # refuses a model whose tensors are not the ones its config builds
    assert max_difference(load(tmp_path / "merged"), model) <= TOLERANCE


def test_only_adapters_require_grad_and_a_training_step_changes_only_them(checkpoint) -> None:
    _, hf_dir = checkpoint("llama")
    model = adapted(hf_dir).train()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model)) and len(trainable) == 2 * 7 * model.config.n_decoder_layers
    before = {name: t.clone() for name, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = tokens(2, 12, model.config.vocab_size)
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    optimizer.step()
    after = model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == trainable


def test_saved_adapters_hold_only_adapters_and_reload_to_the_same_logits(checkpoint, tmp_path: Path) -> None:
    _, hf_dir = checkpoint("llama")
    model = adapted(hf_dir)
    save_adapters(model, tmp_path)
    with safe_open(str(tmp_path / ADAPTERS_FILE), framework="pt") as f:
        assert set(f.keys()) == set(lora_state_dict(model))
        assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in f.keys())
    saved = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert (saved["rank"], saved["alpha"], saved["target_modules"]) == (4, 8.0, list(ALL))
    reloaded = load_adapters(from_hf(hf_dir).eval(), tmp_path)  # gets the saved config applied
    assert max_difference(reloaded, model) == 0.0
    with pytest.raises(CheckpointError, match="rank 4"):
        load_adapters(apply_lora(from_hf(hf_dir), LoRAConfig(rank=2, target_modules=ALL)), tmp_path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(rank=0), "rank must be a positive integer"),
        (dict(alpha=-1.0), "alpha must be a positive number"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(target_modules=()), "non-empty list of module names"),
    ],
)
def test_bad_options_are_config_errors(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LoRAConfig(**options)


def test_unknown_or_tied_targets_are_config_errors_naming_the_modules(checkpoint) -> None:
    _, hf_dir = checkpoint("llama")
    with pytest.raises(ConfigError, match=r"\['o_proj'\] match no linear layer.*'out_proj'"):
        apply_lora(from_hf(hf_dir), LoRAConfig(target_modules=("q_proj", "o_proj")))
    _, tied_dir = checkpoint("llama-odd")  # tied embeddings: the output head shares the token table
    with pytest.raises(ConfigError, match="tied"):
        apply_lora(from_hf(tied_dir), LoRAConfig(target_modules=("lm_head",)))


@pytest.mark.parametrize("to", ["tformer", "hf"])
def test_convert_merge_lora_writes_the_adapted_model(checkpoint, tmp_path: Path, to: str) -> None:
    from tformer import load
    from tformer.cli import main

    _, hf_dir = checkpoint("llama")
    model = adapted(hf_dir)
    save_adapters(model, tmp_path / "adapters")
    argv = ["convert", str(hf_dir), "--out", str(tmp_path / "out"), "--to", to, "--merge-lora"]
    assert main([*argv, str(tmp_path / "adapters")]) == 0
    if to == "tformer":
        written = load(tmp_path / "out")
        assert max_difference(written, model) <= TOLERANCE
    else:
        written = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        ids = tokens(2, 12, model.config.vocab_size)
        with torch.no_grad():
            assert (written(input_ids=ids).logits - model(ids)).abs().max().item() <= TOLERANCE
