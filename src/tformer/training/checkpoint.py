"""Training checkpoints: weights, tokenizer and the full trainer state, written atomically (reading a run
directory back, and which of its checkpoints is best, is `tformer.checkpoints`'s).

A run directory looks like::

    runs/en-de/
      train.yaml                     the recipe as run (model + train sections, and lora for a LoRA run)
      metrics.jsonl                  one JSON object per log / eval event
      curves.png                     loss, learning rate and dev BLEU (or perplexity)
      best.json                      {"step", "bleu", "dev_sentences"}: the checkpoint `tformer translate` uses
      checkpoints/step-00000500/     config.yaml, model.safetensors, tokenizer.json, tokenizer_config.json,
                                     trainer_state.pt, sharded/
      (a LoRA run's)                 adapters.safetensors, lora.json, tokenizer files, trainer_state.pt
                                     (with the adapters' optimizer state); see training/lora.py

model.safetensors holds the whole (consolidated) weights for inference, however many ranks trained them.
sharded/ holds the model and optimizer state as written by torch.distributed.checkpoint, one shard per
rank, which a run resumes from on any number of ranks (training/sharded.py). trainer_state.pt holds the
step, data cursor, scheduler and best score: only tensors and plain containers, read with
`torch.load(weights_only=True)`, so nothing is unpickled.

Each checkpoint is first written to `step-XXXXXXXX.tmp/` and renamed into place, so a crash (even kill -9)
never leaves a half-written checkpoint under a real name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from tformer.checkpoints import BEST_FILE, best_checkpoint, checkpoint_dir, list_checkpoints
from tformer.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from tformer.data.tokenizer import Tokenizer
from tformer.files import write_text_atomically
from tformer.models import CheckpointError, TransformerModel, load
from tformer.training.lora import save_weights

STATE_FILE = "trainer_state.pt"


def pending_dir(run_dir: Path, step: int) -> Path:
    """Where `step`'s checkpoint is written before `commit_checkpoint` gives it its real name."""
    final = checkpoint_dir(run_dir, step)
    return final.with_name(final.name + ".tmp")


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """An empty `pending_dir` for `step`'s checkpoint."""
    tmp = pending_dir(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_checkpoint_files(tmp: Path, model: TransformerModel, tokenizer: Any, state: dict) -> None:
    """The consolidated weights (a LoRA model's adapters only), the tokenizer and the trainer `state` (step,
    cursor, scheduler, ...)."""
    save_weights(model, tmp)
    tokenizer.save(tmp)
    torch.save(state, tmp / STATE_FILE)


def commit_checkpoint(tmp: Path) -> Path:
    """Renames a finished temporary checkpoint directory to its real name (replacing an older one)."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_trainer_state(checkpoint: Path) -> dict:
    """The trainer state saved beside the weights, read without unpickling arbitrary objects."""
    try:
        return torch.load(checkpoint / STATE_FILE, weights_only=True)
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"{checkpoint / STATE_FILE}: cannot read trainer state: {err}") from None


def record_best(run_dir: Path, step: int, bleu: float, dev_sentences: int) -> None:
    """Names `step` the best checkpoint: its dev BLEU on the first `dev_sentences` sentences, the set every
    evaluation of the run is compared on."""
    record = {"step": step, "bleu": bleu, "dev_sentences": dev_sentences}
    write_text_atomically(run_dir / BEST_FILE, json.dumps(record) + "\n")


def rewrite_trainer_state(checkpoint: Path, state: dict) -> None:
    """Replaces a committed checkpoint's trainer state atomically (its weights stay): a score learnt after
    the step was saved, such as the final evaluation's new best, then agrees with best.json."""
    tmp = checkpoint / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, checkpoint / STATE_FILE)


def average_checkpoints(paths: list[Path], out: Path) -> Path:
    """Writes the element-wise mean of several checkpoints' weights (same config) to `out`.

    The tokenizer of the first checkpoint goes along, all of it: tokenizer.json and tokenizer_config.json
    (special tokens, `add_bos`, the chat template), so the averaged checkpoint encodes and chats the same.
    """
    if not paths:
        raise CheckpointError("average needs at least one checkpoint")
    models = [load(p) for p in paths]
    if any(m.config != models[0].config for m in models):
        raise CheckpointError(f"cannot average checkpoints with different configs: {', '.join(map(str, paths))}")
    averaged = models[0]
    # every mean is taken before any is written: tied weights are one tensor under several names, and
    # writing into models[0] while averaging would feed an already averaged value into the next name
    states = [m.state_dict() for m in models]
    means = {name: torch.stack([s[name].float() for s in states]).mean(0) for name in states[0]}
    with torch.no_grad():
        for name, param in averaged.state_dict(keep_vars=True).items():
            param.copy_(means[name].to(param.dtype))
    averaged.save(out)
    if (paths[0] / TOKENIZER_FILE).is_file():
        # loaded and saved rather than copied file by file: `save` writes every setting `load` read, also
        # those a Hugging Face style directory keeps in special_tokens_map.json or chat_template.jinja
        Tokenizer.load(paths[0]).save(out)
    return out


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Deletes all but the newest `keep_last` checkpoints, always keeping the best one."""
    best = best_checkpoint(run_dir)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if old != best:
            shutil.rmtree(old)


def drop_records_after(path: Path, step: int) -> None:
    """Rewrites a metrics log without the records past `step` (and a line torn by a kill), atomically.

    A run killed after its last checkpoint has logged steps that the resumed run trains and logs again; without
    this the log and its curves would hold those steps twice.
    """
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    write_text_atomically(path, "".join(line + "\n" for line in kept))
