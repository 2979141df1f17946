"""One entry point for serving and generation: any supported model file or directory, with its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tformer.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from tformer.data.tokenizer import Tokenizer
from tformer.interop.gguf import from_gguf, is_gguf, open_gguf
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf
from tformer.interop.hf import from_hf
from tformer.models import CONFIG_FILE, CheckpointError, TransformerModel, load

HF_CONFIG_FILE = "config.json"


def load_pretrained(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[TransformerModel, Tokenizer | None]:
    """(model, tokenizer) from a GGUF file, a tformer checkpoint directory or a Hugging Face directory.

    The weights load in `dtype`, straight from the file: asking for the dtype a model will run in needs no
    float32 copy on the way. The tokenizer is None when a directory has no tokenizer.json (token ids must then be
    given directly).
    """
    path = Path(path)
    if path.is_file():
        if not is_gguf(path):
            raise CheckpointError(f"{path} is not a GGUF file; pass a .gguf file or a model directory")
        reader = open_gguf(path)
        return from_gguf(path, reader, dtype=dtype), tokenizer_from_gguf(path, reader)
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist; pass a .gguf file or a model directory")
    tokenizer = Tokenizer.load(path) if (path / TOKENIZER_FILE).is_file() else None
    if (path / CONFIG_FILE).is_file():
        return load(path, dtype=dtype), tokenizer
    if (path / HF_CONFIG_FILE).is_file():
        return from_hf(path, dtype=dtype), tokenizer
    raise CheckpointError(
        f"{path} holds neither {CONFIG_FILE} (a tformer checkpoint) nor {HF_CONFIG_FILE} (a Hugging Face model); "
        "for a training run, pass one of its checkpoints/step-* directories"
    )
