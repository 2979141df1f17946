"""Models built from a ModelConfig: `build_model(config)` returns the family the config names."""

from __future__ import annotations

from tformer.config import ModelConfig
from tformer.models.base import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, TransformerModel, load
from tformer.models.families import MODELS, DecoderLM, EncoderDecoder, EncoderMLM
from tformer.models.init import init_weights
from tformer.models.recurrent import LSTMEncoderDecoder, RecurrentCache
from tformer.models.weights import assign_weights, meta_tensors, skip_init


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


__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "DecoderLM",
    "EncoderDecoder",
    "EncoderMLM",
    "LSTMEncoderDecoder",
    "MODELS",
    "RecurrentCache",
    "TransformerModel",
    "assign_weights",
    "build_model",
    "init_weights",
    "load",
    "meta_tensors",
    "skip_init",
]
