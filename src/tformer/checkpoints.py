"""The one door for weights on disk: what a path holds, and loading it.

A path is one of four things (`kind_of`):
- a GGUF file (llama.cpp's format, read by interop/gguf.py);
- a Hugging Face model directory (config.json and safetensors, read by interop/hf.py);
- a tformer checkpoint directory (config.yaml and model.safetensors);
- a training run's directory (checkpoints/step-*/ inside), which stands for its best checkpoint, else its latest.

`load_pretrained` (serving, generation, conversion), `read_config` (fine-tuning's `train.init_from`, `tformer info`),
`load_engine` and the `Translator` all come through here, so "what does this path hold" has one answer.
The training side writes checkpoints (training/checkpoint.py); this module only reads them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import torch

from tformer.config import ModelConfig
from tformer.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from tformer.data.tokenizer import Tokenizer
from tformer.errors import CheckpointError, ConfigError
from tformer.interop.gguf import config_from_gguf, from_gguf, is_gguf, open_gguf
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf
from tformer.interop.hf import config_from_hf, family_of, from_hf, read_hf_config
from tformer.models import CONFIG_FILE, WEIGHTS_FILE, TransformerModel, load

HF_CONFIG_FILE = "config.json"
BEST_FILE = "best.json"
RUN_CHECKPOINTS = "checkpoints"

Kind = Literal["gguf", "hf", "tformer", "run"]


def kind_of(path: str | os.PathLike[str]) -> Kind:
    """What `path` holds; a CheckpointError that says what to pass instead when it is none of the four."""
    path = Path(path)
    if path.is_file():
        if not is_gguf(path):
            raise CheckpointError(f"{path} is not a GGUF file; pass a .gguf file or a model directory")
        return "gguf"
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist; pass a .gguf file or a model directory")
    if (path / CONFIG_FILE).is_file():
        return "tformer"
    if (path / HF_CONFIG_FILE).is_file():
        return "hf"
    if (path / RUN_CHECKPOINTS).is_dir():
        return "run"
    raise CheckpointError(
        f"{path} holds neither {CONFIG_FILE} (a tformer checkpoint) nor {HF_CONFIG_FILE} (a Hugging Face model) "
        f"nor {RUN_CHECKPOINTS}/ (a training run); pass one of those or a .gguf file"
    )


# ---- run directories ------------------------------------------------------------------------------------------


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / RUN_CHECKPOINTS / f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories of interrupted writes are skipped)."""
    root = run_dir / RUN_CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and "." not in p.name)


def best_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint with the best dev BLEU so far, if one was recorded and still exists."""
    path = run_dir / BEST_FILE
    if not path.is_file():
        return None
    best = checkpoint_dir(run_dir, json.loads(path.read_text())["step"])
    return best if best.is_dir() else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or for a run directory its best checkpoint (else its latest)."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return path
    found = best_checkpoint(path) or next(reversed(list_checkpoints(path)), None)
    if found is None:
        raise CheckpointError(
            f"{path} is neither a checkpoint (no {WEIGHTS_FILE}) nor a run directory with {RUN_CHECKPOINTS}/; "
            f"pass the out_dir of a training run or one of its {RUN_CHECKPOINTS}/step-* directories"
        )
    return found


def is_run_directory(path: str | os.PathLike[str]) -> bool:
    """A training run's directory (checkpoints/ inside), rather than a model directory (a config file inside)."""
    path = Path(path)
    has_config = any((path / name).is_file() for name in (CONFIG_FILE, HF_CONFIG_FILE))
    return path.is_dir() and (path / RUN_CHECKPOINTS).is_dir() and not has_config


# ---- loading --------------------------------------------------------------------------------------------------


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of the weights at `path`, read from their config or metadata alone (no tensors)."""
    path = Path(path)
    kind = kind_of(path)
    if kind == "gguf":
        return config_from_gguf(open_gguf(path), path)
    if kind == "run":
        return read_config(resolve_checkpoint(path))
    if kind == "tformer":
        return ModelConfig.from_file(path / CONFIG_FILE)
    hf_config = read_hf_config(path)
    return config_from_hf(family_of(hf_config, path / HF_CONFIG_FILE), hf_config, path / HF_CONFIG_FILE)


def load_pretrained(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[TransformerModel, Tokenizer | None]:
    """(model, tokenizer) from a GGUF file, a tformer checkpoint, a Hugging Face directory or a run directory.

    The weights load in `dtype`, straight from the file: asking for the dtype a model will run in needs no
    float32 copy on the way. The tokenizer is None when a directory has no tokenizer.json (token ids must then be
    given directly).
    """
    path = Path(path)
    kind = kind_of(path)
    if kind == "gguf":
        reader = open_gguf(path)
        return from_gguf(path, reader, dtype=dtype), tokenizer_from_gguf(path, reader)
    if kind == "run":
        return load_pretrained(resolve_checkpoint(path), dtype)
    tokenizer = Tokenizer.load(path) if (path / TOKENIZER_FILE).is_file() else None
    if kind == "tformer":
        return load(path, dtype=dtype), tokenizer
    return from_hf(path, dtype=dtype), tokenizer


def load_translation_model(path: str | os.PathLike[str]) -> tuple[TransformerModel, Tokenizer]:
    """An encoder-decoder and its tokenizer from a checkpoint or run directory, for translation."""
    model, tokenizer = load_pretrained(path)
    if not model.config.is_seq2seq:
        raise ConfigError(f"{path} holds a '{model.config.family}' model; translation needs an encoder-decoder")
    if tokenizer is None:
        raise CheckpointError(
            f"{path} has no tokenizer.json: translation needs the tokenizer the model was trained with"
        )
    return model, tokenizer
