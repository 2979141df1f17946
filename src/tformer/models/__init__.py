"""Models built from a ModelConfig: `build_model(config)` returns the family the config names."""

from __future__ import annotations

from tformer.models.base import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, TransformerModel
from tformer.models.build import build_model, load
from tformer.models.families import MODELS, DecoderLM, EncoderDecoder, EncoderMLM
from tformer.models.init import init_weights
from tformer.models.recurrent import LSTMEncoderDecoder, RecurrentCache
from tformer.models.weights import assign_weights, meta_tensors, skip_init

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
