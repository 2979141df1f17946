"""TrainConfig: the `train:` section of a recipe (data, optimizer, schedule, checkpoints, evaluation)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import yaml

from tformer.config import ConfigBase, ConfigError, ModelConfig
from tformer.data.genre import GENRE_CORPUS, GENRES
from tformer.training.lora import LoRAConfig

OPTIMIZERS = ("adam-noam", "adamw-cosine")
OBJECTIVE_FAMILIES = {  # the model family each objective trains
    "seq2seq": "encoder-decoder",
    "span_corruption": "encoder-decoder",
    "denoising": "encoder-decoder",
    "clm": "decoder",
    "prefix_lm": "decoder",
    "mlm": "encoder",
    "classification": "encoder",  # one class per sequence, with encoder_head sequence-classification
}
OBJECTIVE_NAMES = tuple(OBJECTIVE_FAMILIES)
# families outside OBJECTIVE_FAMILIES: the objectives each trains with
OTHER_FAMILY_OBJECTIVES = {
    "ssm": ("clm",),
    "lstm-encoder-decoder": ("seq2seq",),
    "conv-encoder-decoder": ("seq2seq",),
}
PARALLEL_STRATEGIES = ("auto", "ddp", "fsdp", "tp", "fsdp+tp")  # how several processes share the work
FSDP_SHARDINGS = ("full", "grad-op")  # ZeRO-3 / ZeRO-2
FSDP_DTYPES = ("float32", "bfloat16")
LOG_SINKS = ("jsonl", "tensorboard")  # where metrics go (training/sinks.py)
RESUME_MODES = ("check", "force")  # check: resume only with the recipe the run's checkpoints were trained with
# what a resumed run may change without train.resume: force: when it stops, evaluates, saves and logs, and how it is
# spread over processes (the sharded state re-slices to any layout); never what it learns from or how
RESUME_MAY_CHANGE = frozenset(
    {
        "train.max_steps",
        "train.time_budget",
        "train.eval_every",
        "train.save_every",
        "train.keep_last",
        "train.log_every",
        "train.log_to",
        "train.histogram_every",
        "train.beam_size",
        "train.length_penalty",
        "train.out_dir",
        "train.resume",
        "train.parallel",
        "train.fsdp_sharding",
        "train.tp_size",
        "train.dist_timeout",
        "train.device",
        "model.activation_checkpointing",
    }
)


@dataclass
class TrainConfig(ConfigBase):
    """How to train: the defaults are the 2017 recipe, sized to finish on a laptop CPU in about ten minutes."""

    section = "train"

    # data: 'bible:en-de' / 'bible:en-fr' (the embedded corpus, split by book), or a TSV / JSONL / text file
    corpus: str = "bible:en-de"
    corpus_tgt: str | None = None  # target side when `corpus` is the source side of two aligned files
    dev_corpus: str | None = None  # user data: dev file (TSV/JSONL); the embedded corpus has its own split
    objective: str = "seq2seq"
    vocab_size: int = 8000
    max_len: int = 128  # examples with more tokens on either side are skipped
    max_tokens: int = 4096  # token budget per batch (fairseq --max-tokens)
    grad_accum: int = 1
    pack: bool = False  # clm: train on blocks of max_len tokens of the concatenated corpus (data/packing.py)
    # a directory that `tformer prepare` wrote from `corpus`: train from its memory-mapped shards (data/shards.py)
    prepared: str | None = None

    # optimization
    optimizer: str = "adam-noam"
    lr: float = 1.0  # adam-noam: scale on d^-0.5 * min(t^-0.5, t * warmup^-1.5); adamw-cosine: the peak
    warmup: int = 4000
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_grad: float = 0.0  # max gradient norm; 0 disables clipping
    bf16: bool = False  # bf16 autocast
    bf16_weights: bool = False  # with bf16: train a bf16 copy, fp32 master weights (training/precision.py)
    # "fp32", "bf16" (the same as bf16: true) or "fp16": float16 autocast with dynamic loss scaling (GradScaler)
    precision: str = "fp32"
    fp16_loss_scaling: bool = True  # fp16: scale the loss (false shows its small gradients underflow to zero)
    fp16_initial_scale: float = 65536.0  # fp16: the first loss scale; it halves on overflow, doubles after 2000 steps
    device: str = "cpu"  # cpu, cuda or cuda:N (under torchrun rank r takes cuda:r); `tformer train --device` wins
    max_steps: int = 100_000
    time_budget: float = 0.0  # seconds of training before stopping cleanly; 0 means no limit
    seed: int = 1
    # fine-tuning: a tformer checkpoint directory, a Hugging Face model directory or a GGUF file to start from;
    # the model config and the tokenizer then come with the weights (training/init_from.py)
    init_from: str | None = None
    # LoRA: the recipe's `lora:` section (rank, alpha, dropout, target_modules; training/lora.py), or None
    lora: dict | None = None

    # evaluation, logging and checkpoints
    out_dir: str = "runs/en-de"
    eval_every: int = 1000
    eval_sentences: int = 200  # dev sentences decoded for BLEU during training (all of them at the end)
    beam_size: int = 4
    length_penalty: float = 0.6  # GNMT's alpha, as in the paper
    save_every: int = 500
    keep_last: int = 3
    log_every: int = 20
    # metrics.jsonl and/or TensorBoard event files in out_dir/tensorboard/ (training/sinks.py; `pip install
    # 'tformer[tensorboard]'`); histogram_every: every N steps (a multiple of log_every) TensorBoard also gets each
    # parameter's and gradient's histogram; 0: never
    log_to: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])
    histogram_every: int = 0
    # an out_dir that already holds a run resumes it; with a recipe other than the one in its train.yaml (beyond
    # RESUME_MAY_CHANGE) that is refused, unless resume is 'force' (the run's tokenizer and checkpoints stay)
    resume: str = "check"

    # several processes, launched with torchrun (training/distributed.py; ignored when training alone)
    parallel: str = "auto"  # auto (= ddp on several processes), ddp, fsdp, tp or fsdp+tp
    fsdp_sharding: str = "full"  # full: ZeRO-3, parameters resharded after forward; grad-op: ZeRO-2, kept
    fsdp_param_dtype: str = "float32"  # FSDP mixed precision: dtype of the gathered parameters in compute
    fsdp_reduce_dtype: str = "float32"  # FSDP mixed precision: dtype of the gradient reduce-scatter
    tp_size: int = 0  # ranks per tensor-parallel group under fsdp+tp (tp alone uses them all)
    dist_timeout: float = 600.0  # seconds a collective waits for the other ranks before failing
    context_parallel: int = 1  # ranks each sequence is split over (ring attention; training/context_parallel.py)

    def __post_init__(self) -> None:
        self._check_types()
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer '{self.optimizer}'; choose one of: {', '.join(OPTIMIZERS)}")
        if self.objective not in OBJECTIVE_NAMES:
            raise ConfigError(f"unknown objective '{self.objective}'; choose one of: {', '.join(OBJECTIVE_NAMES)}")
        for name in (
            "vocab_size",
            "max_len",
            "max_tokens",
            "grad_accum",
            "max_steps",
            "eval_every",
            "save_every",
            "keep_last",
            "log_every",
            "beam_size",
            "warmup",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.max_tokens < self.max_len + 1:
            raise ConfigError(f"max_tokens ({self.max_tokens}) must hold one example of max_len ({self.max_len}) + 1")
        for name, allowed in (
            ("parallel", PARALLEL_STRATEGIES),
            ("fsdp_sharding", FSDP_SHARDINGS),
            ("fsdp_param_dtype", FSDP_DTYPES),
            ("fsdp_reduce_dtype", FSDP_DTYPES),
            ("resume", RESUME_MODES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown {name} '{getattr(self, name)}'; choose one of: {', '.join(allowed)}")
        if self.tp_size < 0:
            raise ConfigError(f"tp_size must be 0 (all ranks) or a positive group size, got {self.tp_size}")
        if self.context_parallel < 1 or (self.context_parallel > 1 and self.parallel not in ("auto", "ddp")):
            raise ConfigError(
                f"context_parallel must be 1 (off) or a number of ranks that replicate the model as DDP does "
                f"(parallel auto or ddp); got {self.context_parallel} with parallel '{self.parallel}'"
            )
        if not (math.isfinite(self.dist_timeout) and self.dist_timeout > 0):
            raise ConfigError(f"dist_timeout must be a positive number of seconds, got {self.dist_timeout}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a positive finite number, got {self.lr}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"train.precision must be 'fp32', 'bf16' or 'fp16', got '{self.precision}'")
        if self.precision == "fp16" and (self.bf16 or self.bf16_weights):
            raise ConfigError(
                "train.precision fp16 trains in float16, so train.bf16 / bf16_weights cannot apply; remove them"
            )
        if not (math.isfinite(self.fp16_initial_scale) and self.fp16_initial_scale > 0):
            raise ConfigError(f"train.fp16_initial_scale must be a positive number, got {self.fp16_initial_scale}")
        if self.bf16_weights and not self.bf16:
            raise ConfigError("train.bf16_weights is a bf16 mode: set train.bf16: true too, or remove bf16_weights")
        if self.pack and self.objective != "clm":
            raise ConfigError(f"train.pack packs text for the clm objective, not '{self.objective}'; remove train.pack")
        self._check_log_to()
        if self.lora is not None:
            self._check_lora()

    def _check_log_to(self) -> None:
        for name in self.log_to:
            if name not in LOG_SINKS:
                raise ConfigError(
                    f"unknown train.log_to sink {name!r}; choose from: {', '.join(LOG_SINKS)} "
                    f"(e.g. log_to: [jsonl, tensorboard])"
                )
        if not self.log_to or len(set(self.log_to)) != len(self.log_to):
            raise ConfigError(f"train.log_to must name each sink once, and at least one; got {self.log_to}")
        if self.histogram_every < 0:
            raise ConfigError(f"train.histogram_every must be 0 (off) or a number of steps, got {self.histogram_every}")
        if self.histogram_every and "tensorboard" not in self.log_to:
            raise ConfigError("train.histogram_every writes TensorBoard histograms; add tensorboard to train.log_to")
        if self.histogram_every % self.log_every:
            raise ConfigError(
                f"train.histogram_every ({self.histogram_every}) must be a multiple of train.log_every "
                f"({self.log_every}): histograms are written with the logged steps"
            )

    def _check_lora(self) -> None:
        self.lora = LoRAConfig.from_dict(self.lora).to_dict()  # validated, with the defaults written out
        if not self.init_from:
            raise ConfigError("a lora: section fine-tunes pretrained weights; set train.init_from to them")
        if self.parallel != "auto":
            raise ConfigError(
                f"LoRA trains in one process only: train.parallel '{self.parallel}' (ddp, FSDP, tensor parallel) "
                "is not supported with a lora: section; remove train.parallel and run without torchrun"
            )

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The LoRA options of this run, or None for a full fine-tune or training from scratch."""
        return LoRAConfig.from_dict(self.lora) if self.lora is not None else None

    def recipe(self, model: ModelConfig) -> dict:
        """The recipe this run is (model, train and, for LoRA, lora sections), as `tformer train` reads it."""
        train = self.to_dict()
        lora = train.pop("lora")
        return {"model": model.to_dict(), "train": train, **({"lora": lora} if lora is not None else {})}


def recipe_changes(saved: dict, recipe: dict) -> list[str]:
    """The keys in which `recipe` differs from a `saved` one (both as `TrainConfig.recipe` writes them), as
    'section.key: old -> new', leaving out RESUME_MAY_CHANGE. A key that only one of them has (a field added to or
    removed from tformer since) counts only when its value is not the field's default."""
    saved, recipe = yaml.safe_load(yaml.safe_dump(saved)), yaml.safe_load(yaml.safe_dump(recipe))  # plain values
    changes = []
    if ("lora" in saved) != ("lora" in recipe):
        changes.append(f"lora: {_shown(saved.get('lora', NOT_SET))} -> {_shown(recipe.get('lora', NOT_SET))}")
    defaults = {"model": _defaults(ModelConfig), "train": _defaults(TrainConfig), "lora": {}}
    for section in ("model", "train", "lora") if not changes else ("model", "train"):
        old, new = saved.get(section) or {}, recipe.get(section) or {}
        for key in [*old, *(k for k in new if k not in old)]:
            before, after = old.get(key, NOT_SET), new.get(key, NOT_SET)
            if f"{section}.{key}" in RESUME_MAY_CHANGE or before == after:
                continue
            only = after if before is NOT_SET else before if after is NOT_SET else NOT_SET
            if only is not NOT_SET and key in defaults[section] and only == defaults[section][key]:
                continue
            changes.append(f"{section}.{key}: {_shown(before)} -> {_shown(after)}")
    return changes


NOT_SET = object()


def _defaults(config: type) -> dict[str, Any]:
    defaults = {}
    for field in dataclasses.fields(config):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    return yaml.safe_load(yaml.safe_dump(defaults))


def _shown(value: Any) -> str:
    return "(not set)" if value is NOT_SET else repr(value)


def check_objective(model: ModelConfig, train: TrainConfig) -> None:
    """Raises ConfigError when `train.objective` cannot train `model` (wrong family, or MLM without its head)."""
    needed = OBJECTIVE_FAMILIES[train.objective]
    if train.objective in OTHER_FAMILY_OBJECTIVES.get(model.family, ()):
        return
    if model.family != needed and train.init_from:
        fits = [name for name, family in OBJECTIVE_FAMILIES.items() if family == model.family]
        raise ConfigError(
            f"objective '{train.objective}' trains a '{needed}' model, but the weights in {train.init_from} are a "
            f"'{model.family}'; set train.objective to one of: {', '.join(fits)}"
        )
    if model.family != needed:
        raise ConfigError(
            f"objective '{train.objective}' trains a '{needed}' model, but the model's family is "
            f"'{model.family}'; change model.family (or pick a preset of that family)"
        )
    if train.objective == "mlm" and model.encoder_head != "mlm":
        raise ConfigError("objective 'mlm' needs the MLM head; set model.encoder_head: mlm")
    if train.objective == "classification":
        _check_classifier(model, train)


def _check_classifier(model: ModelConfig, train: TrainConfig) -> None:
    if model.encoder_head != "sequence-classification":
        raise ConfigError(
            "objective 'classification' needs a sequence-classification head; set model.encoder_head: "
            "sequence-classification and model.num_labels to the number of classes"
        )
    if train.corpus == GENRE_CORPUS and model.num_labels != len(GENRES):
        raise ConfigError(
            f"corpus {GENRE_CORPUS} has {len(GENRES)} classes ({', '.join(GENRES)}), but model.num_labels is "
            f"{model.num_labels}; set model.num_labels: {len(GENRES)}"
        )
