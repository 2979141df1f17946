"""The one door for weights on disk: what a path holds, and loading it.

A path is one of four things (`kind_of`):
- a GGUF file (llama.cpp's format, read by interop/gguf.py);
- a Hugging Face model directory (config.json and safetensors, read by interop/hf.py);
- a tformer checkpoint directory (config.yaml and model.safetensors);
- a training run's directory (checkpoints/step-*/ inside), which stands for its best checkpoint, else its latest.

A run's checkpoint counts only when it is complete: the trainer writes complete.json into it last, listing its
files and their sizes (training/checkpoint.py). best.json names the best one; when that file is missing, empty,
corrupt or names a checkpoint that is gone, the best is found again from the checkpoints' own trainer states.

`load_pretrained` (serving, generation, conversion), `read_config` (fine-tuning's `train.init_from`, `tformer info`),
`load_engine` and the `Translator` all come through here, so "what does this path hold" has one answer.
The training side writes checkpoints (training/checkpoint.py); this module only reads them.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
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
STATE_FILE = "trainer_state.pt"  # a checkpoint's step, data cursor, scheduler and best score
COMPLETE_FILE = "complete.json"  # written last into a checkpoint: {"step", "files": {relative path: bytes}}

logger = logging.getLogger(__name__)

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
    """The checkpoint directories of a run under their real names, oldest first (the `.tmp` directories of
    interrupted writes and others set aside are skipped); `incomplete_reason` says whether each is whole."""
    root = run_dir / RUN_CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and "." not in p.name)


def incomplete_reason(checkpoint: Path) -> str | None:
    """Why `checkpoint` is not a complete checkpoint (None when it is): no complete.json, or a file it lists is
    missing or has another size. The trainer state is checked by reading it (`read_trainer_state`)."""
    try:
        record = json.loads((checkpoint / COMPLETE_FILE).read_text(encoding="utf-8"))
        files = record["files"]
        sizes = {str(name): int(size) for name, size in files.items()}
    except FileNotFoundError:
        return f"no {COMPLETE_FILE} (its write was cut short, or an older tformer wrote it)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{COMPLETE_FILE} is unreadable ({type(err).__name__}: {err})"
    for name, size in sizes.items():
        file = checkpoint / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {COMPLETE_FILE} says {size}"
    return None


def read_trainer_state(checkpoint: Path) -> dict:
    """A checkpoint's trainer state, read without unpickling arbitrary objects (only tensors and containers)."""
    try:
        state = torch.load(checkpoint / STATE_FILE, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{checkpoint / STATE_FILE}: cannot read trainer state: {err}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{checkpoint / STATE_FILE}: holds a {type(state).__name__}, not a trainer state")
    return state


def recorded_best(run_dir: Path) -> tuple[Path | None, str | None]:
    """(the checkpoint best.json names, None) when it exists and is complete (or predates complete.json); else
    (None, why not). The reason is None when there is no best.json at all (a run that has not evaluated yet)."""
    path = run_dir / BEST_FILE
    if not path.is_file():
        return None, None
    try:
        step = json.loads(path.read_text(encoding="utf-8"))["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step is {step!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{path} is unreadable ({type(err).__name__}: {err})"
    best = checkpoint_dir(run_dir, step)
    if not best.is_dir():
        return None, f"{path} names step {step}, whose checkpoint {best} does not exist"
    # a checkpoint without complete.json at all was written before tformer wrote one: still served as the best
    if (best / COMPLETE_FILE).exists() and (reason := incomplete_reason(best)) is not None:
        return None, f"{path} names {best}, which is incomplete: {reason}"
    return best, None


def best_from_states(run_dir: Path) -> tuple[Path, float] | None:
    """The best checkpoint found from the complete checkpoints' trainer states, and its score: the first one
    whose `best_bleu` (the best score as of its step) is the highest, since a new best is saved at its own step.
    None when no checkpoint was ever scored."""
    best, best_bleu = None, -1.0
    for checkpoint in list_checkpoints(run_dir):
        if incomplete_reason(checkpoint) is not None:
            continue
        try:
            bleu = float(read_trainer_state(checkpoint).get("best_bleu", -1.0))
        except CheckpointError:
            continue
        if bleu > best_bleu:
            best, best_bleu = checkpoint, bleu
    return None if best is None else (best, best_bleu)


def best_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint with the best dev BLEU so far: the one best.json names; when best.json is missing, empty,
    corrupt or names a checkpoint that is gone or incomplete, the one the checkpoints' trainer states say (with
    a logged warning). None when no checkpoint was scored."""
    best, problem = recorded_best(run_dir)
    if best is not None:
        return best
    found = best_from_states(run_dir)
    if found is not None:
        why = problem or f"{run_dir / BEST_FILE} is missing"
        logger.warning("%s; using %s, the best by the checkpoints' trainer states", why, found[0])
        return found[0]
    return None


def newest_complete_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run whose complete.json agrees with its files."""
    return next((c for c in reversed(list_checkpoints(run_dir)) if incomplete_reason(c) is None), None)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or for a run directory its best checkpoint (else its newest complete one,
    else, for a run written before checkpoints had complete.json, its newest)."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return path
    found = best_checkpoint(path) or newest_complete_checkpoint(path) or next(reversed(list_checkpoints(path)), None)
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
