"""The common base of tformer models and their checkpoint directory format.

A checkpoint directory holds `config.yaml` and `model.safetensors` (plus the tokenizer, when there is one).
Nothing is ever unpickled: weights go through safetensors only.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_model
from torch import nn

from tformer.config import ModelConfig
from tformer.errors import CheckpointError

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"


class TransformerModel(nn.Module):
    """Base of every model family: holds the config and saves itself as a checkpoint directory."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (tied weights count once), optionally without token/position tables."""
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for module in self.modules():
                if isinstance(module, nn.Embedding):
                    params.pop(id(module.weight), None)
        return sum(p.numel() for p in params.values())

    def save(self, path: str | Path) -> None:
        """Writes config.yaml and model.safetensors into directory `path`; each file appears atomically.

        Refuses (CheckpointError, writing nothing) a model whose tensors are not the ones its config builds,
        such as a quantized copy: `load` could not read that checkpoint back.
        """
        self._check_savable()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.to_file(path / CONFIG_FILE)
        tmp = path / (WEIGHTS_FILE + ".tmp")
        save_model(self, str(tmp))
        os.replace(tmp, path / WEIGHTS_FILE)

    def _check_savable(self) -> None:
        with torch.device("meta"):
            expected = set(type(self)(self.config).state_dict())
        actual = set(self.state_dict())
        if actual != expected:
            raise CheckpointError(
                f"cannot save this model as a tformer checkpoint: its tensors are not the ones its config builds "
                f"(missing {sorted(expected - actual)[:3]}, unexpected {sorted(actual - expected)[:3]}); a "
                "quantized model (int8, int4, w8a8) cannot be saved: save the float model and quantize it when "
                "serving (--quantize)"
            )
