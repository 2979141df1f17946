"""Every C++ kernel compiles for each instruction set it has a path for, not only for this machine's CPU.

The kernels build with -march=native, so the suite on one machine only ever compiles one of their paths; a path
guarded by another CPU's macros could stop compiling unseen (the paged attention kernel's portable build did, on
2026-12-03). These builds stop after the compiler's checks (-fsyntax-only), which instantiate every template."""

import os
import platform
import shutil
import subprocess

import pytest

from tformer.kernels import native

COMPILER = os.environ.get("CXX", "g++")
TARGETS = {  # the path each kernel takes there: -march value
    "portable": "x86-64",
    "avx2": "haswell",
    "avx512-without-vnni": "skylake-avx512",
    "avx512-vnni": "cascadelake",
}

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which(COMPILER) is None, reason="needs an x86-64 C++ compiler"
)


@pytest.mark.parametrize("kernel", sorted(source.stem for source in native.HERE.glob("*.cpp")))
def test_kernel_compiles_for_every_instruction_set(kernel: str) -> None:
    """The builds for the targets run side by side: each is mostly the compiler reading torch's headers."""
    flags = [flag for flag in native.COMPILER_FLAGS if flag not in ("-march=native", "-shared", "-fPIC")]
    includes = [flag for flag in native.torch_flags() if flag.startswith("-I")]
    source = str(native.HERE / f"{kernel}.cpp")
    builds = {
        march: subprocess.Popen(
            [COMPILER, source, "-fsyntax-only", march, *flags, *includes, f"-I{native.HERE}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for march in (f"-march={value}" for value in TARGETS.values())
    }
    errors = {march: build.communicate()[1] for march, build in builds.items()}  # every build waited for
    failed = {march: errors[march][-2000:] for march, build in builds.items() if build.returncode != 0}
    assert not failed, "\n".join(f"{kernel}.cpp does not compile with {m}:\n{e}" for m, e in failed.items())
