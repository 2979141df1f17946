"""Keeping freed host memory for reuse during CPU training (glibc's malloc on Linux).

By default glibc serves every allocation above a threshold (128 KiB, raised as large blocks are freed, at most
32 MiB) with a fresh mmap, and unmaps it when freed; it also returns the top of its heap to the kernel once
128 KiB of it is free. A training step allocates and frees the same large activations every step (the main
recipe's 2,000 x 4,000 logits are 16 MB in bf16), so each step paid the kernel to zero fresh pages again. With
the threshold at its maximum and trimming at 256 MiB, freed blocks stay in the heap and are reused, and the main
recipe's bf16 step is faster. Fixing only the trim threshold would freeze the mmap threshold at 128 KiB, which is
far slower: both are set together (docs/design-notes.md, "training/host_memory.py").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit systems
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory(device: torch.device) -> bool:
    """Tells glibc to keep freed blocks of up to 32 MiB for reuse, for the whole process, when training on the
    CPU; returns whether it applied (False for other devices, off Linux or without glibc: nothing changes)."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
