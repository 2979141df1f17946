"""The one-way import rules of the package, read from every module's source (imports inside functions too).

Each part of tformer may import only the parts below it. The table is the rule; the test fails on any import
outside it, naming the module and the import, so a new dependency is a decision written here rather than an
accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tformer"

BASE = {"errors", "files"}
CONFIG = BASE | {"config", "presets"}
LAYERS = CONFIG | {"layers"}
MODELS = LAYERS | {"models"}
# weights in and out, data and the kernels stand on the models; the door to checkpoints on interop and data
INTEROP = MODELS | {"data", "interop"}
CHECKPOINTS = INTEROP | {"checkpoints"}
# offline decoding and the engine: the kernels (quantized weights), no training, no HTTP
DECODING = CHECKPOINTS | {"kernels", "decoding"}
ENGINE = DECODING | {"engine"}

# part of tformer -> the parts it may import
ALLOWED: dict[str, set[str]] = {
    "errors": {"errors"},
    "files": BASE,
    "threads": {"threads"},  # the thread policy, applied before torch loads: it imports nothing of tformer's
    "presets": BASE | {"presets"},
    "config": CONFIG,
    "layers": LAYERS,
    "models": MODELS,
    "data": BASE | {"data"},
    "kernels": LAYERS | {"kernels"},
    "interop": INTEROP,
    "info": MODELS | {"info"},
    "checkpoints": CHECKPOINTS,
    "decoding": DECODING,
    "viz": DECODING | {"viz"},
    "engine": ENGINE,
    "training": DECODING | {"viz", "info", "training"},
    "serve": ENGINE | {"serve"},
    # the command line and the package's lazy public names import everything
    "commands": None,
    "cli": None,
    "__main__": None,
    "tformer": None,
}


def part_of(module: str) -> str:
    """'tformer.engine.engine' -> 'engine'; 'tformer' (the package's __init__) -> 'tformer'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tformer"


def tformer_imports(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    """(line, module) of every tformer import in a file under the package directory `src`, relative imports
    resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(src.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "tformer"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            if module == "tformer":  # `from tformer import x`: x is a part (a module) or a public name
                found += [(node.lineno, f"tformer.{alias.name}") for alias in node.names]
            elif module.split(".")[0] == "tformer":
                found.append((node.lineno, module))
    return found


def modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_part_has_a_rule() -> None:
    parts = {part_of(".".join(p.relative_to(SRC.parent).with_suffix("").parts)) for p in modules()}
    parts = {p.removesuffix(".__init__") for p in parts} - {"__init__"}
    assert parts <= ALLOWED.keys(), f"add a rule for {sorted(parts - ALLOWED.keys())} to ALLOWED"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_one_way(path: Path) -> None:
    name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
    allowed = ALLOWED[part_of(name)]
    if allowed is None:
        return
    wrong = []
    for line, module in tformer_imports(path):
        target = part_of(module)
        public = module == f"tformer.{target}" and target not in ALLOWED  # `from tformer import ModelConfig`
        if public or target not in allowed:
            wrong.append(f"{path.relative_to(SRC)}:{line} imports {module}")
    assert not wrong, "imports against the one-way rules (see ALLOWED in tests/test_layering.py):\n" + "\n".join(wrong)


def test_the_rules_catch_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a layer importing a model inside a function, or the engine relatively, is reported."""
    source = tmp_path / "tformer" / "layers" / "bad.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from tformer.models import build_model\n    from ..engine import Engine\n")
    found = [module for _, module in tformer_imports(source, tmp_path / "tformer")]
    assert found == ["tformer.models", "tformer.engine"]
    assert {part_of(m) for m in found} - ALLOWED["layers"] == {"models", "engine"}
