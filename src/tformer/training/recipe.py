"""Recipes: a YAML file with `model:`, `train:` and `lora:` sections, read with overrides and run; a translation
checkpoint scored on a split."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from tformer.config import ConfigError, ModelConfig, read_config_file
from tformer.data import bible_pairs, read_parallel
from tformer.decoding.translator import Translator
from tformer.kernels.dispatch import resolve_device
from tformer.training.config import TrainConfig, check_objective
from tformer.training.distributed import shutdown
from tformer.training.evaluate import TranslationResult, evaluate_translation
from tformer.training.init_from import recipe_model_config
from tformer.training.lora import LoRAConfig
from tformer.training.trainer import Trainer

SECTIONS = ("model", "train", "lora")


def load_recipe(path: str | Path, overrides: list[str] = ()) -> tuple[ModelConfig, TrainConfig]:
    """Reads a recipe (`model:`, `train:` and, for LoRA, `lora:` sections) and applies `section.key=value`
    overrides. A `lora:` section (even an empty one: the defaults) makes the run train LoRA adapters only; it is
    carried by the TrainConfig as `train.lora`."""
    data = read_config_file(path)
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(f"{path}: unknown section '{key}'; a recipe has the sections {', '.join(SECTIONS)}")
    sections = {name: dict(data.get(name) or {}) for name in SECTIONS}
    for item in overrides:
        dotted, sep, value = item.partition("=")
        section, dot, key = dotted.partition(".")
        if not sep or not dot or section not in SECTIONS:
            raise ConfigError(f"override '{item}' must look like model.KEY=VALUE, train.KEY=VALUE or lora.KEY=VALUE")
        sections[section][key] = yaml.safe_load(value)
    if "lora" in sections["train"]:
        raise ConfigError(f"{path}: train.lora is not a train key; put the LoRA options in a top-level lora: section")
    if "lora" in data or sections["lora"]:
        sections["train"]["lora"] = _lora_section(sections["lora"], source=f"{path} (lora)")
    train = TrainConfig.from_dict(sections["train"], source=f"{path} (train)")
    if train.init_from:  # the model comes from the weights; the recipe's model keys may only agree or train
        model = recipe_model_config(train.init_from, sections["model"], source=f"{path} (model)")
    else:
        model = ModelConfig.from_dict(sections["model"], source=f"{path} (model)")
    check_objective(model, train)
    return model, train


def _lora_section(section: dict, source: str) -> dict:
    """The `lora:` section, validated: an unknown key or a bad value is a ConfigError that names it."""
    try:
        return LoRAConfig.from_dict(section).to_dict()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def run_recipe(path: str | Path, overrides: list[str] = (), device: str | None = None) -> dict:
    """Trains as the recipe says, then prints dev BLEU and sample translations. `device` (default: the recipe's
    train.device) is checked before the corpus or the model loads."""
    model_config, train_config = load_recipe(path, overrides)
    device = str(resolve_device(device or train_config.device))
    train_config.device = device  # the run's saved recipe says where it trained
    try:
        trainer = Trainer(model_config, train_config, device)
        result = trainer.fit()
    finally:
        shutdown()
    if not trainer.dist.is_main:  # under torchrun rank 0 reports
        return result
    print(f"\nfinished at step {result['step']} after {result['elapsed']:.0f} s of training")
    if "dev_bleu" in result:
        print(
            f"dev BLEU (all {result['dev_sentences']} sentences, beam {train_config.beam_size}): "
            f"{result['dev_bleu']:.2f}, decoded in {result['dev_seconds']:.0f} s"
        )
        for sample in result["samples"]:
            print(f"  src: {sample['source']}\n  hyp: {sample['hypothesis']}\n  ref: {sample['reference']}")
    if "dev_ppl" in result:
        print(f"dev perplexity ({result['dev_sentences']} lines): {result['dev_ppl']:.2f}")
    print(f"checkpoints in {train_config.out_dir}")
    if train_config.lora is not None:  # the checkpoints hold adapters only: merge them to serve
        print(f"to serve: tformer convert {train_config.init_from} --merge-lora <a checkpoint> --out <dir>")
    if train_config.objective == "seq2seq":
        print(f"try: tformer translate --model {train_config.out_dir} 'In the beginning was the Word.'")
    return result


def evaluate_checkpoint(
    path: str | Path,
    data: str = "bible:en-de",
    split: str = "test",
    beam_size: int = 4,
    alpha: float = 0.6,
    limit: int = 0,
    patience: float | None = None,
    device: str | torch.device = "cpu",
    dtype: str = "auto",
    quantize: str | None = None,
    workers: int | None = None,
) -> TranslationResult:
    """sacreBLEU of a checkpoint on the embedded corpus's `split` or on a parallel file (`patience`: the beam
    search's early stop, Translator.translate_batch), decoded on `device` with the weights' `dtype` and `quantize`
    (Translator.load)."""
    translator = Translator.load(path, dtype, quantize)
    translator.model.to(device)
    pairs = bible_pairs(data.split(":", 1)[1], split) if data.startswith("bible:") else read_parallel(data)
    return evaluate_translation(
        translator.model, translator.tokenizer, pairs[:limit] if limit else pairs, beam_size, alpha, patience, workers
    )
