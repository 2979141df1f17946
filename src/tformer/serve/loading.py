"""`load_engine`: a model file or directory, loaded and put in the precision asked for, behind an `Engine`.

`tformer generate` and `tformer serve` both start here; this module imports no web framework.
"""

from __future__ import annotations

import os

from tformer.errors import ConfigError
from tformer.inference import Engine, EngineConfig
from tformer.inference.quantize import check_precision, set_precision
from tformer.interop.loading import load_pretrained


def load_engine(
    model: str | os.PathLike[str],
    engine_config: EngineConfig | None = None,
    quantize: str | None = None,
    dtype: str = "auto",
    draft_model: str | os.PathLike[str] | None = None,
    draft_quantize: str | None = None,
) -> Engine:
    """An engine for `model` (a .gguf file, a tformer checkpoint or a Hugging Face directory) in `dtype`,
    optionally with its linear layers quantized ('int8', 'int4' or 'w8a8'; see `set_precision`), and with a draft
    model for speculative decoding when `draft_model` names one (it may be the same file, quantized)."""
    check_precision(dtype, quantize)  # before the (slow) loads
    check_precision(dtype, draft_quantize)
    if draft_quantize is not None and draft_model is None:
        raise ConfigError("a draft quantization needs a draft model (--draft-model); name the served model itself "
                          "to draft with a quantized copy of it")
    net, tokenizer = load_pretrained(model)
    set_precision(net, dtype, quantize)
    draft = None
    if draft_model is not None:
        draft, _ = load_pretrained(draft_model)
        set_precision(draft, dtype, draft_quantize)
    return Engine(net, tokenizer, engine_config, draft=draft)
