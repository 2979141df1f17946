"""Start-up: importing the engine or the command line leaves Dynamo and inductor unimported (over a second of
start-up that only `--compile` needs); benchmarks/startup.py times the commands themselves."""

import subprocess
import sys

import torch

from tformer.kernels import native

COMPILERS = ("torch._dynamo", "torch._inductor")


def test_importing_the_engine_and_the_cli_leaves_the_compiler_unimported():
    code = (
        "import sys, tformer.engine.engine, tformer.engine.loading, tformer.cli\n"
        f"print(sorted(m for m in sys.modules if m.startswith({COMPILERS!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_kernels_availability_carries_torchs_constant_mark():
    # native.op_library marks `available` by hand; the mark must be the one torch's decorator sets
    _, available, _ = native.op_library("kv_int8", "unused")

    def reference() -> bool:
        return True

    marked = torch.compiler.assume_constant_result(reference)
    marks = {key: value for key, value in vars(marked).items() if key.startswith("_dynamo")}
    assert marks and {key: getattr(available, key, None) for key in marks} == marks
