"""Building a model: from a ModelConfig (`build_model`), or from a checkpoint directory written by `model.save`
(`load`), whose weights are assigned to a model built without initializing them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tformer.config import ModelConfig
from tformer.errors import CheckpointError
from tformer.models.base import CONFIG_FILE, WEIGHTS_FILE, TransformerModel
from tformer.models.families import MODELS
from tformer.models.init import init_weights
from tformer.models.safetensors_header import check_safetensors_header
from tformer.models.weights import assign_weights, skip_init


def build_model(config: ModelConfig, *, initialize: bool = True) -> TransformerModel:
    """Builds the model for `config` (on torch's current default device) and initializes its weights.

    With `initialize=False` the parameters are left on the meta device, uninitialized, for a loader to
    `assign_weights` from a file: nothing random is computed that would be overwritten.
    """
    if not initialize:
        with skip_init():
            return MODELS[config.family](config)
    model = MODELS[config.family](config)
    init_weights(model, config)
    return model


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> TransformerModel:
    """Loads a checkpoint directory written by `model.save`, in eval mode (call `.train()` to train on).

    Weights load in `dtype`. They stay memory-mapped from model.safetensors (no copy, no random initialization
    first) when they load on the CPU in the dtype they were saved in.
    """
    path = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a tformer checkpoint: {name} is missing")
    config = ModelConfig.from_file(path / CONFIG_FILE)
    model = build_model(config, initialize=False).to(dtype)  # free on the meta device
    check_safetensors_header(path / WEIGHTS_FILE)  # a malformed header: an error naming the field
    try:
        state = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"{path / WEIGHTS_FILE}: cannot load weights: {err}") from None
    missing, unexpected, mismatched = assign_weights(model, state)
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"{path / WEIGHTS_FILE} does not match {CONFIG_FILE}: missing {sorted(missing)}, "
            f"unexpected {unexpected}, wrong shapes {mismatched}"
        )
    return model.to(device).eval()
