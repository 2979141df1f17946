"""A joint byte-level BPE tokenizer (GPT-2 style), trained with Hugging Face `tokenizers`.

Byte-level BPE starts from the 256 byte values, so every string encodes without <unk> and decodes back
exactly (after NFC normalisation): German umlauts and ß are two UTF-8 bytes each and become single tokens
once merged. A space is prepended to each text so that a word is the same token at the start of a sentence
and in the middle; the decoder strips it again. The saved `tokenizer.json` carries the whole pipeline, so
`tokenizers.Tokenizer.from_file` (or `transformers.PreTrainedTokenizerFast`) reads it the same way.

Special tokens have fixed ids: <pad>=0, <s>=1 (bos), </s>=2 (eos), <unk>=3, <mask>=4. Trained with
``num_sentinels=n``, the vocabulary's top n ids are T5's sentinels: <extra_id_0> is ``vocab_size - 1``,
<extra_id_1> is ``vocab_size - 2``, and so on (`sentinel_ids` lists them in that order).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from tformer.data.readers import DataError

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<mask>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = range(len(SPECIAL_TOKENS))
FILE_NAME = "tokenizer.json"


def sentinel_token(i: int) -> str:
    """The text of T5 sentinel number i, e.g. <extra_id_0>."""
    return f"<extra_id_{i}>"


class Tokenizer:
    """Text <-> token ids with the project's fixed special-token ids; a thin wrapper of `tokenizers.Tokenizer`."""

    def __init__(self, backend: HFTokenizer) -> None:
        for expected, token in enumerate(SPECIAL_TOKENS):
            if backend.token_to_id(token) != expected:
                raise DataError(
                    f"the tokenizer maps {token} to id {backend.token_to_id(token)}, but tformer needs {expected}; "
                    "train one with tformer.data.Tokenizer.train so that <pad>, <s>, </s>, <unk>, <mask> are 0-4"
                )
        self.backend = backend

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

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a tokenizer from a directory holding tokenizer.json, or from the json file itself."""
        path = Path(path)
        file = path if path.suffix == ".json" else path / FILE_NAME
        if not file.is_file():
            raise DataError(f"{file}: no such file; pass a directory holding {FILE_NAME} (from Tokenizer.save)")
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as err:  # noqa: BLE001 -- tokenizers raises a bare Exception for malformed files
            raise DataError(f"{file}: not a valid tokenizer.json ({err})") from None
        return cls(backend)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write tokenizer.json into `directory` (created if needed) and return the file's path."""
        file = Path(directory) / FILE_NAME
        file.parent.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(file))
        return file

    # ---- ids of the special tokens -----------------------------------------------------------------------------

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    unk_id = UNK_ID
    mask_id = MASK_ID

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
        """All ids that stand for no text: the five specials and the sentinels."""
        return list(range(len(SPECIAL_TOKENS))) + self.sentinel_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (byte-level form, e.g. "Ġthe" for " the"), or None."""
        return self.backend.token_to_id(token)

    # ---- encoding and decoding ---------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without <s> or </s> (the collators and objectives add those)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel by the Rust backend."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (padding, <s>, </s>, sentinels) are dropped unless asked for."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Texts of many id lists."""
        return self.backend.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, sentinels={len(self.sentinel_ids)})"
