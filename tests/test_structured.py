"""Structured outputs in the engine: JSON schemas, JSON objects, regular expressions, choices and grammars.

The reference for what a constraint allows is written here without llguidance: a token may come next when the text
so far plus the token's text is still a prefix of some string the pattern matches (the `regex` module's partial
match, over every token of the vocabulary), and end-of-sequence when the text so far matches whole. Greedy decoding
under a constraint must then pick, at each step, the uncached forward's best allowed token. Real weights: SmolLM2.
"""

from __future__ import annotations

import json

import pytest
import regex
import torch
from conftest import make_model, tiny_config

from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import RequestError, SamplingParams
from tformer.engine.structured import StructuredOutput

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smollm2(smollm2_pretrained):
    model, tokenizer = smollm2_pretrained
    return model, tokenizer, Engine(model, tokenizer, EngineConfig(max_batched_tokens=256))


@pytest.fixture(scope="module")
def token_texts(smollm2) -> list[str]:
    """Each token's text ("" for the special tokens, which a constraint never allows except end-of-sequence)."""
    _, tokenizer, _ = smollm2
    return [tokenizer.decode([t]) for t in range(tokenizer.vocab_size)]


def chat(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return tokenizer.encode(text)


def reference_greedy(model, tokenizer, texts: list[str], prompt: list[int], pattern: str, max_tokens: int) -> list[int]:
    """Greedy decoding under `pattern`, from the uncached forward and the brute-force allowed sets."""
    compiled, eos, output, text = regex.compile(pattern), tokenizer.eos_id, [], ""
    for _ in range(max_tokens):
        allowed = [t for t, piece in enumerate(texts) if piece and compiled.fullmatch(text + piece, partial=True)]
        if not allowed:  # complete, and nothing may follow: the sample ends without end-of-sequence
            break
        if compiled.fullmatch(text):
            allowed.append(eos)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output]))[0, -1].float()
        token = allowed[int(logits[allowed].argmax())]
        output.append(token)
        if token == eos:
            break
        text += texts[token]
    return output


@pytest.mark.parametrize(
    ("question", "spec", "pattern"),
    [
        ("When did the Second World War end? Answer with a date.", {"regex": r"(19|20)\d\d-\d\d-\d\d"}, None),
        ("Describe the sea in a few words.", {"regex": r"[A-Z][a-z]+( [a-z]+){2,5}\."}, None),
        (
            "Is the sky green?",
            {"choice": ["Yes, it is.", "No, it is not.", "Maybe"]},
            r"Yes, it is\.|No, it is not\.|Maybe",
        ),
        (
            "Is the sky blue?",
            {"grammar": 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "unknown"'},  # GBNF
            r"The answer is (yes|no|unknown)\.",
        ),
        ("Is water wet?", {"grammar": 'start: "Water is " ("wet" | "dry") "!"'}, r"Water is (wet|dry)!"),  # Lark
    ],
    ids=["date-regex", "words-regex", "choice", "gbnf", "lark"],
)
def test_greedy_picks_the_best_token_the_pattern_allows(smollm2, token_texts, question, spec, pattern) -> None:
    """Greedy under a regex, a choice or a grammar gives exactly the tokens of the reference (fp32): at each step the
    uncached forward's best token among those the pattern allows; the text then matches the pattern whole."""
    model, tokenizer, engine = smollm2
    prompt = chat(tokenizer, question)
    pattern = pattern or spec["regex"].replace(r"\d", "[0-9]")
    params = SamplingParams(max_tokens=24, temperature=0.0, structured=StructuredOutput(**spec))
    [completion] = engine.generate([prompt], params)
    assert completion.token_ids == reference_greedy(model, tokenizer, token_texts, prompt, pattern, 24)
    assert regex.fullmatch(pattern, completion.text) and completion.finish_reason == "stop"


def person_is_valid(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"name", "age", "role"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 20
        and type(value["age"]) is int
        and 0 <= value["age"] <= 120
        and value["role"] in ("admin", "user", "guest")
    )


def test_sampled_json_follows_the_schema_in_every_sample(smollm2) -> None:
    """Sampled at temperature 1.3 with n = 4 (each fork follows its own constraint), every answer parses and meets
    the schema (types, bounds, the enum, no other keys); unconstrained, the same model wraps its JSON in prose."""
    _, tokenizer, engine = smollm2
    prompt = chat(tokenizer, "Give me a user of a website as JSON.")
    params = SamplingParams(max_tokens=80, temperature=1.3, seed=0, n=4, structured=StructuredOutput(json=PERSON))
    answers = engine.generate([prompt], params)
    assert len(answers) == 4 and all(a.finish_reason == "stop" for a in answers)
    assert all(person_is_valid(a.text) for a in answers), [a.text for a in answers]
    assert len({a.text for a in answers}) > 1  # the samples differ: each is its own
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=80, temperature=0.0))
    with pytest.raises(ValueError):
        json.loads(plain.text)


def test_json_object_parses_and_a_cut_answer_says_length(smollm2) -> None:
    """Any JSON object: the greedy answer parses to a dict; cut by max_tokens, it ends with "length"; with
    `disable_any_whitespace` it is the compact serialization of what it parses to."""
    _, tokenizer, engine = smollm2
    prompt = chat(tokenizer, "Give me a book as a JSON object with a title and a year.")
    [whole] = engine.generate([prompt], SamplingParams(max_tokens=100, temperature=0, structured={"json_object": True}))
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.text), dict)
    [cut] = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, structured={"json_object": True}))
    assert cut.finish_reason == "length" and cut.token_ids == whole.token_ids[:3]
    compact = {"json_object": True, "disable_any_whitespace": True}  # vLLM's: no whitespace between JSON tokens
    [tight] = engine.generate([prompt], SamplingParams(max_tokens=100, temperature=0, structured=compact))
    value = json.loads(tight.text)
    assert isinstance(value, dict) and tight.text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert "\n" in whole.text  # the flexible default let the model write newlines


def test_constraints_that_cannot_be_served_are_refused(smollm2) -> None:
    """A bad regex, schema or grammar, two constraints at once, none, and beam search with one: a RequestError
    naming the fault, with nothing queued; an engine without a tokenizer refuses constraints."""
    model, _, engine = smollm2
    for spec, words in [
        ({"regex": "(unclosed"}, "does not compile"),
        ({"json": {"type": "no-such-type"}}, "does not compile"),
        ({"grammar": "root ::= missing_rule"}, "does not compile"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({}, "exactly one"),
        ({"choice": []}, "non-empty"),
        ({"shape": "round"}, "structured takes"),
    ]:
        with pytest.raises(RequestError, match=words):
            engine.add_request([1, 2, 3], SamplingParams(structured=spec))
    with pytest.raises(RequestError, match="beam search"):
        SamplingParams(beam_width=2, structured={"regex": "a"})
    assert not engine.has_unfinished()
    with pytest.raises(RequestError, match="tokenizer"):
        Engine(model).add_request([1, 2, 3], SamplingParams(structured={"regex": "a"}))


def test_a_draft_model_leaves_structured_requests_to_plain_decoding(smollm2) -> None:
    """With a draft, a structured request gets no drafts: the same tokens as the engine without one, and nothing
    proposed (a tiny draft with SmolLM2's vocabulary)."""
    model, tokenizer, engine = smollm2
    draft = make_model(tiny_config("tiny-llama", vocab_size=model.config.vocab_size, max_seq_len=256), seed=1)
    config = EngineConfig(max_batched_tokens=256, max_model_len=256, num_speculative_tokens=3)
    drafted = Engine(model, tokenizer, config, draft=draft)
    params = SamplingParams(max_tokens=12, temperature=0.0, structured={"regex": r"[0-9]+ apples"})
    prompt = chat(tokenizer, "How many apples?")
    assert drafted.generate([prompt], params)[0].token_ids == engine.generate([prompt], params)[0].token_ids
    assert drafted.speculative.proposed == 0
    drafted.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert drafted.speculative.proposed > 0  # the same engine drafts for a plain request


def test_a_refused_token_ends_the_constraint_with_a_warning(smollm2, caplog) -> None:
    """A token outside the mask (which sampling never picks) is refused, logged with llguidance's reason, and leaves
    the constraint finished, so the engine ends the sample instead of decoding on from a broken state."""
    _, tokenizer, engine = smollm2
    constraint = engine.inputs.grammars.constraint(StructuredOutput(regex="ab"))
    refused = tokenizer.encode("zz", add_bos=False)[0]
    assert not constraint.allowed()[refused] and not constraint.finished
    with caplog.at_level("WARNING", logger="tformer.engine.structured"):
        assert not constraint.advance(refused)
    assert constraint.finished and "was refused" in caplog.text
