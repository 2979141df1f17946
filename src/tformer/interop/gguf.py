"""Load GGUF files (llama.cpp's format) into tformer models: llama (Llama 3's scaled RoPE and Mixtral too),
mistral, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2, gemma3 and gpt2.

A GGUF file is a header of typed key/value metadata, a table of tensor descriptions and the tensor bytes,
which are memory-mapped and dequantized (`gguf_file`, `gguf_quants`). A tensor's shape is listed innermost
dimension first (ggml's ne[0] is the row length), so a (out, in) weight is described as [in, out].

Each architecture's metadata and tensors are read back into the Hugging Face checkpoint llama.cpp's converter
started from (`gguf_arch`: renames, llama's q/k row permutation undone, Gemma's norm offsets, ...), and the
Hugging Face family of `hf_decoders` builds the tformer model from that, so that one table per family says
what its config and weights mean. Nothing is ever unpickled. Foreign tensor names (`blk.N.attn_q.weight`, ...)
appear only in this package.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tformer.config import ConfigError, ModelConfig
from tformer.interop.gguf_arch import (
    ARCHITECTURES,
    LLAMA_PERMUTED,
    MIXTRAL,
    Architecture,
    Transform,
    llama3_rope,
    unpermute_rope_rows,
)
from tformer.interop.gguf_file import GGUF_MAGIC, GGUFFile, Malformed, TensorInfo, Truncated
from tformer.interop.gguf_quants import DEQUANTIZERS, INT4_GROUPS
from tformer.interop.hf import FAMILIES as HF_FAMILIES
from tformer.interop.hf import expected_shapes, hf_fields, read_state
from tformer.interop.hf_files import listed
from tformer.interop.hf_spec import COPY, Family, Table
from tformer.models import CheckpointError, DecoderLM, assign_weights, build_model

__all__ = ["unpermute_rope_rows"]  # re-exported: tests and tools undo llama.cpp's permutation with it

Q = GGMLQuantizationType
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_TYPES = tuple(DEQUANTIZERS)  # each dequantized in vectorized torch (gguf_quants)
REQUIRED_METADATA = ("embedding_length", "block_count", "attention.head_count")
ROPE_SCALING_TYPES = ("none", "linear", "yarn")
ROPE_FREQS = "rope_freqs.weight"
LLAMA3_ORIGINAL_CONTEXT = 8192  # Llama 3.x's; see `llama3_rope`
# the serving kernel of each type's layers: Q4_K and Q6_K their own blocks as stored (`kernels/q4k.py`, `q6k.py`),
# the other 2-4 bits a weight INT4, 5 to 8 bits INT8. 5 bits do not fit INT4, and requantizing them to 4 costs
# far more perplexity than INT8's one scale a row (docs/interop.md)
STORED_PRECISION: dict[GGMLQuantizationType, str] = {
    **dict.fromkeys((Q.Q2_K, Q.Q3_K, Q.Q4_0, Q.Q4_1), "int4"),
    Q.Q4_K: "q4k",
    **dict.fromkeys((Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q8_0), "int8"),
    Q.Q6_K: "q6k",
}
# the whole-model mode (`set_precision`'s) a layer kernel stands for: the layers of a file that the file's blocks
# do not build (a float tensor in a Q6_K file) are quantized to INT8
FILE_PRECISION = {"int4": "int4", "int8": "int8", "q4k": "int4", "q6k": "int8"}
ROW_TRANSFORMS = tuple(LLAMA_PERMUTED.values())  # transforms that move whole rows, which quantized blocks allow


class GGUFError(CheckpointError):
    """A GGUF file is not GGUF, is truncated or corrupt, or holds something this loader does not support."""


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """A reader for the GGUF file at `path` (memory-mapped), or a GGUFError saying what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file; pass the path of a .gguf file")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file: it starts with {magic!r}, not the magic {GGUF_MAGIC!r}")
    try:
        return GGUFFile(path)
    except Truncated as err:
        raise GGUFError(
            f"{path} is truncated: reading bytes {err.start}..{err.end} of a {size}-byte file; "
            "the download or copy was probably cut short, fetch the file again"
        ) from None
    except (Malformed, ValueError, KeyError, OverflowError) as err:
        raise GGUFError(f"{path}: corrupt or unsupported GGUF header: {err}") from None


def metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (a number, string, bool or list), or `default` when absent."""
    return reader.get(key, default)


def architecture_of(reader: GGUFFile, path: str | os.PathLike[str]) -> tuple[str, Architecture]:
    """`general.architecture` and its description; a `llama` file with experts is a Mixtral."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if arch == "llama" and (metadata(reader, "llama.expert_count") or 0) > 0:
        return arch, MIXTRAL
    return arch, ARCHITECTURES[arch]


def hf_config_from_gguf(reader: GGUFFile, path: str | os.PathLike[str]) -> tuple[Architecture, dict[str, Any]]:
    """The file's architecture and the Hugging Face config.json its metadata describe."""
    arch_name, arch = architecture_of(reader, path)

    def meta(key: str) -> Any:
        return metadata(reader, f"{arch_name}.{key}")

    missing = [f"{arch_name}.{key}" for key in REQUIRED_METADATA if meta(key) is None]
    if missing:
        raise GGUFError(f"{path}: metadata {', '.join(missing)} missing; the file is incomplete")
    config: dict[str, Any] = {"architectures": [arch.hf_architecture], "model_type": arch.model_type, **arch.fixed}
    for key, hf_key in arch.metadata.items():
        value = meta(key)
        if isinstance(value, list):
            raise GGUFError(f"{path}: {arch_name}.{key} differs per layer ({value[:4]}...), which tformer cannot build")
        if value is not None:
            config[hf_key] = value
    config.setdefault("vocab_size", _token_count(reader))
    config["tie_word_embeddings"] = _tied(reader)
    for key in ("bos", "eos", "padding"):
        token_id = metadata(reader, f"tokenizer.ggml.{key}_token_id")
        if isinstance(token_id, int) and config["vocab_size"] and 0 <= token_id < config["vocab_size"]:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = token_id
    if arch.rope:
        config["rope_parameters"] = _rope_parameters(reader, arch_name, config, path)
    if arch.extra is not None:
        try:
            config |= arch.extra(meta, config)
        except (ValueError, KeyError, TypeError) as err:
            raise GGUFError(f"{path}: the {arch_name} metadata describe no valid model: {err}") from None
    return arch, config


def _token_count(reader: GGUFFile) -> int | None:
    """The vocabulary's size from the tokenizer, else from the embedding's rows."""
    tokens = reader.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    return None if embedding is None else embedding.torch_shape[0]


def _tied(reader: GGUFFile) -> bool:
    """Whether the output projection is the token embedding: no `output.weight`, or (llama.cpp's gpt2) a byte
    for byte copy of it."""
    by_name = {t.name: t for t in reader.tensors}
    output, embedding = by_name.get("output.weight"), by_name.get("token_embd.weight")
    if output is None:
        return True
    if embedding is None or (output.shape, output.tensor_type) != (embedding.shape, embedding.tensor_type):
        return False
    return torch.equal(reader.raw(output), reader.raw(embedding))


def _rope_parameters(
    reader: GGUFFile, arch: str, config: dict[str, Any], path: str | os.PathLike[str]
) -> dict[str, Any]:
    """config.json's rope_parameters: the base, and the scaling from rope.scaling.* or llama3's rope_freqs."""
    theta = config.pop("rope_theta", 10000.0)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary = metadata(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise GGUFError(f"{path}: RoPE rotates {rotary} of {head_dim} head dimensions; tformer rotates all of them")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = metadata(reader, f"{arch}.rope.scaling.type")
    if kind is None and (linear := metadata(reader, f"{arch}.rope.scale_linear")) is not None:
        kind, params["factor"] = "linear", linear  # older files
    elif kind is not None and kind not in ROPE_SCALING_TYPES:
        raise GGUFError(f"{path}: RoPE scaling {kind!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}")
    scaling = {key: metadata(reader, f"{arch}.rope.scaling.{key}") for key in ("factor", "original_context_length")}
    if kind in ("linear", "yarn"):
        params |= {"rope_type": kind, "factor": scaling["factor"] or params.get("factor", 1.0)}
    if kind == "yarn":
        params["original_max_position_embeddings"] = scaling["original_context_length"] or config.get(
            "max_position_embeddings"
        )
        for key in ("beta_fast", "beta_slow"):
            if (value := metadata(reader, f"{arch}.rope.scaling.yarn_{key}")) is not None:
                params[key] = value
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None and kind in (None, "none"):
        original = scaling["original_context_length"] or LLAMA3_ORIGINAL_CONTEXT
        llama3 = llama3_rope(reader.dequantize(freqs).flatten(), theta, head_dim, original)
        if llama3 is None:
            raise GGUFError(
                f"{path}: tensor {ROPE_FREQS} holds per-frequency RoPE divisors that match no Llama 3 scaling, "
                "which is the only kind tformer reads from it"
            )
        params |= llama3
    elif freqs is not None:
        raise GGUFError(f"{path}: tensor {ROPE_FREQS} together with RoPE scaling {kind!r} is not supported")
    return params


def hf_family(arch: Architecture, path: str | os.PathLike[str]) -> Family:
    """The Hugging Face family that builds `arch`'s models, or a GGUFError naming it as unsupported."""
    if arch.hf_architecture not in HF_FAMILIES:
        buildable = [name for name, a in ARCHITECTURES.items() if a.hf_architecture in HF_FAMILIES]
        raise GGUFError(
            f"{path}: this GGUF model is a {arch.hf_architecture}, which tformer cannot build yet; "
            f"supported GGUF architectures: {', '.join(buildable)} (and llama files with experts, if Mixtral is)"
        )
    return HF_FAMILIES[arch.hf_architecture]


def config_from_gguf(reader: GGUFFile, path: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig that the file's metadata and tensor list describe."""
    arch, hf_config = hf_config_from_gguf(reader, path)
    return _model_config(hf_family(arch, path), hf_config, path)


def _model_config(family: Family, hf_config: dict[str, Any], path: str | os.PathLike[str]) -> ModelConfig:
    try:
        return ModelConfig(**hf_fields(family, hf_config))
    except (ConfigError, CheckpointError) as err:
        raise GGUFError(f"{path}: the GGUF metadata describe a model tformer cannot build: {err}") from None


class GGUFTensors:
    """A GGUF file's tensors under Hugging Face names, dequantized on demand (the interface of
    `hf_files.Weights` that `hf.read_state` reads): renamed, transformed back, and 3-D expert tensors split
    into one matrix per expert (read straight from that expert's bytes)."""

    def __init__(self, reader: GGUFFile, arch: Architecture, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        self.reader, self.arch, self.hf_config, self.dtype = reader, arch, hf_config, dtype
        self.sources: dict[str, tuple[TensorInfo, Transform | None]] = {}
        self.gguf_name: dict[str, str] = {}  # HF name -> the GGUF tensor it comes from
        self.unknown: list[str] = []  # GGUF tensors this architecture has no place for
        for tensor in reader.tensors:
            if tensor.name in arch.consumed or (tensor.name == "output.weight" and hf_config["tie_word_embeddings"]):
                continue  # read into config.json, or a copy of the embedding (`_tied`)
            for hf_name, source, transform in self._resolve(tensor):
                self.sources[hf_name] = (source, transform)
                self.gguf_name[hf_name] = tensor.name
        self.names = set(self.sources)
        self.file_of = dict.fromkeys(self.names, reader.path)

    def _resolve(self, tensor: TensorInfo) -> list[tuple[str, TensorInfo, Transform | None]]:
        stem, dot, suffix = tensor.name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            self.unknown.append(tensor.name)
            return []
        layer, short = None, stem
        if stem.startswith("blk.") and stem.count(".") >= 2 and stem.split(".")[1].isdigit():
            _, layer, short = stem.split(".", 2)
        transform = self.arch.transform_for(f"{short}.{suffix}")
        if layer is None and short in self.arch.global_tensors:
            return [(f"{self.arch.global_tensors[short]}.{suffix}", tensor, transform)]
        prefix = f"{self.arch.layer_prefix}{layer}."
        if layer is not None and short in self.arch.layer_tensors:
            return [(f"{prefix}{self.arch.layer_tensors[short]}.{suffix}", tensor, transform)]
        if layer is not None and short in self.arch.experts and len(tensor.shape) == 3:
            n_experts, step = tensor.shape[2], tensor.n_bytes // tensor.shape[2]
            return [
                (
                    f"{prefix}{self.arch.experts[short].format(j=j)}.{suffix}",
                    replace(
                        tensor,
                        name=f"{tensor.name}[{j}]",
                        shape=tensor.shape[:2],
                        start=tensor.start + j * step,
                        n_bytes=step,
                    ),
                    transform,
                )
                for j in range(n_experts)
            ]
        self.unknown.append(tensor.name)
        return []

    def shape(self, name: str) -> tuple[int, ...]:
        source, transform = self.sources[name]
        meta = torch.empty(source.torch_shape, device="meta")
        return tuple((meta if transform is None else transform(meta, self.hf_config)).shape)

    def get(self, name: str) -> torch.Tensor:
        source, transform = self.sources[name]
        value = dequantize_tensor(self.reader, source)
        value = value if transform is None else transform(value, self.hf_config)
        return value.to(self.dtype)


def dequantize_tensor(reader: GGUFFile, tensor: TensorInfo) -> torch.Tensor:
    """One tensor as float32, in PyTorch's dimension order (outermost first)."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise GGUFError(
            f"{reader.path}: unsupported quantization type {tensor.tensor_type.name} for {tensor.name}; "
            f"supported: {supported}; re-quantize the model to one of these"
        )
    return reader.dequantize(tensor)


def _table(family: Family, config: ModelConfig) -> Table:
    base, head = family.tensors(config)
    return {family.prefixes[0] + name: entry for name, entry in base.items()} | head


def _check_tensors(weights: GGUFTensors, table: Table, expected: dict[str, tuple[int, ...]], path: Any) -> None:
    """GGUFErrors in the file's own terms: unknown, missing and misshaped tensors by their GGUF names."""
    arch = weights.arch.model_type
    if weights.unknown:
        raise GGUFError(
            f"{path}: unexpected tensors {listed(weights.unknown)}: a GGUF {arch} model has no such weights"
        )
    missing = sorted(name for name in table if name not in weights.names and not _optional(table[name]))
    if missing:
        ours = table[missing[0]] if isinstance(table[missing[0]], str) else ", ".join(table[missing[0]][0])
        raise GGUFError(
            f"{path}: missing tensor {_gguf_name(weights.arch, missing[0])} (tformer's {ours})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + "; the file is incomplete or its block_count metadata is wrong"
        )
    extra = sorted(set(weights.names) - set(table))
    if extra:
        raise GGUFError(
            f"{path}: unexpected tensors {listed(sorted({weights.gguf_name[n] for n in extra}))}: "
            f"the {arch} model its metadata describe has no such weights"
        )
    for name in table:
        if name in weights.names and weights.shape(name) != expected[name]:
            source, _ = weights.sources[name]
            raise GGUFError(
                f"{path}: {source.name} has shape {list(source.torch_shape)}, but the metadata imply "
                f"{list(expected[name])} for Hugging Face's {name}; the file's metadata and tensors disagree"
            )


def _optional(entry: Any) -> bool:
    return not isinstance(entry, str) and entry[1] is COPY


def _gguf_name(arch: Architecture, hf_name: str) -> str:
    """The GGUF name an HF tensor would have (for messages)."""
    stem, _, suffix = hf_name.rpartition(".")
    for short, hf in arch.global_tensors.items():
        if stem == hf:
            return f"{short}.{suffix}"
    if stem.startswith(arch.layer_prefix):
        layer, _, rest = stem.removeprefix(arch.layer_prefix).partition(".")
        for short, hf in {**arch.layer_tensors, **arch.experts}.items():
            if rest == hf or (short in arch.experts and rest.startswith(hf.split("{j}")[0])):
                return f"blk.{layer}.{short}.{suffix}"
    return hf_name


def from_gguf(
    path: str | os.PathLike[str],
    reader: GGUFFile | None = None,
    leave_out: Collection[str] = (),
    dtype: torch.dtype = torch.float32,
) -> DecoderLM:
    """A tformer model (in `dtype`, on the CPU, in eval mode) with the weights of a GGUF file.

    The model is built without initializing its weights; each is dequantized straight into place. Parameters
    named in `leave_out` stay on the meta device, for a caller that replaces their modules (quantized layers
    built from `stored_linears`).
    """
    reader = reader or open_gguf(path)
    arch, hf_config = hf_config_from_gguf(reader, path)
    family = hf_family(arch, path)
    config = _model_config(family, hf_config, path)
    model = build_model(config, initialize=False).to(dtype)  # free on the meta device
    table = _table(family, config)
    weights = GGUFTensors(reader, arch, hf_config, dtype)
    _check_tensors(weights, table, expected_shapes(model, table), path)
    wanted = {
        name: entry
        for name, entry in table.items()
        if not all(ours in leave_out for ours in ((entry,) if isinstance(entry, str) else entry[0]))
    }
    state = read_state(weights, wanted, family, model)
    missing, unexpected, mismatched = assign_weights(model, state)
    if set(missing) - set(leave_out) or unexpected or mismatched:
        raise RuntimeError(f"GGUF tensors left {missing} unset, {unexpected} unknown, {mismatched} misshaped")
    return model.eval()


def linear_sources(reader: GGUFFile) -> dict[str, tuple[TensorInfo, Transform | None]]:
    """tformer parameter name -> (GGUF tensor, row transform) of each layer's linear weight that a tformer
    parameter takes whole (no split, no transpose; llama.cpp's q/k row permutation, which moves whole rows, is
    the only transform): the weights a quantized layer can take straight from the file's blocks."""
    arch, hf_config = hf_config_from_gguf(reader, reader.path)
    family = hf_family(arch, reader.path)
    table = _table(family, _model_config(family, hf_config, reader.path))
    weights = GGUFTensors(reader, arch, hf_config, torch.float32)
    sources = {}
    for hf_name, entry in table.items():
        if (
            not isinstance(entry, str)
            or hf_name not in weights.names
            or not weights.gguf_name[hf_name].startswith("blk.")
        ):
            continue
        source, transform = weights.sources[hf_name]
        if len(source.shape) == 2 and hf_name.endswith(".weight") and transform in (None, *ROW_TRANSFORMS):
            sources[entry] = (source, None if transform is None else partial(transform, hf=hf_config))
    return sources


@dataclass(frozen=True)
class StoredLinear:
    """One layer's weight (out, in) as the file stores it: its ggml type and its blocks, one row of blocks per
    output row, in tformer's row order. A quantized layer is built from this, never from a float copy of the
    whole weight: Q4_0, Q4_1 and Q4_K blocks are INT4 groups as they are (`int4_groups`), Q6_K blocks a Q6_K layer
    as they are (`rows`), other types are dequantized a few rows at a time (`chunks`) and requantized."""

    name: str  # the GGUF tensor's, for messages
    kind: GGMLQuantizationType
    rows: torch.Tensor  # (out, bytes a row) uint8
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        block, block_bytes = GGML_QUANT_SIZES[self.kind]
        out_f, in_f = self.shape
        if in_f % block or tuple(self.rows.shape) != (out_f, in_f // block * block_bytes):
            raise GGUFError(
                f"{self.name}: a {self.kind.name} weight of shape {list(self.shape)} needs rows of whole "
                f"{block}-value blocks, {block_bytes} bytes each, so ({out_f}, {in_f // block * block_bytes}) "
                f"bytes; got {list(self.rows.shape)} (in features {in_f})"
            )

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """q (out, in) uint8 in [0, 15] with the scales and minimums (out, in / 32) of w = q * scale + minimum,
        straight from the blocks where they are such groups of 32 (Q4_0, Q4_1, Q4_K), else None."""
        split = INT4_GROUPS.get(self.kind)
        if split is None:
            return None
        out_f, in_f = self.shape
        q, scales, minimums = split(self.rows.reshape(-1, GGML_QUANT_SIZES[self.kind][1]))
        return q.reshape(out_f, in_f), scales.reshape(out_f, -1), minimums.reshape(out_f, -1)

    def floats(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start..stop of the weight as float32, bit for bit as `gguf.quants` dequantizes them."""
        rows = self.rows[start:stop]
        blocks = rows.reshape(-1, GGML_QUANT_SIZES[self.kind][1])
        return DEQUANTIZERS[self.kind](blocks).reshape(rows.shape[0], self.shape[1])

    def chunks(self, values: int = 1 << 20) -> Iterator[torch.Tensor]:
        """The float32 weight in chunks of whole rows, a multiple of 16 rows and about `values` values each."""
        step = max(16, values // self.shape[1] // 16 * 16)
        for start in range(0, self.shape[0], step):
            yield self.floats(start, start + step)


def stored_linears(reader: GGUFFile) -> dict[str, StoredLinear]:
    """tformer parameter name -> the blocks of each layer's linear weight (`linear_sources`), with llama.cpp's
    q/k row permutation undone on whole rows of blocks (a copy of the quantized bytes, only for those)."""
    stored = {}
    for name, (tensor, transform) in linear_sources(reader).items():
        if tensor.tensor_type not in SUPPORTED_TYPES:
            dequantize_tensor(reader, tensor)  # the GGUFError naming the type and what is supported
        out_f, in_f = tensor.torch_shape
        rows = reader.raw(tensor).view(out_f, -1)
        stored[name] = StoredLinear(
            tensor.name, tensor.tensor_type, rows if transform is None else transform(rows), (out_f, in_f)
        )
    return stored


def stored_head(reader: GGUFFile) -> tuple[StoredLinear, str | None] | None:
    """The output head's blocks (`output.weight`, or `token_embd.weight` where the file ties the head to the
    embedding) and, when tied, the tformer name of the embedding table; None where the head is not taken as
    stored (a transform, a type not supported). A Q6_K head is then its blocks as they are, another an INT8 head
    built from its blocks a few rows at a time, with no float copy of the table, and a tied embedding reads its
    rows from it (`quantize.RowsEmbedding`)."""
    arch, hf_config = hf_config_from_gguf(reader, reader.path)
    family = hf_family(arch, reader.path)
    table = _table(family, _model_config(family, hf_config, reader.path))
    weights = GGUFTensors(reader, arch, hf_config, torch.float32)
    tied = hf_config["tie_word_embeddings"]
    for hf_name, entry in table.items():
        source = weights.gguf_name.get(hf_name)
        if not isinstance(entry, str) or source != ("token_embd.weight" if tied else "output.weight"):
            continue
        tensor, transform = weights.sources[hf_name]
        if transform is not None or len(tensor.shape) != 2 or tensor.tensor_type not in SUPPORTED_TYPES:
            return None
        out_f, in_f = tensor.torch_shape
        rows = reader.raw(tensor).view(out_f, -1)
        return StoredLinear(tensor.name, tensor.tensor_type, rows, (out_f, in_f)), entry if tied else None
    return None


def stored_precision(reader: GGUFFile) -> str | None:
    """'int4' or 'int8', the serving format nearest to how the file stores most of its layers' weights (by
    count of values: a Q4_K_M file keeps some tensors in Q6_K), or None for a float file: llama.cpp's
    behaviour of serving a file as stored."""
    counts: dict[str | None, int] = {}
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and len(tensor.shape) >= 2:
            kind = FILE_PRECISION.get(STORED_PRECISION.get(tensor.tensor_type))
            counts[kind] = counts.get(kind, 0) + math.prod(tensor.shape)
    return max(counts, key=counts.__getitem__) if counts else None
