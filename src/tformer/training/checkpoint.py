"""Training checkpoints: weights, tokenizer and the full trainer state, written atomically (reading a run
directory back, and which of its checkpoints is best, is `tformer.checkpoints`'s).

A run directory looks like::

    runs/en-de/
      train.yaml                     the recipe as run (model + train sections, and lora for a LoRA run)
      metrics.jsonl                  one JSON object per log / eval event
      curves.png                     loss, learning rate and dev BLEU (or perplexity)
      best.json                      {"step", "bleu", "dev_sentences"}: the checkpoint `tformer translate` uses
      train.lock                     held (flock) by the run training here, with its pid
      checkpoints/step-00000500/     config.yaml, model.safetensors, tokenizer.json, tokenizer_config.json,
                                     trainer_state.pt, sharded/, complete.json (written last)
      (a LoRA run's)                 adapters.safetensors, lora.json, tokenizer files, trainer_state.pt
                                     (with the adapters' optimizer state); see training/lora.py

model.safetensors holds the whole (consolidated) weights for inference, however many ranks trained them.
sharded/ holds the model and optimizer state as written by torch.distributed.checkpoint, one shard per
rank, which a run resumes from on any number of ranks (training/sharded.py). trainer_state.pt holds the
step, data cursor, scheduler and best score: only tensors and plain containers, read with
`torch.load(weights_only=True)`, so nothing is unpickled.

Each checkpoint is first written to `step-XXXXXXXX.tmp/`, every file and directory in it flushed to the disk
(fsync), then complete.json written last, and only then renamed into place, so that a crash (even kill -9, or a
power cut) never leaves a half-written checkpoint under a real name. An older checkpoint of the same step is
renamed aside (`.old`) before the new one takes its name and deleted after, so that one of them always exists.
best.json is written only once the checkpoint it names is committed, and checkpoints are pruned after that, so
the best checkpoint is never deleted. docs/training.md lists what a crash at each moment leaves behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import yaml

from tformer.checkpoints import (
    BEST_FILE,
    COMPLETE_FILE,
    RUN_CHECKPOINTS,
    STATE_FILE,
    best_checkpoint,
    checkpoint_dir,
    incomplete_reason,
    list_checkpoints,
    read_trainer_state,
)
from tformer.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from tformer.data.tokenizer import Tokenizer
from tformer.errors import ConfigError
from tformer.files import fsync, fsync_tree, read_mapping, replace_directory, write_text_atomically
from tformer.models import CheckpointError, TransformerModel, load
from tformer.training.config import recipe_changes
from tformer.training.lora import save_weights

try:
    import fcntl
except ImportError:  # not on Windows
    fcntl = None

logger = logging.getLogger(__name__)


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
    """Gives a finished temporary checkpoint directory its real name, durably: its files and directories are
    flushed to the disk, complete.json (the list of its files and their sizes) is written last, and an older
    checkpoint of the same step is renamed aside before the new one takes its name, then deleted."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    fsync_tree(tmp)
    sizes = {
        file.relative_to(tmp).as_posix(): file.stat().st_size
        for file in sorted(tmp.rglob("*"))
        if file.is_file() and file.name != STATE_FILE  # the state may be rewritten in place (rewrite_trainer_state)
    }
    record = {"step": int(final.name.removeprefix("step-")), "files": sizes}
    write_text_atomically(tmp / COMPLETE_FILE, json.dumps(record, indent=1) + "\n")
    replace_directory(tmp, final)
    return final


def recover_checkpoints(run_dir: Path) -> None:
    """Tidies what a crash left in a run's checkpoints/: a checkpoint set aside (`.old`) while a newer copy of its
    step was being renamed in gets its name back when the newer one did not get it, and is deleted otherwise;
    the `.tmp` directories of interrupted writes and the `.deleting` ones of interrupted pruning are deleted. Only
    the run that holds the lock may call it."""
    root = run_dir / RUN_CHECKPOINTS
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if not path.is_dir() or not path.name.startswith("step-"):
            continue
        if path.suffix == ".old":
            final = path.with_suffix("")
            if final.exists():
                shutil.rmtree(path)
            else:
                os.replace(path, final)
                fsync(root)
                logger.warning("%s: put back %s, set aside by a run killed while replacing it", root, final.name)
        elif path.suffix in (".tmp", ".deleting"):
            shutil.rmtree(path)


def load_trainer_state(checkpoint: Path) -> dict:
    """The trainer state saved beside the weights, read without unpickling arbitrary objects."""
    return read_trainer_state(checkpoint)


def newest_valid_checkpoint(run_dir: Path) -> tuple[Path | None, dict | None, list[str]]:
    """(the newest checkpoint that is complete and whose trainer state reads, that state, why each newer one was
    skipped); (None, None, reasons) when no checkpoint is valid."""
    skipped = []
    for checkpoint in reversed(list_checkpoints(run_dir)):
        reason = incomplete_reason(checkpoint)
        if reason is None:
            try:
                return checkpoint, read_trainer_state(checkpoint), skipped
            except CheckpointError as err:
                reason = str(err)
        skipped.append(f"{checkpoint.name} ({reason})")
    return None, None, skipped


def record_best(run_dir: Path, step: int, bleu: float, dev_sentences: int) -> None:
    """Names `step` the best checkpoint: its dev BLEU on the first `dev_sentences` sentences, the set every
    evaluation of the run is compared on. Called once that checkpoint is committed, never before."""
    record = {"step": step, "bleu": bleu, "dev_sentences": dev_sentences}
    write_text_atomically(run_dir / BEST_FILE, json.dumps(record) + "\n")


def rewrite_trainer_state(checkpoint: Path, state: dict) -> None:
    """Replaces a committed checkpoint's trainer state atomically and durably (its weights stay): a score
    learnt after the step was saved, such as the final evaluation's new best, then agrees with best.json."""
    tmp = checkpoint / (STATE_FILE + ".tmp")
    try:
        torch.save(state, tmp)
        fsync(tmp)
        os.replace(tmp, checkpoint / STATE_FILE)
        fsync(checkpoint)
    finally:
        tmp.unlink(missing_ok=True)


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
    """Deletes the checkpoints older than the newest `keep_last` complete ones, always keeping the best one."""
    best = best_checkpoint(run_dir)
    checkpoints = list_checkpoints(run_dir)
    complete = [c for c in checkpoints if incomplete_reason(c) is None]
    if len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last]
    for old in checkpoints:
        if old.name < oldest_kept.name and old != best:
            delete_checkpoint(old)


def delete_checkpoint(checkpoint: Path) -> None:
    """Renames a checkpoint to `.deleting` before deleting it, so that a kill while deleting never leaves part of
    one under its real name (`recover_checkpoints` finishes the job)."""
    doomed = checkpoint.with_name(checkpoint.name + ".deleting")
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed)


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


# ---- the run directory: its lock and its recipe -------------------------------------------------------------------

LOCK_FILE = "train.lock"
RECIPE_FILE = "train.yaml"


class RunLock:
    """An exclusive lock on a run directory for the process that trains there: an flock on train.lock (released by
    the kernel when the process dies, however it dies), which holds that process's pid for the error of a second
    run. Trainers in one process share their process's lock (a test, a notebook); another process is refused."""

    _held: dict[str, list] = {}  # this process's locks: real path of train.lock -> [open file, holders]
    _guard = threading.Lock()

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._key: str | None = os.path.realpath(self.path)
        with self._guard:
            if self._key in self._held:
                self._held[self._key][1] += 1
                return
            file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held open until the last release()
            try:
                if fcntl is not None:  # no flock on this platform: the run goes unguarded
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip() or "unknown"
                file.close()
                self._key = None
                raise CheckpointError(
                    f"{run_dir} is in use by another training run (pid {holder}, which holds {self.path}); wait for "
                    "it to finish or stop it, or set train.out_dir to another directory"
                ) from None
            except OSError as err:  # a file system without locks (some network mounts): train unguarded
                logger.warning("%s: cannot lock (%s); make sure no other run trains in %s", self.path, err, run_dir)
            file.seek(0)
            file.truncate()
            file.write(f"{os.getpid()}\n")
            file.flush()
            self._held[self._key] = [file, 1]

    def release(self) -> None:
        """Lets another run train in the directory once this process's last holder releases it (closing the file
        releases the flock)."""
        with self._guard:
            if self._key is None:
                return
            held = self._held[self._key]
            held[1] -= 1
            if held[1] == 0:
                del self._held[self._key]
                held[0].close()
            self._key = None


def check_recipe(run_dir: Path, recipe: dict, force: bool) -> None:
    """Refuses (ConfigError, with the keys that differ) to train in a run directory whose train.yaml holds another
    recipe than `recipe`, unless `force`: its tokenizer and checkpoints were made by the recipe it holds.
    Changes to the keys in RESUME_MAY_CHANGE (when to stop, evaluate, save and log) are allowed."""
    path = run_dir / RECIPE_FILE
    if not path.is_file():
        return
    changes = recipe_changes(read_mapping(path, CheckpointError, "recipe sections"), recipe)
    if changes and not force:
        raise ConfigError(
            f"{run_dir} holds a run of another recipe ({path}); this one differs in: {'; '.join(changes)}. Resume "
            "it with the recipe it was trained with, set train.out_dir to a new directory, or set train.resume=force "
            "to go on with this recipe anyway (the run's tokenizer and checkpoints stay)"
        )
    if changes:
        logger.warning("%s: resuming with a changed recipe (train.resume: force): %s", run_dir, "; ".join(changes))


def write_recipe(run_dir: Path, recipe: dict) -> None:
    """Writes the recipe as run to train.yaml, atomically."""
    write_text_atomically(run_dir / RECIPE_FILE, yaml.safe_dump(recipe, sort_keys=False))
