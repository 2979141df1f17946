"""`tformer <command>`: a table from command name to a typed function.

Each function's signature becomes its command line: parameters without a default are positional,
keyword-only ones and those with a default are `--options`, and a list is a variable-length positional; the
docstring's first line is the help text, and its `name: text` lines (continued on indented lines) document the
parameters.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import sys
import typing
from collections.abc import Callable

from tformer.commands.inspect import info, presets, viz
from tformer.commands.prepare import prepare
from tformer.commands.qa import qa
from tformer.commands.serving import bench, convert, embed, generate, serve
from tformer.commands.training import average, estimate, evaluate, train, translate
from tformer.errors import TformerError
from tformer.threads import apply_thread_policy

# allocations (less deallocations) between two collections of the youngest generation while a command runs
COLLECT_EVERY = 10_000

COMMANDS: dict[str, Callable[..., None]] = {
    "train": train,
    "prepare": prepare,
    "eval": evaluate,
    "translate": translate,
    "generate": generate,
    "embed": embed,
    "qa": qa,
    "convert": convert,
    "serve": serve,
    "average": average,
    "info": info,
    "estimate": estimate,
    "bench": bench,
    "viz": viz,
    "presets": presets,
}


def _param_help(fn: Callable[..., None]) -> dict[str, str]:
    """Each parameter's help from the docstring's `name: text` lines (indented lines continue the text)."""
    doc = inspect.getdoc(fn) or ""
    helps: dict[str, str] = {}
    name = None
    for line in doc.splitlines()[1:]:
        if line.startswith("  ") and name is not None:
            helps[name] += " " + line.strip()
            continue
        name, sep, text = line.partition(": ")
        if sep and name.isidentifier():
            helps[name] = text
        else:
            name = None
    return helps


def _add_command(subparsers: argparse._SubParsersAction, name: str, fn: Callable[..., None]) -> None:
    summary = (inspect.getdoc(fn) or "").splitlines()[0]
    parser = subparsers.add_parser(name, help=summary, description=summary)
    helps = _param_help(fn)
    hints = typing.get_type_hints(fn)
    for param in inspect.signature(fn).parameters.values():
        kind = next(t for t in typing.get_args(hints[param.name]) or (hints[param.name],) if t is not type(None))
        text = helps.get(param.name, "")
        if typing.get_origin(hints[param.name]) is list:
            parser.add_argument(param.name, nargs="*", type=kind, help=text)
        elif param.default is inspect.Parameter.empty and param.kind is not param.KEYWORD_ONLY:
            parser.add_argument(param.name, type=kind, help=text)
        elif param.default is inspect.Parameter.empty:
            parser.add_argument(
                f"--{param.name.replace('_', '-')}", dest=param.name, type=kind, required=True, help=text
            )
        elif kind is bool:
            parser.add_argument(
                f"--{param.name.replace('_', '-')}",
                action=argparse.BooleanOptionalAction,
                default=param.default,
                help=text,
            )
        else:
            parser.add_argument(
                f"--{param.name.replace('_', '-')}",
                dest=param.name,
                type=kind,
                default=param.default,
                help=text if "default" in text else f"{text} (default: %(default)s)",
            )
    parser.set_defaults(_command=fn)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tformer", description="Train, inspect and serve Transformers.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, fn in COMMANDS.items():
        _add_command(subparsers, name, fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_thread_policy()  # before any command loads torch: OpenMP reads its settings once (tformer/threads.py)
    args = vars(build_parser().parse_args(argv))
    command = args.pop("_command")
    code = 0
    # Importing torch and building a model allocate millions of objects that live for good and form few cycles;
    # at the default threshold (a collection every 700 allocations) the collector runs hundreds of times during
    # start-up and walks the whole heap several times. Every COLLECT_EVERY allocations it still frees cycles.
    threshold = gc.get_threshold()
    gc.set_threshold(COLLECT_EVERY, *threshold[1:])
    try:
        command(**args)
    except TformerError as err:
        print(f"tformer: error: {err}", file=sys.stderr)
        code = 2
    finally:
        gc.set_threshold(*threshold)
    # What is alive now dies with the process: frozen, it is left out of the interpreter's last collections, which
    # otherwise walk every object torch created (a few tenths of a second at each exit).
    gc.freeze()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a multi-process run leaves without the interpreter's teardown: there gloo's threads can
        # abort the process ("terminate called without an active exception", exit -6) after a peer has died
        # or hung, or even after a clean run, and the launcher would see a crash instead of this exit code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
