"""`load_engine`: a model file or directory, loaded and put in the precision asked for, behind an `Engine`.

`tformer generate` and `tformer serve` both start here; this module imports no web framework.
"""

from __future__ import annotations

import os

from tformer.checkpoints import load_pretrained
from tformer.data.tokenizer import Tokenizer
from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.engine.embedding import EmbeddingEngine, Pooling
from tformer.errors import ConfigError
from tformer.interop.gguf import from_gguf, is_gguf, open_gguf, q4_1_linears, stored_precision
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf
from tformer.kernels.quantize import WEIGHT_DTYPES, Int4Linear, check_precision, resolve_dtype, set_precision
from tformer.models import TransformerModel
from tformer.models.families import EncoderMLM


def load_engine(
    path: str | os.PathLike[str],
    engine_config: EngineConfig | None = None,
    quantize: str | None = None,
    dtype: str = "auto",
    draft_path: str | os.PathLike[str] | None = None,
    draft_quantize: str | None = None,
    embeddings_only: bool = False,
) -> Engine | EmbeddingEngine:
    """An engine for the model at `path` (a .gguf file, a tformer checkpoint, a Hugging Face or a run directory)
    in `dtype`, optionally with its linear layers quantized ('int8', 'int4' or 'w8a8'; see `set_precision`), and
    with a draft model for speculative decoding when `draft_path` names one (it may be the same file, quantized).
    An encoder, which generates nothing, is served for embeddings alone (an `EmbeddingEngine`, with a
    sentence-transformers directory's own pooling) where `embeddings_only` allows it, and is a ConfigError elsewhere.
    `quantize` 'auto' serves a GGUF file as stored (`stored_precision`: a 4- or 5-bit file in INT4, a 6- or 8-bit
    one in INT8) and anything else in floats; 'none' is floats."""
    quantize, draft_quantize = stored_quantization(path, quantize), stored_quantization(draft_path, draft_quantize)
    check_precision(dtype, quantize)  # before the (slow) loads
    check_precision(dtype, draft_quantize)
    if draft_quantize is not None and draft_path is None:
        raise ConfigError(
            "a draft quantization needs a draft model (--draft-model); name the served model itself "
            "to draft with a quantized copy of it"
        )
    model, tokenizer = load_quantized(path, quantize, dtype)
    set_precision(model, dtype, quantize)
    if isinstance(model, EncoderMLM):
        if not embeddings_only or draft_path is not None:
            raise ConfigError(
                f"{path} is an encoder ({model.config.encoder_head} head): it embeds text and generates none; use "
                "`tformer embed`, or `tformer serve` (without a draft model) for /v1/embeddings"
            )
        return EmbeddingEngine(model, tokenizer, Pooling.default_for(model, path))
    draft = None
    if draft_path is not None:
        draft, _ = load_quantized(draft_path, draft_quantize, dtype)
        set_precision(draft, dtype, draft_quantize)
    return Engine(model, tokenizer, engine_config, draft=draft)


def stored_quantization(path: str | os.PathLike[str] | None, quantize: str | None) -> str | None:
    """`quantize` for `set_precision`: 'auto' becomes what a GGUF file stores (None for other models), 'none'
    None."""
    if quantize == "none":
        return None
    if quantize != "auto":
        return quantize
    return stored_precision(open_gguf(path)) if path is not None and is_gguf(path) else None


def load_quantized(
    path: str | os.PathLike[str], quantize: str | None, dtype: str = "auto"
) -> tuple[TransformerModel, Tokenizer | None]:
    """The model for `set_precision(model, dtype, quantize)` to finish, loaded with no copy it would throw away.

    Unquantized weights load in the serving dtype itself. Quantization reads float32 weights (rounding them
    once), except INT4 from a GGUF file: its Q4_1 blocks become `Int4Linear`s as they are, with no float copy
    and no second rounding. Layers whose output size the INT4 kernel cannot take (a multiple of 16) load as
    floats and quantize later."""
    if quantize is None:
        return load_pretrained(path, WEIGHT_DTYPES[resolve_dtype(dtype, quantize)])
    if quantize != "int4" or not is_gguf(path):
        return load_pretrained(path)
    reader = open_gguf(path)
    groups = {name: parts for name, parts in q4_1_linears(reader).items() if parts[0].shape[0] % 16 == 0}
    model = from_gguf(path, reader, leave_out=groups.keys())
    for name, (q, scales, minimums) in groups.items():
        parent, _, child = name.removesuffix(".weight").rpartition(".")
        setattr(model.get_submodule(parent), child, Int4Linear.from_groups(q, scales, minimums))
    return model, tokenizer_from_gguf(path, reader)


def warm_up(engine: Engine) -> None:
    """Runs one single request and then two together, so that a compiled engine compiles its batch-1 and its
    batched decode step now rather than on its first clients' time (torch.compile caches both on disk)."""
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.generate([[1, 2, 3]], params)
    engine.generate([[1, 2, 3], [4, 5]], params)
