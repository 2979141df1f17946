"""LoRA in the training recipe: a `lora:` section fine-tunes the adapters of a `train.init_from` model.

The references: the pretrained checkpoint, whose every tensor the run must leave bit-equal; an uninterrupted run,
whose adapters a run killed after its first checkpoint must resume to bit for bit; and the trained adapted model,
whose weights W + scale B A the `tformer convert --merge-lora` output of its checkpoint must hold, rounded once to
fp32, and whose logits it must give within the model's own fp32 rounding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from helpers import interrupt_and_resume, losses, trainer
from helpers import write_finetune_recipe as write_recipe
from safetensors.torch import load_file

import tformer
from tformer.checkpoints import list_checkpoints
from tformer.cli import main
from tformer.config import ConfigError
from tformer.models import WEIGHTS_FILE
from tformer.training import Trainer, load_recipe
from tformer.training.lora import ADAPTERS_FILE, CONFIG_FILE, lora_layers, merge_lora, with_lora

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = {
    "rank": 8,
    "alpha": 16,
    "dropout": 0.1,
    "target_modules": ["q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
}


def lora_recipe(directory: Path, init_from: Path, lora: dict | None = LORA, **train: object) -> Path:
    """The fine-tuning recipe (helpers.write_finetune_recipe) with a `lora:` section."""
    path = write_recipe(directory, init_from, model={"dropout": 0.1}, **{"lr": 1e-1, "max_steps": 20, **train})
    recipe = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**recipe, "lora": lora}))
    return path


@pytest.fixture(scope="module")
def trained(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    run = trainer(lora_recipe(tmp_path_factory.mktemp("lora"), pretrained))
    run.fit()
    return run


def test_only_the_adapters_train_and_only_they_are_saved(trained: Trainer, pretrained: Path) -> None:
    logged = losses(trained.run_dir)
    assert logged[-1] < logged[0] - 0.3, f"training did not lower the loss: {logged}"
    base = load_file(pretrained / WEIGHTS_FILE)
    state = {k: v for k, v in trained.model.state_dict().items() if "lora_" not in k}
    assert base.keys() <= state.keys()
    changed = [name for name, tensor in base.items() if not torch.equal(state[name], tensor)]
    assert not changed, f"base tensors changed: {changed}"
    trainable = {name for name, p in trained.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert {name for group in trained.optimizer.param_groups for name in map(id, group["params"])} == {
        id(p) for p in trained.model.parameters() if p.requires_grad
    }
    for checkpoint in list_checkpoints(trained.run_dir):
        assert not (checkpoint / WEIGHTS_FILE).exists() and not (checkpoint / "sharded").exists()
        assert sorted(p.name for p in checkpoint.glob("*.safetensors")) == [ADAPTERS_FILE]
        saved = load_file(checkpoint / ADAPTERS_FILE)
        assert saved and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in saved)
        assert (checkpoint / CONFIG_FILE).is_file()
    final = load_file(list_checkpoints(trained.run_dir)[-1] / ADAPTERS_FILE)
    ours = {k: v for k, v in trained.model.state_dict().items() if "lora_" in k}
    assert final.keys() == ours.keys() and all(torch.equal(final[k], ours[k]) for k in final)
    assert any(k.endswith("lora_B.weight") and final[k].abs().max() > 0 for k in final)  # B starts at zero
    # the recipe written into the run directory keeps its lora: section and reads back as the same run
    written = yaml.safe_load((trained.run_dir / "train.yaml").read_text())
    assert written["lora"] == {**LORA, "alpha": 16.0} and "lora" not in written["train"]
    assert load_recipe(trained.run_dir / "train.yaml")[1] == trained.config


def test_interrupted_lora_run_resumes_bit_exactly(pretrained: Path, tmp_path: Path) -> None:
    whole, resumed = interrupt_and_resume(lora_recipe(tmp_path, pretrained, grad_accum=2), tmp_path)
    a = load_file(list_checkpoints(whole.run_dir)[-1] / ADAPTERS_FILE)
    b = load_file(list_checkpoints(resumed.run_dir)[-1] / ADAPTERS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(whole.run_dir) == losses(resumed.run_dir)
    for x, y in zip(whole.optimizer.state.values(), resumed.optimizer.state.values(), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_convert_merge_lora_serves_the_trained_adapted_model(
    trained: Trainer,
    pretrained: Path,
    tmp_path: Path,
) -> None:
    checkpoint = list_checkpoints(trained.run_dir)[-1]
    argv = ["convert", str(pretrained), "--out", str(tmp_path / "merged"), "--merge-lora", str(checkpoint)]
    assert main(argv) == 0
    merged = tformer.load(tmp_path / "merged").eval()
    adapted = trained.model.eval()
    weights = dict(merged.named_parameters())
    for name, layer in lora_layers(adapted).items():  # each merged weight is W + scale B A, rounded once to fp32
        delta = layer.lora_B.weight.double() @ layer.lora_A.weight.double()
        exact_weight = layer.weight.double() + layer.config.scale * delta
        bound = layer.weight.double().abs() + layer.config.scale * (
            layer.lora_B.weight.abs() @ layer.lora_A.weight.abs()
        )
        assert ((weights[f"{name}.weight"].double() - exact_weight).abs() <= 1e-6 * bound.double()).all(), name
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted(ids)
        in_float64 = copy.deepcopy(adapted).double()
        exact = in_float64(ids)
        assert (merge_lora(in_float64)(ids) - exact).abs().max().item() <= 1e-9  # merging changes no function
        # In fp32 the merged model is as close to the adapted one as the adapted one's own forward is to float64:
        # training at lr 0.1 leaves a model that amplifies rounding (measured: 1.8e-4 on logits up to 6.3, and
        # 4.2e-4 between the two on an Intel Xeon; under 1e-5 on an AMD EPYC).
        rounding = (expected.double() - exact).abs().max().item()
        assert (merged(ids) - expected).abs().max().item() <= max(1e-5, 4 * rounding)
        assert (tformer.load(pretrained).eval()(ids) - expected).abs().max().item() > 100 * max(1e-5, 4 * rounding)


@pytest.mark.parametrize(
    ("lora", "overrides", "train", "match"),
    [
        ({"rank": 4, "rnk": 8}, [], {}, r"unknown lora keys \['rnk'\]"),
        ({"rank": 0}, [], {}, r"\(lora\): lora rank must be a positive integer"),
        ({"target_modules": []}, [], {}, "target_modules"),
        (LORA, ["lora.dropot=0.1"], {}, r"unknown lora keys \['dropot'\]"),
        (LORA, [], {"parallel": "fsdp"}, r"LoRA trains in one process only.*'fsdp'"),
        (LORA, ["train.init_from=null"], {}, "set train.init_from"),
        (LORA, ["train.lora=4"], {}, "train.lora is not a train key"),
    ],
)
def test_bad_lora_sections_are_config_errors(
    lora: dict,
    overrides: list[str],
    train: dict,
    match: str,
    pretrained: Path,
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=match):
        load_recipe(lora_recipe(tmp_path, pretrained, lora, **train), overrides)


def test_lora_under_torchrun_is_refused(pretrained: Path, tmp_path: Path) -> None:
    _, train = load_recipe(lora_recipe(tmp_path, pretrained))
    with pytest.raises(ConfigError, match="one process only.*without torchrun"):
        with_lora(tformer.load(pretrained), train.lora_config, distributed=True)


def test_an_empty_lora_section_means_the_defaults(pretrained: Path, tmp_path: Path) -> None:
    _, train = load_recipe(lora_recipe(tmp_path, pretrained, None))
    assert train.lora_config == tformer.training.lora.LoRAConfig()
    _, full = load_recipe(write_recipe(tmp_path, pretrained))
    assert full.lora is None and full.lora_config is None
