"""Building a model whose weights are about to be loaded, without initializing them first.

`skip_init` builds parameters on the meta device (no memory, no random numbers) while buffers computed at
construction (RoPE frequencies, sinusoidal tables) stay real; `assign_weights` then makes the loaded tensors the
model's parameters. A memory-mapped safetensors file stays memory-mapped: nothing is copied unless the dtype
changes. Hugging Face's `no_init_weights` and accelerate's `init_empty_weights` work the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

# every public in-place initializer of torch.nn.init (uniform_, normal_, xavier_uniform_, kaiming_normal_, ...)
INITIALIZERS = tuple(name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_"))


def _leave_as_is(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Inside, new parameters live on the meta device and torch.nn.init's initializers do nothing."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    saved = {name: getattr(nn.init, name) for name in INITIALIZERS}
    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    for name in saved:
        setattr(nn.init, name, _leave_as_is)
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for name, initializer in saved.items():
            setattr(nn.init, name, initializer)


Slot = tuple[str, nn.Module, str, bool]  # (state-dict name, owning module, attribute, is a parameter)


def _slots_by_tensor(model: nn.Module) -> list[list[Slot]]:
    """Each parameter and persistent buffer with every name it goes by (tied weights share one tensor)."""
    groups: dict[int, list[Slot]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, param in module._parameters.items():
            if param is not None:
                groups.setdefault(id(param), []).append((dot + attr, module, attr, True))
        for attr, buffer in module._buffers.items():
            if buffer is not None and attr not in module._non_persistent_buffers_set:
                groups.setdefault(id(buffer), []).append((dot + attr, module, attr, False))
    return list(groups.values())


def assign_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str], list[str]]:
    """Makes `state`'s tensors the parameters and persistent buffers of `model` (built under `skip_init`).

    A tensor keeps its storage (a memory-mapped file stays mapped) unless it must be cast to the slot's dtype
    or made contiguous;
    tied weights are set once, from whichever of their names `state` holds. Returns (missing, unexpected,
    mismatched): names `state` lacks, names the model lacks, and "name: got shape, expected shape" lines.
    Nothing is assigned to a slot whose shape does not match.
    """
    known: set[str] = set()
    missing, mismatched = [], []
    for slots in _slots_by_tensor(model):
        names = [name for name, *_ in slots]
        known.update(names)
        given = next((name for name in names if name in state), None)
        if given is None:
            missing.extend(names)
            continue
        _, module, attr, is_param = slots[0]
        current = module._parameters[attr] if is_param else module._buffers[attr]
        tensor = state[given]
        if tuple(tensor.shape) != tuple(current.shape):
            mismatched.append(f"{given}: got {list(tensor.shape)}, expected {list(current.shape)}")
            continue
        tensor = tensor.to(current.dtype).contiguous()  # both return `tensor` itself when nothing changes
        value = nn.Parameter(tensor, requires_grad=current.requires_grad) if is_param else tensor
        for _, owner, name, _ in slots:
            (owner._parameters if is_param else owner._buffers)[name] = value
    return missing, sorted(set(state) - known), mismatched


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of parameters and buffers still on the meta device (never loaded)."""
    return [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
