"""`load_engine`: a model file or directory, loaded and put in the precision asked for, behind an `Engine`.

`tformer generate` and `tformer serve` both start here; this module imports no web framework.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch
from torch import nn

from tformer.checkpoints import load_pretrained
from tformer.data.tokenizer import Tokenizer
from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.engine.embedding import EmbeddingEngine, Pooling
from tformer.errors import ConfigError
from tformer.interop.gguf import (
    STORED_PRECISION,
    StoredLinear,
    from_gguf,
    is_gguf,
    open_gguf,
    stored_head,
    stored_linears,
    stored_precision,
)
from tformer.interop.gguf_file import GGUFFile
from tformer.interop.gguf_tokenizer import tokenizer_from_gguf
from tformer.kernels.dispatch import resolve_device
from tformer.kernels.int4 import BLOCK as INT4_BLOCK
from tformer.kernels.int4 import TILE as INT4_TILE
from tformer.kernels.kquant import fits
from tformer.kernels.q4k import Q4KLinear
from tformer.kernels.q6k import Q6KLinear
from tformer.kernels.quantize import (
    WEIGHT_DTYPES,
    Int4Linear,
    Int8Linear,
    check_precision,
    resolve_dtype,
    set_precision,
    tie_quantized_embeddings,
)
from tformer.layers.ffn import Router
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
    device: str | torch.device = "cpu",
) -> Engine | EmbeddingEngine:
    """An engine for the model at `path` (a .gguf file, a tformer checkpoint, a Hugging Face or a run directory)
    in `dtype`, optionally with its linear layers quantized ('int8', 'int4' or 'w8a8'; see `set_precision`), and
    with a draft model for speculative decoding when `draft_path` names one (it may be the same file, quantized).
    An encoder, which generates nothing, is served for embeddings alone (an `EmbeddingEngine`, with a
    sentence-transformers directory's own pooling) where `embeddings_only` allows it, and is a ConfigError elsewhere.
    `quantize` 'auto' serves a GGUF file as stored (each layer in the kernel its type maps to, `load_quantized`;
    the rest as `stored_precision` says of the file) and anything else in floats; 'none' is floats. The model
    runs on `device` (cpu, cuda, ...; `dispatch.resolve_device` checks it before the load): the engine, its KV
    pool and its kernels follow it."""
    device = resolve_device(device)
    as_stored, draft_as_stored = quantize == "auto", draft_quantize == "auto"
    # a GGUF file served quantized is opened once for both questions: reading its header takes a tenth of a second
    reader = open_gguf(path) if quantize in ("auto", "int4", "int8") and is_gguf(path) else None
    quantize, draft_quantize = (
        stored_quantization(path, quantize, reader),
        stored_quantization(draft_path, draft_quantize),
    )
    check_precision(dtype, quantize)  # before the (slow) loads
    check_precision(dtype, draft_quantize)
    if draft_quantize is not None and draft_path is None:
        raise ConfigError(
            "a draft quantization needs a draft model (--draft-model); name the served model itself "
            "to draft with a quantized copy of it"
        )
    model, tokenizer = load_quantized(path, quantize, dtype, as_stored, reader)
    del reader  # its memory map holds every page the load read: resident until the map closes
    set_precision(model, dtype, quantize).to(device)
    if isinstance(model, EncoderMLM):
        if not embeddings_only or draft_path is not None:
            raise ConfigError(
                f"{path} is an encoder ({model.config.encoder_head} head): it embeds text and generates none; use "
                "`tformer embed`, or `tformer serve` (without a draft model) for /v1/embeddings"
            )
        return EmbeddingEngine(model, tokenizer, Pooling.default_for(model, path))
    draft = None
    if draft_path is not None:
        draft, _ = load_quantized(draft_path, draft_quantize, dtype, draft_as_stored)
        set_precision(draft, dtype, draft_quantize).to(device)
    release_freed_memory()
    return Engine(model, tokenizer, engine_config, draft=draft)


def release_freed_memory() -> None:
    """Hands the memory freed by the load back to the system (glibc's `malloc_trim`; nothing elsewhere).

    Building the kernels' layouts frees many temporaries of a few MB each, which glibc keeps in its heap,
    fragmented, after the first large free raises its threshold for serving them from fresh mappings: half a GB
    of resident memory for a Llama-3.2-1B Q4_K_M file (benchmarks/README.md, "GGUF memory")."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # another C library (musl): it has no malloc_trim
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def stored_quantization(
    path: str | os.PathLike[str] | None, quantize: str | None, reader: GGUFFile | None = None
) -> str | None:
    """`quantize` for `set_precision`: 'auto' becomes what a GGUF file stores (None for other models), 'none'
    None. `reader`, if given, is the GGUF file at `path` already open."""
    if quantize == "none":
        return None
    if quantize != "auto":
        return quantize
    if reader is None and path is not None and is_gguf(path):
        reader = open_gguf(path)
    return stored_precision(reader) if reader is not None else None


def load_quantized(
    path: str | os.PathLike[str],
    quantize: str | None,
    dtype: str = "auto",
    as_stored: bool = False,
    reader: GGUFFile | None = None,
) -> tuple[TransformerModel, Tokenizer | None]:
    """The model for `set_precision(model, dtype, quantize)` to finish, loaded with no copy it would throw away.

    Unquantized weights load in the serving dtype itself. INT4 and INT8 from a GGUF file are built from each
    layer's blocks (`stored_layer`), with no float copy of the model; with `as_stored` (`--quantize auto`) each
    layer takes the kernel its own type maps to (`STORED_PRECISION`: a Q4_K_M file's Q4_K and Q6_K layers as
    stored, but MoE experts' Q4_K INT4, which multiplies groups of experts in one call), else every layer takes
    `quantize`. The output head is built from its blocks too (`stored_head`): as stored where it is Q6_K and
    `as_stored`, else INT8; a tied embedding reads its rows from it.
    Other quantizations read float32 weights (rounding them once)."""
    if quantize is None:
        return load_pretrained(path, WEIGHT_DTYPES[resolve_dtype(dtype, quantize)])
    if quantize not in ("int4", "int8") or not is_gguf(path):
        return load_pretrained(path)
    reader = open_gguf(path) if reader is None else reader
    stored = stored_linears(reader)
    head = stored_head(reader)
    head_names = [] if head is None else ["lm_head.weight", *([head[1]] if head[1] else [])]
    model = from_gguf(path, reader, leave_out=[*stored, *head_names])
    for name, weight in stored.items():
        parent, _, child = name.removesuffix(".weight").rpartition(".")
        module = model.get_submodule(parent)
        if isinstance(getattr(module, child), Router):  # stays float, as `quantize` keeps it: it picks the experts
            getattr(module, child).weight = nn.Parameter(weight.floats())
            continue
        kind = STORED_PRECISION.get(weight.kind, quantize) if as_stored else quantize
        if kind == "q4k" and ".experts." in name:  # MoE experts multiply in groups: `Int4Linear.grouped`
            kind = "int4"
        setattr(module, child, stored_layer(weight, kind, getattr(module, child).bias))
    if head is not None:  # Q6_K as stored or INT8 as `quantize` makes a head, and a tied embedding's rows from it
        blocks, embedding = head
        table = None if embedding is None else model.get_submodule(embedding.removesuffix(".weight"))
        kind = STORED_PRECISION.get(blocks.kind) if as_stored else None
        model.lm_head = stored_layer(blocks, "q6k" if kind == "q6k" else "int8", model.lm_head.bias)
        if table is not None:
            tie_quantized_embeddings(model, {id(table.weight): model.lm_head})
    return model, tokenizer_from_gguf(path, reader)


def stored_layer(
    weight: StoredLinear, kind: str, bias: torch.Tensor | None = None
) -> Int4Linear | Int8Linear | Q4KLinear | Q6KLinear:
    """An 'int4', 'int8', 'q4k' or 'q6k' layer from a GGUF weight's blocks. 'q4k' and 'q6k' take Q4_K and Q6_K
    blocks as they are (`Q4KLinear`, `Q6KLinear`); a 'q4k' weight that does not fit is INT4. INT4 takes Q4_0, Q4_1
    and Q4_K groups as they are (their fp16 scale and minimum per 32 weights; Q4_K's d * scale is rounded to fp16 on
    the way) and requantizes other types' dequantized rows in groups of 32.
    INT8 requantizes the rows to one scale per row, as the float path would. A weight INT4's or Q6_K's kernel
    cannot take (out features not a multiple of 16; for Q6_K also another type) is INT8."""
    out_f, in_f = weight.shape
    if kind == "q4k" and STORED_PRECISION.get(weight.kind) == "q4k" and fits(out_f, in_f):
        return Q4KLinear.from_blocks(weight.rows, weight.shape, bias, weight.name)
    kind = "int4" if kind == "q4k" else kind
    if kind == "int4" and out_f % INT4_TILE == 0 and in_f % INT4_BLOCK == 0:
        groups = weight.int4_groups()
        if groups is not None:
            return Int4Linear.from_groups(*groups, bias=bias)
        return Int4Linear.from_chunks(weight.chunks(), bias=bias)
    if kind == "q6k" and STORED_PRECISION.get(weight.kind) == "q6k" and fits(out_f, in_f):
        return Q6KLinear.from_blocks(weight.rows, weight.shape, bias, weight.name)
    return Int8Linear.from_chunks(weight.chunks(), bias=bias)


def warm_up(engine: Engine) -> None:
    """Runs one single request and then two together, so that a compiled engine compiles its batch-1 and its
    batched decode step now rather than on its first clients' time (torch.compile caches both on disk)."""
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.generate([[1, 2, 3]], params)
    engine.generate([[1, 2, 3], [4, 5]], params)
