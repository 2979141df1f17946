"""`tformer <command>`: a table from command name to a typed function.

Each function's signature becomes its command line: parameters without a default are positional,
the others are `--options`; the docstring's first line is the help text, and its `name: text` lines
document the parameters.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from tformer.config import ConfigError, ModelConfig
from tformer.models import CheckpointError


def info(model: str, context: int | None = None, dtype: str = "fp16") -> None:
    """Print the parameter count, FLOPs per token and KV-cache size of a preset or config file.

    model: a preset name (e.g. transformer-base, gpt2, llama2-7b) or a YAML/JSON config file
    context: context length for attention FLOPs and the KV-cache total (default: the model's max_seq_len)
    dtype: KV-cache element type: fp32, fp16, bf16, fp8 or int8
    """
    from tformer.info import format_info, model_info

    config = ModelConfig.from_file(model) if Path(model).is_file() else ModelConfig.from_preset(model)
    print(format_info(model, config, model_info(config, context, dtype)))


def presets() -> None:
    """List the named model configurations."""
    from tformer.presets import PRESETS

    for name, values in PRESETS.items():
        print(f"{name:18s} {values['family']}")


COMMANDS: dict[str, Callable[..., None]] = {"info": info, "presets": presets}


def _param_help(fn: Callable[..., None]) -> dict[str, str]:
    doc = inspect.getdoc(fn) or ""
    helps = {}
    for line in doc.splitlines()[1:]:
        name, sep, text = line.partition(": ")
        if sep and name.isidentifier():
            helps[name] = text
    return helps


def _add_command(subparsers: argparse._SubParsersAction, name: str, fn: Callable[..., None]) -> None:
    summary = (inspect.getdoc(fn) or "").splitlines()[0]
    parser = subparsers.add_parser(name, help=summary, description=summary)
    helps = _param_help(fn)
    hints = typing.get_type_hints(fn)
    for param in inspect.signature(fn).parameters.values():
        kind = next(t for t in typing.get_args(hints[param.name]) or (hints[param.name],) if t is not type(None))
        text = helps.get(param.name, "")
        if param.default is inspect.Parameter.empty:
            parser.add_argument(param.name, type=kind, help=text)
        elif kind is bool:
            parser.add_argument(f"--{param.name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                                default=param.default, help=text)
        else:
            parser.add_argument(f"--{param.name.replace('_', '-')}", dest=param.name, type=kind,
                                default=param.default, help=text if "default" in text else f"{text} (default: %(default)s)")
    parser.set_defaults(_command=fn)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tformer", description="Train, inspect and serve Transformers.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, fn in COMMANDS.items():
        _add_command(subparsers, name, fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("_command")
    try:
        command(**args)
    except (ConfigError, CheckpointError) as err:
        print(f"tformer: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
