"""Text <-> token ids: tformer's own byte-level BPE, or any pretrained Hugging Face / GGUF tokenizer.

tformer trains a joint byte-level BPE (GPT-2 style) with Hugging Face `tokenizers`. Byte-level BPE starts
from the 256 byte values, so every string encodes without <unk> and decodes back exactly (after NFC
normalisation): German umlauts and ß are two UTF-8 bytes each and become single tokens once merged. A space
is prepended to each text so that a word is the same token at the start of a sentence and in the middle;
the decoder strips it again. Its special tokens have fixed ids: <pad>=0, <s>=1 (bos), </s>=2 (eos),
<unk>=3, <mask>=4. Trained with ``num_sentinels=n``, the vocabulary's top n ids are T5's sentinels:
<extra_id_0> is ``vocab_size - 1``, <extra_id_1> is ``vocab_size - 2``, and so on.

A pretrained tokenizer keeps its own special tokens (each of bos, eos, pad, unk, mask may be absent), whether
`encode` starts with bos (`add_bos`), and its chat template. `save` writes `tokenizer.json` plus a
`tokenizer_config.json` with Hugging Face's keys, so `transformers.AutoTokenizer` reads the directory too.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from tformer.data.readers import DataError
from tformer.files import read_mapping, write_atomically, write_text_atomically

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<mask>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = range(len(SPECIAL_TOKENS))
ROLES = ("pad", "bos", "eos", "unk", "mask")
TFORMER_SPECIALS: dict[str, str] = dict(zip(ROLES, SPECIAL_TOKENS, strict=True))
FILE_NAME = "tokenizer.json"
CONFIG_NAME = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_NAME = "special_tokens_map.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"  # where newer Hugging Face repos keep the template


def sentinel_token(i: int) -> str:
    """The text of T5 sentinel number i, e.g. <extra_id_0>."""
    return f"<extra_id_{i}>"


class Tokenizer:
    """Text <-> token ids; a thin wrapper of `tokenizers.Tokenizer` that also knows the special tokens.

    `special_tokens` maps roles ("bos", "eos", "pad", "unk", "mask") to token texts; each must be in the
    vocabulary. None means tformer's own layout, whose ids must be <pad>=0 <s>=1 </s>=2 <unk>=3 <mask>=4.
    `add_bos` makes `encode` start with the bos id by default. `chat_template` is a Jinja template that
    `apply_chat_template` renders (Hugging Face's convention). Padding and truncation that a tokenizer.json
    may switch on are switched off: tformer's collators pad and cut batches themselves.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        special_tokens: Mapping[str, str | None] | None = None,
        *,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        if special_tokens is None:
            _check_tformer_layout(backend)
            special_tokens = TFORMER_SPECIALS
        unknown = set(special_tokens) - set(ROLES)
        if unknown:
            raise DataError(f"unknown special token roles {sorted(unknown)}; use {', '.join(ROLES)}")
        self.special_tokens: dict[str, str] = {r: t for r, t in special_tokens.items() if t is not None}
        self._special_ids: dict[str, int] = {}
        for role, token in self.special_tokens.items():
            if (token_id := backend.token_to_id(token)) is None:
                raise DataError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
            self._special_ids[role] = token_id
        if add_bos and "bos" not in self._special_ids:
            raise DataError("add_bos needs a bos token, but this tokenizer has none")
        self.add_bos = add_bos
        self.chat_template = chat_template

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, num_sentinels: int = 0
    ) -> Tokenizer:
        """Learn a BPE vocabulary of `vocab_size` ids (specials and sentinels included) from `texts`.

        For translation, pass source and target texts together to get the joint vocabulary that shared
        embeddings need. The vocabulary comes out smaller when the texts have fewer distinct merges.
        """
        base = len(SPECIAL_TOKENS) + 256  # the specials plus the byte alphabet
        if vocab_size < base + num_sentinels:
            raise DataError(
                f"vocab_size={vocab_size} is too small: byte-level BPE needs at least {base + num_sentinels}"
            )
        backend = HFTokenizer(models.BPE())
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - num_sentinels,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        # appended in reverse so that <extra_id_0> gets the highest id, as in T5
        backend.add_special_tokens([sentinel_token(i) for i in reversed(range(num_sentinels))])
        return cls(backend)

    # ---- files -------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a directory holding tokenizer.json, or a tokenizer.json file.

        Next to a tokenizer.json, Hugging Face's tokenizer_config.json and special_tokens_map.json (special
        tokens, `add_bos_token`, `chat_template`) and chat_template.jinja are read when present. A bare
        tokenizer.json with tformer's five special tokens at ids 0-4 loads as tformer's own layout.
        """
        path = Path(path)
        file = path if path.suffix == ".json" else path / FILE_NAME
        if not file.is_file():
            raise DataError(f"{file}: no such file; pass a directory holding {FILE_NAME} (from Tokenizer.save)")
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as err:  # noqa: BLE001 -- tokenizers raises a bare Exception for malformed files
            raise DataError(f"{file}: not a valid tokenizer.json ({err})") from None
        if file.name != FILE_NAME:
            return cls(backend) if _has_tformer_layout(backend) else cls(backend, {})
        config = _read_json(file.parent / CONFIG_NAME)
        token_map = {**_read_json(file.parent / SPECIAL_TOKENS_MAP_NAME), **config}
        if not token_map and _has_tformer_layout(backend):
            return cls(backend)
        specials = {role: _token_text(token_map.get(f"{role}_token"), file.parent / CONFIG_NAME) for role in ROLES}
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # the tokenizer.json's post-processor says whether bos comes first
            add_bos = _post_processor_adds(backend, specials["bos"])
        template = _chat_template(config, file.parent)
        try:
            return cls(backend, specials, add_bos=bool(add_bos), chat_template=template)
        except DataError as err:
            raise DataError(f"{file.parent}: {err}") from None

    from_file = load  # the name earlier tformer versions used

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write tokenizer.json and tokenizer_config.json into `directory` (created if needed), each atomically.

        Returns the path of tokenizer.json.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        file = directory / FILE_NAME
        write_atomically(file, lambda tmp: self._backend_for_saving().save(str(tmp)))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        config.update({f"{role}_token": self.special_tokens.get(role) for role in ROLES})
        config["add_bos_token"] = self.add_bos
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        write_text_atomically(directory / CONFIG_NAME, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return file

    def _backend_for_saving(self) -> HFTokenizer:
        """With add_bos, a copy whose post-processor adds bos, so that Hugging Face's encode(text) does too."""
        if not self.add_bos or _post_processor_adds(self.backend, self.bos_token):
            return self.backend
        backend = HFTokenizer.from_str(self.backend.to_str())
        bos = self.bos_token
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, self.bos_id)]
        )
        return backend

    # ---- ids of the special tokens -----------------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos")

    @property
    def pad_id(self) -> int | None:
        return self._special_ids.get("pad")

    @property
    def bos_id(self) -> int | None:
        return self._special_ids.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self._special_ids.get("eos")

    @property
    def unk_id(self) -> int | None:
        return self._special_ids.get("unk")

    @property
    def mask_id(self) -> int | None:
        return self._special_ids.get("mask")

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials and sentinels included; the model's embedding table needs this many rows."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def sentinel_ids(self) -> list[int]:
        """Ids of <extra_id_0>, <extra_id_1>, ... (descending from vocab_size - 1); empty without sentinels."""
        ids = []
        while (token_id := self.backend.token_to_id(sentinel_token(len(ids)))) is not None:
            ids.append(token_id)
        return ids

    @property
    def special_ids(self) -> list[int]:
        """All ids that stand for no text: the named specials, then every other special added token."""
        ids = list(dict.fromkeys(self._special_ids[r] for r in ROLES if r in self._special_ids))
        added = self.backend.get_added_tokens_decoder()
        return ids + sorted(i for i, token in added.items() if token.special and i not in ids)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (byte-level form, e.g. "Ġthe" for " the"), or None."""
        return self.backend.token_to_id(token)

    # ---- encoding and decoding ---------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, with the bos id first if `add_bos` (default: the tokenizer's `add_bos`).

        Nothing else is added: tformer's collators and objectives add <s> and </s> themselves, and the
        tokenizer.json's post-processor (e.g. BERT's [CLS] ... [SEP]) is not applied.
        """
        return self._with_bos(self.backend.encode(text, add_special_tokens=False).ids, add_bos)

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Token ids of `text` through the tokenizer.json's post-processor, as Hugging Face encodes by default (BERT's
        [CLS] ... [SEP]): what an encoder pretrained with them reads, e.g. for sentence embeddings."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel by the Rust backend (without the character offsets, which
        nothing here reads: the same ids, sooner)."""
        encodings = self.backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids, add_bos) for e in encodings]

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        if not (self.add_bos if add_bos is None else add_bos):
            return ids
        if self.bos_id is None:
            raise DataError("cannot add bos: this tokenizer has no bos token")
        return [self.bos_id, *ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (padding, <s>, </s>, sentinels) are dropped unless asked for."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Texts of many id lists."""
        return self.backend.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    # ---- chat --------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for a conversation: `messages` ({"role": ..., "content": ...}) through the template.

        The template sees `messages`, `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`,
        ...), `raise_exception(message)` and any extra `variables` (e.g. `tools`). Encode the result with
        ``add_bos=False`` when the template writes the bos token itself.
        """
        if self.chat_template is None:
            raise DataError(
                "this tokenizer has no chat template; set tokenizer.chat_template to a Jinja string, or load a "
                "tokenizer whose tokenizer_config.json (or GGUF metadata) carries one"
            )
        template = _compile_chat_template(self.chat_template)
        tokens = {f"{role}_token": token for role, token in self.special_tokens.items()}
        try:
            return template.render(
                **tokens, **variables, messages=list(messages), add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as err:
            raise DataError(f"the chat template failed: {err}") from None

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        specials = ", ".join(f"{role}={token!r}" for role, token in self.special_tokens.items())
        return f"Tokenizer(vocab_size={self.vocab_size}, {specials}, sentinels={len(self.sentinel_ids)})"


# ---- helpers -----------------------------------------------------------------------------------------------------


def _has_tformer_layout(backend: HFTokenizer) -> bool:
    return all(backend.token_to_id(token) == i for i, token in enumerate(SPECIAL_TOKENS))


def _check_tformer_layout(backend: HFTokenizer) -> None:
    for expected, token in enumerate(SPECIAL_TOKENS):
        if backend.token_to_id(token) != expected:
            raise DataError(
                f"the tokenizer maps {token} to id {backend.token_to_id(token)}, but tformer needs {expected}; "
                "train one with tformer.data.Tokenizer.train so that <pad>, <s>, </s>, <unk>, <mask> are 0-4, "
                "or pass the tokenizer's own special_tokens"
            )


def _read_json(file: Path) -> dict[str, Any]:
    return read_mapping(file, DataError, "tokenizer settings") if file.is_file() else {}


def _token_text(value: Any, source: Path) -> str | None:
    """A special token as Hugging Face writes it: a string, an AddedToken dict with "content", or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise DataError(f"{source}: a special token must be a string or {{'content': ...}}, got {value!r}")


def _post_processor_adds(backend: HFTokenizer, bos: str | None) -> bool:
    if bos is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == backend.token_to_id(bos)


def _chat_template(config: dict[str, Any], directory: Path) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's (a string or named list)."""
    if (directory / CHAT_TEMPLATE_NAME).is_file():
        return (directory / CHAT_TEMPLATE_NAME).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON
    return json.dumps(value, ensure_ascii=False, indent=indent)


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise DataError(f"the chat template is not valid Jinja (line {err.lineno}): {err.message}") from None
