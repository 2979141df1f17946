"""Training memory per rank, predicted before a run: will it fit? (`tformer estimate`)

The estimate has five parts:
- weights, gradients and optimizer state: bytes per parameter for the precision (and the ZeRO stage);
- activations: the tensors tformer's layers save for backward (activations_per_token in training/memory.py),
  proportional to the batch's tokens, with the attention scores of the math path proportional to tokens x length;
- temporaries: what lives only for a moment, such as the loss's (tokens, vocabulary) buffers in backward,
  autocast's bf16 copies of the weights and the gathered weights of a ZeRO-3 shard.

The peak is not the sum of the five: gradients fill in as backward frees the activations. It is the larger of the
moment backward starts (weights, optimizer state, activations, temporaries) and the moment the optimizer steps
(weights, optimizer state, all gradients, and the logits, which the trainer holds until the step ends).
docs/estimate.md has the formulas and their validation against measured peaks
(benchmarks/estimate_validation.py); `tformer.training.memory` measures a step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tformer.config import ModelConfig, read_config_file
from tformer.errors import ConfigError
from tformer.info import format_bytes
from tformer.layers import Block
from tformer.models import build_model
from tformer.training.config import OBJECTIVE_FAMILIES, TrainConfig
from tformer.training.lora import LoRAConfig, LoRALinear, apply_lora
from tformer.training.memory import (
    PRECISIONS,
    Precision,
    activations_per_token,
    backward_temporaries,
    head_terms,
)

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "adam-noam": 2, "adamw-cosine": 2, "sgd": 0, "sgd-momentum": 1}
ZERO_STAGES = {0: "none (DDP or one process)", 1: "optimizer state sharded", 2: "+ gradients", 3: "+ weights"}
FSDP_STAGES = {"full": 3, "grad-op": 2}  # train.fsdp_sharding -> ZeRO stage
DEVICES = ("cpu", "cuda")


@dataclass
class MemoryEstimate:
    """Predicted bytes per rank. `total` is the peak, the larger of two moments (see the module docstring)."""

    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    backward_start: int  # activations + temporaries: the moment backward starts
    step: int  # all gradients and the logits, which the trainer holds until the step ends
    n_params: int
    batch_tokens: int
    seq_len: int
    dtype: str
    checkpointing: bool
    stage: int
    world_size: int
    optimizer: str
    trainable: int  # parameters that train: all of them, or only LoRA's adapters

    @property
    def total(self) -> int:
        return self.weights + self.optimizer_state + max(self.backward_start, self.step)

    @property
    def model_states(self) -> int:
        """Weights, gradients and optimizer state: ZeRO's 'model states' (16 bytes per parameter in mixed Adam)."""
        return self.weights + self.gradients + self.optimizer_state


@dataclass
class _Counts:
    n_params: int
    trainable: int  # parameters that train (LoRA: only the adapters)
    tensors: int  # parameter tensors that train (one Adam step counter each)
    buffers: int  # bytes of registered buffers in fp32 (sinusoidal tables, RoPE frequencies)
    linear: int  # weights of nn.Linear modules, which autocast casts to bf16 (a tied head counts its table)
    head_weight: int  # the output projection's weight
    block: int  # parameters of the largest block: what ZeRO-3 gathers at once
    root: int  # parameters outside the blocks (embeddings, final norm, head), kept gathered by FSDP's root
    adapter_ranks: int  # LoRA: the sum of the adapted layers' ranks, the width each token saves for backward


def _counts(config: ModelConfig, lora: LoRAConfig | None = None) -> _Counts:
    with torch.device("meta"):
        model = build_model(config, initialize=False)
        if lora is not None:
            apply_lora(model, lora)
    params = {id(p): p for p in model.parameters()}
    adapted = [m for m in model.modules() if isinstance(m, LoRALinear)]
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, LoRALinear))]
    head = model.mlm_head if config.family == "encoder" else model.lm_head
    head = getattr(head, "lm_head", head)  # the MLM head ends in the vocabulary projection
    return _Counts(
        n_params=sum(p.numel() for p in params.values()),
        trainable=sum(p.numel() for p in params.values() if p.requires_grad),
        tensors=sum(p.requires_grad for p in params.values()),
        buffers=sum(b.numel() * 4 for b in model.buffers() if b.is_floating_point()),
        linear=sum(m.weight.numel() for m in linears),
        head_weight=head.weight.numel() if isinstance(head, nn.Linear) else 0,
        block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        root=sum(p.numel() for i, p in params.items() if i not in in_blocks),
        adapter_ranks=sum(m.config.rank for m in adapted),
    )


def _check(
    config: ModelConfig,
    batch_tokens: int,
    seq_len: int,
    dtype: str,
    stage: int,
    world_size: int,
    optimizer: str,
    device: str,
) -> None:
    choices = {"dtype": (dtype, PRECISIONS), "optimizer": (optimizer, OPTIMIZER_STATES), "device": (device, DEVICES)}
    for name, (value, known) in choices.items():
        if value not in known:
            raise ConfigError(f"unknown {name} '{value}'; choose one of: {', '.join(known)}")
    if stage not in ZERO_STAGES:
        raise ConfigError(
            f"ZeRO stage must be 0, 1, 2 or 3, got {stage}; use 0 for DDP or one process, 2 for FSDP grad-op "
            f"(ZeRO-2) and 3 for FSDP full sharding (ZeRO-3)"
        )
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1 (data-parallel ranks; 1 for one process), got {world_size}")
    if seq_len < 1 or batch_tokens < seq_len:
        raise ConfigError(
            f"batch tokens ({batch_tokens}) must hold at least one sequence of seq_len ({seq_len}) tokens, "
            f"and seq_len must be at least 1; raise batch tokens or lower seq_len"
        )
    if config.position in ("learned", "sinusoidal") and seq_len > config.max_seq_len:
        raise ConfigError(
            f"seq_len ({seq_len}) is longer than the model's {config.position} position table "
            f"(max_seq_len {config.max_seq_len}); lower seq_len or raise model.max_seq_len"
        )


def _model_states(n: _Counts, p: Precision, optimizer: str, stage: int, world_size: int) -> tuple[int, int, int]:
    """Weights (and buffers), gradients and optimizer state (with Adam's step counters) per rank."""
    shard = {part: world_size if stage >= first else 1 for part, first in (("w", 3), ("g", 2), ("s", 1))}
    weights = n.n_params * p.weight // shard["w"] + n.buffers * p.weight // 4
    gradients = n.trainable * p.weight // shard["g"]
    n_states = OPTIMIZER_STATES[optimizer]
    states = n.trainable * (p.master + n_states * p.state) + (4 * n.tensors if n_states else 0)
    return weights, gradients, states // shard["s"]


def estimate_memory(
    config: ModelConfig,
    batch_tokens: int,
    seq_len: int,
    dtype: str = "fp32",
    checkpointing: bool | None = None,
    stage: int = 0,
    world_size: int = 1,
    optimizer: str = "adam",
    device: str = "cpu",
    lora: LoRAConfig | None = None,
) -> MemoryEstimate:
    """Predicts the peak training memory of one rank for `config`.

    batch_tokens: tokens of one micro-batch on one rank (train.max_tokens); an encoder-decoder holds this many
    on each side. seq_len: padded length of its sequences. dtype: one of PRECISIONS. checkpointing: activation
    checkpointing per block (None: the config's activation_checkpointing). stage: ZeRO stage over `world_size`
    data-parallel ranks. device: "cpu" or "cuda", where bf16 attention over short sequences differs. lora: train
    only these LoRA adapters (the recipe's `lora:` section): gradients and optimizer state shrink to the adapters',
    and each token also saves every adapter's rank-wide hidden vector.
    """
    _check(config, batch_tokens, seq_len, dtype, stage, world_size, optimizer, device)
    checkpointing = config.activation_checkpointing if checkpointing is None else checkpointing
    config = dataclasses.replace(config, activation_checkpointing=checkpointing)
    p, n, tokens = PRECISIONS[dtype], _counts(config, lora), batch_tokens
    weights, gradients, states = _model_states(n, p, optimizer, stage, world_size)
    adapted = None if lora is None else frozenset(t.rpartition(".")[2] for t in lora.target_modules)
    per_token, largest_block = activations_per_token(config, seq_len, p, device, adapted)
    head_trains = lora is None
    head = head_terms(config, p, head_trains)
    activations = round(tokens * (per_token + head.saved + n.adapter_ranks * p.compute))
    # a block's backward, after the loss's has freed the log-probabilities; with checkpointing it recomputes first
    head_gradient = n.head_weight * p.weight // (world_size if stage >= 2 else 1) if head_trains else 0
    block = tokens * (backward_temporaries(config, seq_len, p, device) - head.log_probs) + head_gradient
    block += tokens * largest_block if checkpointing else 0
    temporaries = round(max(tokens * head.loss_buffers, block))
    if p.autocast:  # bf16 copies of the weights, saved for backward by each linear layer
        temporaries += 2 * (n.head_weight if checkpointing else n.linear)
    if stage >= 3 and world_size > 1:  # FSDP keeps the root gathered and gathers a block (and prefetches one)
        temporaries += (n.root + 2 * n.block) * p.weight
    buckets = gradients if stage == 0 and world_size > 1 else 0  # DDP's buckets: a second copy of the gradients
    return MemoryEstimate(
        weights=weights,
        gradients=gradients,
        optimizer_state=states,
        activations=activations,
        temporaries=temporaries + buckets,
        backward_start=activations + temporaries + buckets,
        step=gradients + buckets + round(tokens * head.logits),
        n_params=n.n_params,
        batch_tokens=batch_tokens,
        seq_len=seq_len,
        dtype=dtype,
        checkpointing=checkpointing,
        stage=stage,
        world_size=world_size,
        optimizer=optimizer,
        trainable=n.trainable,
    )


def format_estimate(name: str, config: ModelConfig, estimate: MemoryEstimate) -> str:
    """The human-readable report printed by `tformer estimate`, in the layout of `tformer info`."""
    e = estimate
    sharding = ZERO_STAGES[e.stage] + (f" over {e.world_size} ranks" if e.world_size > 1 else "")
    moment = "backward starts" if e.backward_start >= e.step else "the optimizer steps"
    per_param = e.model_states / e.n_params
    adapters = f"; LoRA trains {e.trainable:,} of them" if e.trainable < e.n_params else ""
    lines = [
        f"model            {name} ({config.family}, d_model={config.d_model}, {e.n_params:,} parameters{adapters})",
        f"batch            {e.batch_tokens:,} tokens per rank in sequences of {e.seq_len:,}; {e.dtype}, "
        f"{e.optimizer}, checkpointing {'on' if e.checkpointing else 'off'}",
        f"sharding         ZeRO stage {e.stage}: {sharding}",
        f"weights          {format_bytes(e.weights)}",
        f"gradients        {format_bytes(e.gradients)}",
        f"optimizer state  {format_bytes(e.optimizer_state)}",
        f"                 = {per_param:.1f} bytes per parameter for weights, gradients and optimizer state"
        + (" on this rank" if e.stage and e.world_size > 1 else ""),
        f"activations      {format_bytes(e.activations)} saved for backward",
        f"temporaries      {format_bytes(e.temporaries)} at most at once (loss buffers, casts, gathers)",
        f"peak per rank    {format_bytes(e.total)} when {moment}",
        "                 = weights + optimizer state + max(activations + temporaries, gradients + logits)",
    ]
    return "\n".join(lines)


def recipe_inputs(model: ModelConfig, train: TrainConfig) -> tuple[ModelConfig, dict[str, Any]]:
    """The model as the trainer builds it (with the recipe's vocabulary) and estimate_memory's arguments.

    The batch is the recipe's token budget filled with sequences of the longest length it admits, the worst case.
    """
    # the trainer takes the vocabulary (and padding id) from the tokenizer the recipe trains, unless the model and
    # its tokenizer come from pretrained weights (train.init_from)
    if not train.init_from:
        model = dataclasses.replace(model, vocab_size=train.vocab_size, tgt_vocab_size=None, pad_token_id=0)
    extra = 1 if OBJECTIVE_FAMILIES[train.objective] == "encoder-decoder" else 2  # </s>, or <s> and </s>
    sharded = train.parallel in ("fsdp", "fsdp+tp")
    return model, {
        "batch_tokens": train.max_tokens,
        "seq_len": min(train.max_len + extra, train.max_tokens),
        "dtype": "bf16-autocast" if train.bf16 else "fp32",
        "optimizer": train.optimizer,
        "stage": FSDP_STAGES[train.fsdp_sharding] if sharded else 0,
        "lora": train.lora_config,
    }


def load_inputs(source: str, overrides: list[str] = ()) -> tuple[ModelConfig, dict[str, Any]]:
    """A model and estimate_memory's arguments from a recipe (with `section.key=value` overrides), or a model
    config file or preset name, for which only seq_len is known: the model's max_seq_len."""
    from tformer.training import load_recipe  # the recipe reader lives beside the trainer

    path = Path(source)
    if path.is_file() and set(read_config_file(path)) & {"model", "train"}:
        return recipe_inputs(*load_recipe(path, overrides))
    if overrides:
        raise ConfigError(f"overrides ({' '.join(overrides)}) apply to a recipe; {source} is not one")
    config = ModelConfig.from_file(path) if path.is_file() else ModelConfig.from_preset(source)
    return config, {"seq_len": config.max_seq_len}
