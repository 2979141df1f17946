"""`Translator`: a translation model with its tokenizer, as CTranslate2's `Translator` is: text in, text out.

`tformer translate`, `tformer eval`, the trainer's dev BLEU and the playground's /v1/translations all translate
through it, so a faster search or a new option reaches every caller at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from tformer.checkpoints import load_translation_model
from tformer.data.tokenizer import Tokenizer
from tformer.decoding.attention_map import CrossAttentionMap, cross_attention_map
from tformer.decoding.search import translate_ids
from tformer.errors import ConfigError
from tformer.kernels.quantize import check_precision, set_precision
from tformer.models import EncoderDecoder, LSTMEncoderDecoder


class Translator:
    """Translates sentences with an encoder-decoder: `translate_batch(sentences, beam_size, alpha)`."""

    def __init__(self, model: EncoderDecoder | LSTMEncoderDecoder, tokenizer: Tokenizer) -> None:
        if not model.config.is_seq2seq:
            raise ConfigError(
                f"translation needs an encoder-decoder model, got a '{model.config.family}' one; for a decoder "
                "use `tformer generate` or the Engine"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, path: str | os.PathLike[str], dtype: str = "auto", quantize: str | None = None) -> Translator:
        """The translator of a checkpoint directory, or of a training run's best checkpoint (else its latest).

        `dtype` (float32, bfloat16, float16, or auto: float32, bfloat16 when quantized) and `quantize` (int8, w8a8:
        the CPU's integer dot-product kernels, kernels/quantize.py) set the weights' precision as `tformer serve`
        does; the float32 default leaves the checkpoint's model as it is. docs/translation.md measures the BLEU
        and speed of each.
        """
        check_precision(dtype, quantize)
        model, tokenizer = load_translation_model(path)
        if dtype not in ("auto", "float32") or quantize is not None:
            set_precision(model, dtype, quantize)
        return cls(model, tokenizer)

    def translate_batch(
        self,
        sentences: Sequence[str],
        beam_size: int = 4,
        alpha: float = 0.6,
        batch_size: int = 32,
        patience: float | None = None,
        batch_tokens: int = 0,
        progress: Callable[[int], object] | None = None,
        workers: int | None = None,
    ) -> list[str]:
        """Translations of plain sentences, in input order (sentences are batched by length); greedy when
        `beam_size` is 1; `alpha` is the length penalty's exponent, ((5 + len) / 6) ** alpha.

        `patience` None searches exactly (until no live beam can beat the best finished hypothesis); a number p
        stops a sentence once round(beam_size * p) hypotheses have finished, as CTranslate2's `patience`. A batch
        holds at most `batch_size` sentences and, with `batch_tokens`, that many padded source tokens. `progress(n)`
        is called as each batch of n sentences is done (a progress bar's `update`). `workers` > 1 searches that many
        batches at once, torch's threads shared among them (`translate_ids`; None: one per CPU thread, at most 4).
        """
        tokenizer = self.tokenizer
        sources = tokenizer.encode_batch(list(sentences))
        ids = translate_ids(
            self.model,
            sources,
            tokenizer.bos_id,
            tokenizer.eos_id,
            tokenizer.pad_id,
            beam_size,
            alpha,
            batch_size,
            patience=patience,
            batch_tokens=batch_tokens,
            progress=progress,
            workers=workers,
        )
        return tokenizer.decode_batch(ids)

    def translate_with_attention(self, sentence: str, beam_size: int = 1, alpha: float = 0.6) -> CrossAttentionMap:
        """One sentence's translation with the cross-attention weights of each output token (the playground's
        map, `tformer viz attention`)."""
        return cross_attention_map(self.model, self.tokenizer, sentence, beam_size, alpha)
