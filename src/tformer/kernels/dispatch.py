"""Which path a kernel call takes: tformer's C++ kernels on an x86 CPU, torch's own ops on every other device.

The C++ kernels (`native.py`) are x86 code compiled with -march=native for the CPU they run on. Every wrapper asks
`native(device)` before it calls one, and otherwise runs its portable path, plain torch that runs wherever torch
does (a GPU, an ARM CPU, Apple's MPS):

| kernel | portable path |
|---|---|
| causal attention of prompt chunks | torch's SDPA (flash attention on a GPU) |
| paged decode attention | keys and values gathered from the pool (`paged_attention.gathered_decode_attention`) |
| INT4 linears | the weight dequantized, then one matmul in the activations' dtype |
| INT8 / W8A8 linears | the same integer formula in torch (`w8a8.w8a8_formula`, the integers multiplied in fp32) |
| Q6_K linears (a GGUF file's Q6_K blocks) | the weight dequantized, then one matmul in the activations' dtype |
| FP8 linears | already torch (`fp8.fp8_matmul`) |
| RMSNorm, rotary, SwiGLU's product | the layers' own formulas |
| the int8 KV cache's writes and reads | the rounding formula (`kv_int8.quantize_int8`) |

`TFORMER_PORTABLE_KERNELS=1` in the environment forces the portable paths on an x86 CPU too, so that a machine
without a GPU runs (and CI tests) the code a GPU takes; `tests/test_portable_kernels.py` compares both paths. Tests
switch in-process with `portable_kernels()`. `resolve_device` turns a `--device` string into a torch.device, or a
ConfigError that says how to get the device asked for.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tformer.errors import ConfigError

PORTABLE_SWITCH = "TFORMER_PORTABLE_KERNELS"
X86 = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}

_portable = os.environ.get(PORTABLE_SWITCH, "0") not in ("", "0")  # read once: a kernel call reads no environment


def native(device: torch.device) -> bool:
    """Whether a kernel call on `device` may take tformer's C++ kernels (an x86 CPU, unless the portable paths
    are forced); each kernel's wrapper then checks that its own library loaded."""
    return device.type == "cpu" and X86 and not _portable


def portable_forced() -> bool:
    """Whether TFORMER_PORTABLE_KERNELS (or `portable_kernels()`) sends every kernel call to its torch path."""
    return _portable


@contextmanager
def portable_kernels(forced: bool = True) -> Iterator[None]:
    """Within the block every kernel call takes its portable path (`forced`), or the native one where it may."""
    global _portable
    before, _portable = _portable, forced
    try:
        yield
    finally:
        _portable = before


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch.device a `--device` option (or a `device:` key) names: cpu, cuda, cuda:N, mps, xpu, ... A
    ConfigError says what is wrong and how to fix it: an unknown name, or a device this machine or this torch build
    does not have."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"unknown device {str(name)!r}; give a torch device: cpu, cuda, cuda:N (the N-th GPU), mps or xpu"
        ) from None
    if device.type == "cpu":
        return device
    if device.type == "meta":
        raise ConfigError("device 'meta' holds no numbers and cannot run a model; give cpu or a GPU such as cuda")
    if device.type == "cuda":
        _check_cuda(device)
        return device
    backend = getattr(torch, device.type, None) or getattr(torch.backends, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ConfigError(
            f"device {str(name)!r} is unavailable: this torch build ({torch.__version__}) or this machine has no "
            f"{device.type} device; install torch built for it, or give --device cpu"
        )
    return device


def _check_cuda(device: torch.device) -> None:
    if torch.version.cuda is None and torch.version.hip is None:
        raise ConfigError(
            f"device {str(device)!r} is unavailable: this torch ({torch.__version__}) is built without CUDA; install "
            "a CUDA build of torch (the wheel built for your CUDA version), or give --device cpu"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {str(device)!r} is unavailable: torch {torch.__version__} is built for CUDA "
            f"{torch.version.cuda or torch.version.hip} but finds no GPU; check `nvidia-smi`, the driver and "
            "CUDA_VISIBLE_DEVICES, or give --device cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"device {str(device)!r} is unavailable: this machine has {count} GPU(s), cuda:0..cuda:{count - 1}"
        )
