"""tformer's C++ kernels: built with the machine's C++ compiler on first use and cached on disk.

A kernel is one C++ source beside this file, which may include the shared helpers of the headers beside it
(`native.h`; `lanes.h` for the attention kernels). It is compiled with -O3 -march=native -fopenmp into a shared
library under ~/.cache/tformer/kernels, keyed by its source, the headers, the compiler, the flags and the CPU (so a
new source or another machine builds again, in about a second). The library runs on torch's own OpenMP runtime:
torch has loaded it already, and the library's libgomp.so.1 resolves to that same one. Where a kernel cannot be
built or loaded (no compiler, an unwritable cache directory) `load` logs why once and gives None, and callers keep a
plain torch path. A kernel can also register torch ops through torch's stable C ABI (`load(..., torch_ops=True)`,
`op_library`): then a compiled graph calls it like any op.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from tformer.files import cache_dir

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
COMPILER_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


@functools.cache
def cpu_name() -> str:
    """The CPU's model and instruction-set flags (what -march=native compiles for), as far as Linux tells."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    first = {key: next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags")}
    return "\n".join(line for line in first.values() if line) or platform.processor()


def torch_flags() -> list[str]:
    """Flags for a kernel that registers torch ops through torch's stable C ABI (`torch/csrc/stable`): its headers
    compile far faster than ATen's, and a call costs less than an op implemented in Python that calls a ctypes
    function (docs/design-notes.md, "kernels/native.py")."""
    root = Path(torch.__file__).parent
    return [f"-I{root / 'include'}", f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{root / 'lib'}"]


def load(name: str, what: str, torch_ops: bool = False) -> ctypes.CDLL | None:
    """The library built from `<name>.cpp` beside this file, or None (logged once per caller, which caches the
    result) when it cannot be built or loaded. `what` says in the log what goes without it. With `torch_ops` the
    source registers torch ops (`torch_flags`), which loading the library makes callable."""
    source = (HERE / f"{name}.cpp").read_text()
    compiler = os.environ.get("CXX", "g++")
    shared = "".join(header.read_text() for header in sorted(HERE.glob("*.h")))  # helpers kernels include
    flags = [*COMPILER_FLAGS, *(torch_flags() if torch_ops else [])]
    key = "\n".join([source, shared, compiler, *flags, torch.__version__, cpu_name()])
    library = cache_dir("kernels") / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    try:
        if not library.exists():
            _build(name, source, compiler, flags, library)
        if torch_ops:
            torch.ops.load_library(str(library))
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = (getattr(err, "stderr", b"") or b"").decode(errors="replace")[-500:]
        logger.warning("%s (%s) %s", what, err, detail)
        return None


def _build(name: str, source: str, compiler: str, flags: list[str], library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as build:
        source_file, built = Path(build) / f"{name}.cpp", Path(build) / f"{name}.so"
        source_file.write_text(source)
        command = [compiler, str(source_file), "-o", str(built), *flags, f"-I{HERE}"]  # libraries after the source
        subprocess.run(command, check=True, capture_output=True)
        os.replace(built, library)  # whole or not at all: another process may be loading it


def op_library(
    name: str, what: str, switch: str | None = None
) -> tuple[Callable[[], ctypes.CDLL | None], Callable[[], bool], Callable[[], str | None]]:
    """For a kernel that registers torch ops: `kernel()`, the library loaded on first use (None where it cannot be
    built, logged once, or where the environment variable `switch` is "0"); `available()`, whether it loaded, an
    answer a compiled graph reads once and never traces; `instructions()`, for a kernel that exports
    `<name>_instructions()`, the instructions its build vectorizes with ("AVX512-VNNI", "AVX2" or "portable"), or
    None where it did not load."""

    @functools.cache
    def kernel() -> ctypes.CDLL | None:
        if switch is not None and os.environ.get(switch, "1") == "0":
            return None
        return load(name, what, torch_ops=True)

    def available() -> bool:
        return kernel() is not None

    # torch.compiler.assume_constant_result's mark, set by hand: calling it imports torch._dynamo (over a second)
    # in every process that loads a kernel, compiling or not (tests/test_startup.py checks the mark is torch's)
    available._dynamo_marked_constant = True

    def instructions() -> str | None:
        if not available():
            return None
        named = getattr(kernel(), f"{name}_instructions")
        named.restype = ctypes.c_char_p
        return named().decode()

    return kernel, available, instructions
