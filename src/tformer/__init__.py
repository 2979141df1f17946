"""tformer: every Transformer family from one config, trained and served in readable PyTorch.

The public names load on first use (PEP 562), so `import tformer` and `tformer info` do not pay for torch, the
engine or the interop readers until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tformer.config import ModelConfig
from tformer.errors import CheckpointError, ConfigError, DataError, RequestError, TformerError

if TYPE_CHECKING:
    from tformer.checkpoints import load_pretrained
    from tformer.engine import Engine, EngineConfig, SamplingParams
    from tformer.interop import from_gguf, from_hf, to_hf, tokenizer_from_gguf
    from tformer.models import TransformerModel, build_model, load

__version__ = "0.1.0"

# public name -> the module that defines it, imported when the name is first used
LAZY_NAMES: dict[str, str] = {
    "Engine": "tformer.engine",
    "EngineConfig": "tformer.engine",
    "SamplingParams": "tformer.engine",
    "from_gguf": "tformer.interop",
    "from_hf": "tformer.interop",
    "load_pretrained": "tformer.checkpoints",
    "to_hf": "tformer.interop",
    "tokenizer_from_gguf": "tformer.interop",
    "TransformerModel": "tformer.models",
    "build_model": "tformer.models",
    "load": "tformer.models",
}


def __getattr__(name: str) -> Any:
    if name not in LAZY_NAMES:
        raise AttributeError(f"module 'tformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *LAZY_NAMES])


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "RequestError",
    "SamplingParams",
    "TformerError",
    "TransformerModel",
    "build_model",
    "from_gguf",
    "from_hf",
    "load",
    "load_pretrained",
    "to_hf",
    "tokenizer_from_gguf",
]
