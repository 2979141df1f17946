"""tformer: every Transformer family from one config, trained and served in readable PyTorch."""

from tformer.config import ConfigError, ModelConfig
from tformer.inference import Engine, EngineConfig, RequestError, SamplingParams
from tformer.interop import from_gguf, from_hf, load_pretrained, to_hf, tokenizer_from_gguf
from tformer.models import CheckpointError, TransformerModel, build_model, load

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "RequestError",
    "SamplingParams",
    "TransformerModel",
    "build_model",
    "from_gguf",
    "from_hf",
    "load",
    "load_pretrained",
    "to_hf",
    "tokenizer_from_gguf",
]
