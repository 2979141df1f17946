"""Fine-tuning from pretrained weights: `train.init_from` names a tformer checkpoint directory, a Hugging Face
model directory or a GGUF file.

The model config and the tokenizer come with the weights. A recipe's `model:` section may repeat keys that agree
with the weights and may set the keys that only change how the model trains (TRAINING_KEYS); any other key that
differs is a ConfigError. The first checkpoint of such a run is an ordinary tformer checkpoint, and resuming
reads the run's own checkpoint, never the pretrained weights again (the trainer's `_resume` overwrites them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tformer.checkpoints import load_pretrained, read_config
from tformer.config import ConfigError, ModelConfig
from tformer.data import Tokenizer, Vocab
from tformer.models import CheckpointError, TransformerModel, assign_weights, build_model
from tformer.presets import PRESETS

# ModelConfig keys that change how the model trains, not what its weights mean
TRAINING_KEYS = ("dropout", "attn_dropout", "activation_checkpointing", "attention_backend")

# ModelConfig keys that retarget RoPE to a longer context (PI, NTK, YaRN) without changing any weight's shape:
# fine-tuning at a longer length sets them (docs/long-context.md, "Length extrapolation")
CONTEXT_KEYS = ("rope_scaling", "rope_factor", "yarn_beta_fast", "yarn_beta_slow")

# ModelConfig keys of an encoder's head: a recipe may put a new head (a classifier) on pretrained weights
HEAD_KEYS = ("encoder_head", "num_labels", "label_names")
HEAD_TENSORS = ("mlm_head.", "task_head.")  # the prefixes of the head's tensors, which a new head replaces

# ModelConfig keys that training from scratch sets from the tokenizer, so a preset's values do not count
TOKENIZER_KEYS = ("vocab_size", "tgt_vocab_size", "pad_token_id")


@dataclass
class Pretrained:
    """The model to fine-tune (built with the recipe's training keys, holding the pretrained weights) and the
    tokenizer that came with it."""

    model: TransformerModel
    tokenizer: Tokenizer


def weights_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the weights at `path`, read from their config or metadata alone (no tensors)."""
    try:
        return read_config(path)
    except CheckpointError as err:
        raise ConfigError(f"train.init_from: {err}") from None


def recipe_model_config(init_from: str, keys: dict[str, Any], source: str) -> ModelConfig:
    """The weights' config with the recipe's `model:` keys applied; a key that contradicts the weights (other
    than TRAINING_KEYS) is a ConfigError naming it, both values and the fix."""
    weights = weights_config(init_from)
    keys = dict(keys)
    if "preset" in keys:  # a preset's keys count as written, except those training takes from the tokenizer
        name = keys.pop("preset")
        if name not in PRESETS:
            raise ConfigError(f"{source}: unknown preset '{name}'")
        keys = {**{k: v for k, v in PRESETS[name].items() if k not in TOKENIZER_KEYS}, **keys}
    merged = ModelConfig.from_dict({**weights.to_dict(), **keys}, source)
    check_agrees(merged, weights, init_from)
    return merged


def check_agrees(config: ModelConfig, weights: ModelConfig, init_from: str) -> None:
    """Raises ConfigError when `config` differs from the weights' `weights` config in a key outside TRAINING_KEYS."""
    for field in dataclasses.fields(ModelConfig):
        ours, theirs = getattr(config, field.name), getattr(weights, field.name)
        if field.name in TRAINING_KEYS or ours == theirs:
            continue
        if field.name in CONTEXT_KEYS and config.position == "rope":
            continue
        if field.name in HEAD_KEYS and config.family == "encoder":
            continue
        raise ConfigError(
            f"model.{field.name} is {ours!r} in the recipe, but the weights in {init_from} have {theirs!r}; "
            f"with train.init_from the model comes from the weights: remove model.{field.name} from the recipe "
            f"(only {', '.join(TRAINING_KEYS)} may differ, and for RoPE {', '.join(CONTEXT_KEYS)})"
        )


def load_init_from(model_config: ModelConfig, init_from: str) -> Pretrained:
    """The pretrained model, rebuilt with `model_config`'s training keys, and its tokenizer.

    The weights are assigned, not copied, into a model built without random initialization. On the CPU a
    tformer checkpoint's tensors stay privately mapped: training writes copies, never the file.
    """
    loaded, tokenizer = load_pretrained(init_from)
    if tokenizer is None:
        raise ConfigError(
            f"train.init_from: {init_from} has no tokenizer; put the model's tokenizer.json (and "
            "tokenizer_config.json) beside its weights"
        )
    check_agrees(model_config, loaded.config, init_from)
    new_head = any(getattr(model_config, key) != getattr(loaded.config, key) for key in HEAD_KEYS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # a new head starts from the same random weights in every run
        model = build_model(model_config, initialize=new_head)
    state = {k: v for k, v in loaded.state_dict().items() if not (new_head and k.startswith(HEAD_TENSORS))}
    missing, unexpected, mismatched = assign_weights(model, state)
    missing = [name for name in missing if not (new_head and name.startswith(HEAD_TENSORS))]
    if missing or unexpected or mismatched:
        raise CheckpointError(f"{init_from}: missing {missing}, unexpected {unexpected}, wrong shapes {mismatched}")
    return Pretrained(model.train(), tokenizer)


def vocab_of(tokenizer: Tokenizer) -> Vocab:
    """The objectives' special ids for a pretrained tokenizer, whose ids are its own (tformer's BPE puts them at
    0-4). A tokenizer without bos starts sequences with eos (as GPT-2 does); without pad, pads with eos (padding
    is masked out of attention and of the loss)."""
    # BERT's tokenizers name no bos or eos: [CLS] and [SEP] play their parts ([CLS] x [SEP])
    eos = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.token_to_id("[SEP]")
    if eos is None:
        raise ConfigError("the pretrained tokenizer has no eos token, which the objectives end each example with")
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.token_to_id("[CLS]")
    bos = eos if bos is None else bos
    pad = eos if tokenizer.pad_id is None else tokenizer.pad_id
    mask = pad if tokenizer.mask_id is None else tokenizer.mask_id
    return Vocab(
        tokenizer.vocab_size,
        pad_id=pad,
        bos_id=bos,
        eos_id=eos,
        mask_id=mask,
        sentinel_ids=tuple(tokenizer.sentinel_ids),
        special_ids=frozenset(tokenizer.special_ids),
    )
