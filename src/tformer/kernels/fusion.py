"""Fused projections for serving: the layers that read the same input become one layer.

Attention's q, k and v projections, and a gated MLP's gate and up projections, each multiply the same input.
At batch 1 every matmul pays a fixed cost (a kernel launch, the packed kernels' setup), so three INT4 matmuls of
576 -> 576, 192, 192 take much longer than one of 576 -> 960 (docs/design-notes.md, "kernels/fusion.py").
Joining weights by their output rows changes no number a row computes: each output row keeps its own weights, and INT4
groups, INT8 and FP8 scales are per output row, so a fused layer quantizes to exactly the rows of the separate ones.
`set_precision` fuses before it quantizes; INT4 layers read from a GGUF file, already packed, are joined as they are.
"""

from __future__ import annotations

import torch
from torch import nn


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One layer whose output is the outputs of `parts` side by side, for layers of one type that read the same
    input: nn.Linear, or a layer type with a `concatenated(parts)` class method (INT4), which may give None.
    None for a mix of types or anything else (the layers then stay as they are)."""
    kinds = {type(part) for part in parts}
    if len(kinds) != 1 or len({part.in_features for part in parts}) != 1:
        return None
    if len({part.bias is None for part in parts}) != 1:
        return None
    kind = kinds.pop()
    if kind is nn.Linear:
        return _concat_float(parts)
    join = getattr(kind, "concatenated", None)
    return None if join is None else join(parts)


def concat_bias(parts: list[nn.Module]) -> torch.Tensor | None:
    """The joined biases of `parts`, which all have one or all have none."""
    return None if parts[0].bias is None else torch.cat([part.bias.detach() for part in parts])


def _concat_float(parts: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([part.weight.detach() for part in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    bias = concat_bias(parts)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuses every module of `model` that can (self-attention's q/k/v, gated MLPs' gate/up) in place; returns the
    model. The fused model serves only: the separate layers are gone, so it no longer trains, nor loads or saves
    a checkpoint."""
    for module in list(model.modules()):
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None:
            fuse(concat_linears)
    return model
