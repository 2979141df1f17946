"""LoRA in the training recipe: the trainer's side of a `lora:` section (training/lora.py holds the adapters).

A LoRA run loads its base model as a full fine-tune does (`train.init_from`), wraps the targeted linear layers in
adapters and freezes everything else, so that the optimizer holds the adapters alone. Its checkpoints hold only
what changes: adapters.safetensors and lora.json (as `save_adapters` writes them), the tokenizer, and
trainer_state.pt with the adapters' optimizer state beside the step, cursor and scheduler. No model.safetensors and
no sharded/ state: the base weights are the `init_from` file, unchanged. To serve, merge a checkpoint into them:

    tformer convert <init_from> --merge-lora runs/x/checkpoints/step-00000100 --out merged/

LoRA trains in one process: under torchrun the trainer consolidates and shards the full model, which a model with
adapters does not fit, so several processes are refused with a ConfigError rather than left half working.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_model
from torch import nn

from tformer.errors import ConfigError
from tformer.models import WEIGHTS_FILE
from tformer.training.config import TrainConfig
from tformer.training.lora import ADAPTERS_FILE, apply_lora, load_adapters, lora_layers, save_adapters


def with_lora(model: nn.Module, config: TrainConfig, distributed: bool) -> nn.Module:
    """`model` with the run's adapters applied (everything else frozen), or `model` as it is without LoRA."""
    lora = config.lora_config
    if lora is None:
        return model
    if distributed:
        raise ConfigError(
            "LoRA trains in one process only; several processes (torchrun: ddp, FSDP or tensor parallel) are not "
            "supported with a lora: section. Run `tformer train` without torchrun"
        )
    apply_lora(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"LoRA rank {lora.rank} on {len(lora_layers(model))} layers: {trainable:,} trainable of {total:,} parameters")
    return model


def save_weights(model: nn.Module, directory: Path) -> None:
    """The checkpoint's weights: the adapters alone for a model with LoRA layers, else the whole model."""
    if lora_layers(model):
        save_adapters(model, directory)
    else:
        model.save(directory)


def load_weights(model: nn.Module, checkpoint: Path, device: str) -> None:
    """Loads what `save_weights` wrote into `model`: the adapters of a LoRA checkpoint, else the whole weights."""
    if (checkpoint / ADAPTERS_FILE).is_file():
        load_adapters(model, checkpoint)
    else:
        load_model(model, str(checkpoint / WEIGHTS_FILE), device=device)
