"""Structured outputs: a request's text held to a JSON schema, any JSON object, a regular expression, one of a
fixed list of strings, or a grammar (Lark, or llama.cpp's GBNF), as vLLM's `structured_outputs` and llama.cpp's
`--grammar` / `--json-schema` do.

llguidance (the library behind vLLM's "guidance" backend) compiles the constraint. Before each token of such a request,
its `Constraint` asks llguidance which tokens keep the text a prefix of some string the constraint accepts (a bitmask
over the vocabulary, computed from the tokenizer's token trie, small beside a decode step; nothing is built per schema
up front; docs/design-notes.md, "engine/structured.py"), and every other token's logit becomes -inf; then the request
samples as it would (penalties, temperature, top-k/top-p, min_p). End-of-sequence is allowed only once the text is
complete, and the sample ends ("stop") as soon as the constraint admits nothing more.

llguidance is imported on first use, so that processes which never constrain output do not pay for it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tformer.errors import RequestError

logger = logging.getLogger(__name__)
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MASK_BITS = 32  # llguidance's bitmask: one int32 word for every 32 tokens
MAX_GRAMMARS = 256  # compiled constraints a compiler keeps


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: exactly one of `json` (a JSON schema, as a dict or its JSON text),
    `json_object` (any JSON object), `regex` (Rust's regex syntax, matched whole; `\\d` is an ASCII digit),
    `choice` (one of these strings)
    or `grammar` (a Lark grammar, or a GBNF one as llama.cpp's `--grammar` takes). JSON may hold any whitespace
    between its tokens, unless `disable_any_whitespace` (vLLM's): then none, as in '{"a":1,"b":[2,3]}'."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) or "none"
            raise RequestError(f"a structured output takes exactly one of {', '.join(KINDS)}; got {named}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise RequestError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json)}")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"{kind} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise RequestError(f"choice must be a non-empty list of non-empty strings, got {list(self.choice)!r}")

    def key(self) -> str:
        """The constraint as one string (equal constraints, equal keys): what the grammar cache is keyed by."""
        kind = next(kind for kind in KINDS if getattr(self, kind) not in (None, False))
        value = getattr(self, kind)
        text = json.dumps(value, sort_keys=True) if kind in ("json", "choice") and not isinstance(value, str) else value
        return f"{kind}{'-compact' if self.disable_any_whitespace else ''}:{text}"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of tformer; only a broken environment lacks it
        raise RequestError("structured outputs need the llguidance package: pip install llguidance") from None
    return llguidance


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for a constraint; RequestError with llguidance's reason when it does not compile."""
    llg = _llguidance()
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    try:
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if spec.json_object:
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=options)
        if spec.regex is not None:  # \d as [0-9]: Rust's \d is any Unicode digit (U+1FBF8 too)
            return llg.LLMatcher.grammar_from_regex(llg.regex_to_lark(spec.regex, "d"))
        if spec.choice is not None:
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llg.grammar_from("grammar", spec.grammar)
    except (ValueError, TypeError) as err:
        raise RequestError(f"the structured output does not compile: {err}") from None


class GrammarCompiler:
    """One tokenizer's constraints: llguidance's view of the vocabulary, built on first use (a fraction of a second;
    docs/design-notes.md, "engine/structured.py"), and the constraints compiled so far (once each, by their `key`). Like
    the engine that holds it, it is used from one thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._llg_tokenizer: Any = None
        self._prototypes: dict[str, Any] = {}  # key -> matcher in its first state, the oldest dropped past MAX_GRAMMARS

    def _vocabulary(self) -> Any:
        if self._llg_tokenizer is None:
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None or not self.eos_ids:
                raise RequestError(
                    "structured outputs need the model's tokenizer (a Hugging Face `tokenizers` one) and its "
                    "end-of-sequence token; this engine has neither"
                )
            llg = _llguidance()
            self._llg_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._llg_tokenizer

    def _prototype(self, spec: StructuredOutput) -> Any:
        """The constraint's matcher in its first state, compiled once and copied for each sample, which costs far
        less than compiling (docs/design-notes.md, "engine/structured.py")."""
        key = spec.key()
        if key not in self._prototypes:
            matcher = _llguidance().LLMatcher(self._vocabulary(), grammar_text(spec), log_level=0)
            if matcher.is_error():
                raise RequestError(f"the structured output does not compile: {matcher.get_error()}")
            if len(self._prototypes) >= MAX_GRAMMARS:
                self._prototypes.pop(next(iter(self._prototypes)))
            self._prototypes[key] = matcher
        return self._prototypes[key]

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A fresh `Constraint` for one sample (RequestError when the constraint does not compile)."""
        return Constraint(self._prototype(spec).deep_copy(), self.vocab_size)


class Constraint:
    """One sample's place in its constraint: which tokens may come next, and the tokens chosen so far."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._words = np.zeros(-(-vocab_size // MASK_BITS), dtype=np.int32)  # llguidance writes the mask here

    def copy(self) -> Constraint:
        """An independent copy in the same state (a request's n samples each follow their own)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size)

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens that keep the output valid (end-of-sequence only where it may end)."""
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")  # bit j of word w: token 32 w + j
        return torch.from_numpy(bits[: self.vocab_size].view(np.bool_))

    def mask(self, logits: torch.Tensor, unadjusted: torch.Tensor | None = None) -> torch.Tensor:
        """`logits` (V,) with every token the constraint refuses at -inf. Given the `unadjusted` logits (before the
        request's penalties and min_tokens), should nothing be left (min_tokens banned the end-of-sequence the
        constraint now needs), the constraint wins: the unadjusted logits, masked."""
        allowed = self.allowed().to(logits.device)
        masked = torch.where(allowed, logits.float(), float("-inf"))
        if unadjusted is not None and bool(masked.isneginf().all()):
            masked = torch.where(allowed, unadjusted.float(), float("-inf"))
        return masked

    def advance(self, token: int) -> bool:
        """Takes the chosen token. A token the constraint refuses (the masks never offer one) puts the matcher in
        an error state, which ends the sample as `finished`; it is logged with llguidance's reason."""
        if self.matcher.consume_token(token):
            return True
        logger.warning("structured output: token %d was refused (%s); the sample ends", token, self.matcher.get_error())
        return False

    @property
    def finished(self) -> bool:
        """Whether the output is complete and nothing may follow (or the constraint failed)."""
        return bool(self.matcher.is_stopped())
