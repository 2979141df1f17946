"""The vocabulary for describing Hugging Face families as data: `Family`, tensor `Transform`s, table helpers.

A `Family` says, for one `architectures` entry of config.json:
- which ModelConfig fields the architecture fixes, which it renames from config.json, and what needs more than
  a rename (activations, RoPE scaling, embedding sharing), in both directions;
- which checkpoint tensor comes from which tformer tensors. Tables are keyed by the Hugging Face name; an entry
  is the tformer name of the same tensor, or a tuple of tformer names with the `Transform` between them.
The families themselves live in `hf_decoders`, `hf_encoders`, `hf_longformer` and `hf_t5`; `tformer.interop.hf`
walks their tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tformer.config import ModelConfig
from tformer.models import CheckpointError


class UnsupportedHFConfig(CheckpointError):
    """config.json asks for something tformer cannot represent; the message names the field."""


@dataclass(frozen=True)
class Transform:
    """How some tformer tensors become one Hugging Face tensor (`save`) and back (`load`)."""

    save: Callable[[list[torch.Tensor]], torch.Tensor]
    load: Callable[[torch.Tensor], list[torch.Tensor]]


SAME = Transform(lambda ours: ours[0], lambda t: [t])  # one tensor under another name
CONV1D = Transform(lambda ours: ours[0].T, lambda t: [t.T])  # GPT-2's Conv1D stores weights (in, out)
FUSED = Transform(lambda ours: torch.cat(ours), lambda t: list(t.chunk(3)))  # q, k, v stacked in one tensor
FUSED_CONV1D = Transform(lambda ours: torch.cat(ours).T, lambda t: list(t.T.chunk(3)))
ROW = Transform(lambda ours: ours[0][None], lambda t: [t[0]])  # BART's final_logits_bias is (1, V)
OFFSET_2 = Transform(lambda ours: F.pad(ours[0], (0, 0, 2, 0)), lambda t: [t[2:]])  # BART skips position rows 0, 1
COPY = Transform(lambda ours: ours[0], lambda t: [])  # a duplicate the checkpoint keeps; loaded from its original

Entry = str | tuple[tuple[str, ...], Transform]
Table = dict[str, Entry]  # Hugging Face tensor name -> its tformer source


class HFFields(dict):
    """config.json merged over the defaults transformers assumes; a missing key raises a clear error."""

    def __missing__(self, key: str) -> Any:
        raise UnsupportedHFConfig(f"has no '{key}' field, which this architecture needs; add it to config.json")


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture and how it maps onto a ModelConfig and tformer's tensor names."""

    architecture: str
    model_type: str
    fixed: dict[str, Any]  # ModelConfig fields the architecture fixes
    renames: dict[str, str]  # ModelConfig field -> config.json key holding the same value
    defaults: dict[str, Any]  # config.json values transformers assumes when a key is absent
    extra_in: Callable[[HFFields], dict[str, Any]]  # config.json -> fields that need more than a rename
    extra_out: Callable[[ModelConfig], dict[str, Any]]  # the inverse of extra_in
    tensors: Callable[[ModelConfig], tuple[Table, Table]]  # (base-model tensors without prefix, head tensors)
    prefixes: tuple[str, ...]  # prefix of the base-model tensors: the first is written, all are read
    required: dict[str, Any] = field(default_factory=dict)  # config.json keys that, when present, must hold this
    ignored: tuple[str, ...] = ()  # fnmatch patterns: buffers and tied copies a checkpoint may hold
    optional: tuple[str, ...] = ()  # tensors older checkpoints may lack; they load as zeros
    dropped: tuple[str, ...] = ()  # weights tformer has no place for: dropped with a warning
    dropped_note: str = ""
    loose: tuple[str, ...] = ()  # fields read from config.json that export does not need to keep
    # config.json completed from the checkpoint's tensor names, when it alone does not say (T5's head tying)
    complete_config: Callable[[dict[str, Any], set[str]], dict[str, Any]] | None = None


# ---- helpers --------------------------------------------------------------------------------------------------------


def weight_bias(theirs: str, ours: str) -> Table:
    """A Linear or LayerNorm: weight and bias under the same two prefixes."""
    return {f"{theirs}.weight": f"{ours}.weight", f"{theirs}.bias": f"{ours}.bias"}


def _prefixed(entry: Entry, prefix: str) -> Entry:
    if isinstance(entry, str):
        return prefix + entry
    names, transform = entry
    return tuple(prefix + name for name in names), transform


def per_layer(table: Table, n_layers: int, theirs: str, ours: str) -> Table:
    """A per-layer table repeated for layers 0..n-1; `theirs` and `ours` are prefixes with an {i}."""
    return {
        theirs.format(i=i) + name: _prefixed(entry, ours.format(i=i))
        for i in range(n_layers)
        for name, entry in table.items()
    }


def lookup(table: dict[str, str], value: Any, what: str, target: str = "tformer") -> str:
    """table[value], or UnsupportedHFConfig saying that `what` has no equivalent in `target`."""
    if value not in table:
        raise UnsupportedHFConfig(f"{what} {value!r} has no {target} equivalent; supported: {', '.join(table)}")
    return table[value]


def same_value(hf: HFFields, key: str, other: str) -> None:
    """config.json sets two values that tformer holds in one field (per-stack head counts); they must agree."""
    if hf[key] != hf[other]:
        raise UnsupportedHFConfig(
            f"{key} ({hf[key]}) differs from {other} ({hf[other]}): tformer uses one value for both stacks"
        )


# Hugging Face activation names (transformers' ACT2FN) -> tformer FFNs, and back
MLP_IN = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu-tanh",
    "gelu_pytorch_tanh": "gelu-tanh",
    "silu": "silu",
    "swish": "silu",
}
MLP_OUT = {"relu": "relu", "gelu": "gelu", "gelu-tanh": "gelu_new", "silu": "swish"}
GATED_IN = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
GATED_OUT = {"swiglu": "silu", "geglu": "gelu"}
