"""Models built from a ModelConfig: `build_model(config)` returns the family the config names."""

from __future__ import annotations

from tformer.config import ModelConfig
from tformer.models.base import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, TransformerModel, load
from tformer.models.families import MODELS, DecoderLM, EncoderDecoder, EncoderMLM
from tformer.models.init import init_weights


def build_model(config: ModelConfig) -> TransformerModel:
    """Builds and initializes the model for `config` (on torch's current default device)."""
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
    "MODELS",
    "TransformerModel",
    "build_model",
    "init_weights",
    "load",
]
