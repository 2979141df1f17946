"""Load LLaMA-architecture GGUF files (llama.cpp's format) into a tformer `DecoderLM`.

A GGUF file is a header of typed key/value metadata, a table of tensor descriptions and the tensor bytes,
which are memory-mapped and dequantized (`gguf_file`). Three things differ from a PyTorch state dict:

- A tensor's shape is listed innermost dimension first (ggml's ne[0] is the row length), so a (out, in)
  weight is described as [in, out].
- Quantized types pack blocks of 32 or 256 values with per-block scales; they are expanded to float32 here.
- llama.cpp applies RoPE to adjacent pairs (x0, x1), (x2, x3), ..., while LLaMA checkpoints (and tformer)
  rotate the half-split pairs (x_i, x_{i + d/2}). llama.cpp's converter therefore permutes the rows of each
  head of W_q and W_k (and of W_k's n_kv_heads heads under GQA); `unpermute_rope_rows` undoes that.

Nothing is ever unpickled. Foreign tensor names (`blk.N.attn_q.weight`, ...) appear only in this package.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from tformer.config import ConfigError, ModelConfig
from tformer.interop.gguf_file import GGUF_MAGIC, GGUFFile, Malformed, TensorInfo, Truncated, q4_1_groups
from tformer.models import CheckpointError, DecoderLM, assign_weights, build_model

SUPPORTED_ARCHITECTURES = ("llama",)
Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K)

# GGUF tensor name -> tformer parameter name; per-layer names get the prefixes blk.{i}. and decoder.layers.{i}.
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "decoder.tokens.weight",
    "output_norm.weight": "decoder.final_norm.weight",
    "output.weight": "lm_head.weight",  # absent when the output projection is tied to the embedding
}
LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "norm_attn.norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.out_proj.weight",
    "ffn_norm.weight": "norm_ffn.norm.weight",
    "ffn_gate.weight": "ffn.gate_proj.weight",
    "ffn_up.weight": "ffn.up_proj.weight",
    "ffn_down.weight": "ffn.down_proj.weight",
}
# per-layer tensors whose rows llama.cpp permuted, and the config field holding their head count
ROPE_PERMUTED: dict[str, str] = {"attn_q.weight": "n_heads", "attn_k.weight": "n_kv_heads"}
# tensors some LLaMA-architecture files carry that need a model feature tformer lacks
UNSUPPORTED_TENSORS: dict[str, str] = {
    "rope_freqs.weight": "per-frequency RoPE factors (Llama 3.1-style rope scaling)",
}

# what the llama architecture fixes: pre-RMSNorm, RoPE, SwiGLU, no biases, unscaled embeddings
LLAMA_FIELDS: dict[str, Any] = {
    "family": "decoder",
    "n_encoder_layers": 0,
    "position": "rope",
    "ffn": "swiglu",
    "ffn_bias": False,
    "attn_bias": False,
    "norm": "rmsnorm",
    "norm_placement": "pre",
    "scale_embeddings": False,
    "init": "normal",
    "dropout": 0.0,
}
# "{arch}.<key>" metadata -> ModelConfig field
ARCH_METADATA: dict[str, str] = {
    "context_length": "max_seq_len",
    "embedding_length": "d_model",
    "block_count": "n_decoder_layers",
    "feed_forward_length": "d_ff",
    "attention.head_count": "n_heads",
    "attention.head_count_kv": "n_kv_heads",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "norm_eps",
    "vocab_size": "vocab_size",
}
REQUIRED_METADATA = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
# "{arch}.rope.scaling.<key>" metadata -> ModelConfig field
ROPE_SCALING_METADATA: dict[str, str] = {
    "factor": "rope_factor",
    "original_context_length": "rope_original_max_len",
    "yarn_beta_fast": "yarn_beta_fast",
    "yarn_beta_slow": "yarn_beta_slow",
}
ROPE_SCALING_TYPES: dict[str, str] = {"none": "none", "linear": "linear", "yarn": "yarn"}


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


def architecture(reader: GGUFFile, path: str | os.PathLike[str]) -> str:
    """`general.architecture`, checked against the architectures this loader supports."""
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def config_from_gguf(reader: GGUFFile, path: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig that the file's metadata and tensor list describe."""
    arch = architecture(reader, path)
    missing = [f"{arch}.{key}" for key in REQUIRED_METADATA if reader.get(f"{arch}.{key}") is None]
    if missing:
        raise GGUFError(f"{path}: metadata {', '.join(missing)} missing; the file is incomplete")
    fields = dict(LLAMA_FIELDS)
    for key, name in ARCH_METADATA.items():
        if (value := metadata(reader, f"{arch}.{key}")) is not None:
            fields[name] = value
    fields.setdefault("vocab_size", _token_count(reader))
    names = {t.name for t in reader.tensors}
    fields["tie_embeddings"] = "output.weight" not in names
    pad_id = metadata(reader, "tokenizer.ggml.padding_token_id")
    if pad_id is not None and "vocab_size" in fields and pad_id < fields["vocab_size"]:
        fields["pad_token_id"] = pad_id
    fields.update(_rope_scaling(reader, arch, path))
    try:
        config = ModelConfig.from_dict(fields, source=str(path))
    except ConfigError as err:
        raise GGUFError(f"{err} (the GGUF metadata describe an invalid model)") from None
    rotary_dims = metadata(reader, f"{arch}.rope.dimension_count", config.head_dim)
    if rotary_dims != config.head_dim:
        raise GGUFError(
            f"{path}: RoPE rotates {rotary_dims} of {config.head_dim} head dimensions; tformer rotates all of them"
        )
    return config


def _token_count(reader: GGUFFile) -> int | None:
    tokens = reader.get("tokenizer.ggml.tokens")
    return None if tokens is None else len(tokens)


def _rope_scaling(reader: GGUFFile, arch: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    kind = metadata(reader, f"{arch}.rope.scaling.type")
    if kind is None and (linear := metadata(reader, f"{arch}.rope.scale_linear")) is not None:
        return {"rope_scaling": "linear", "rope_factor": linear}  # older files
    if kind is None:
        return {}
    if kind not in ROPE_SCALING_TYPES:
        raise GGUFError(f"{path}: RoPE scaling {kind!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}")
    fields = {"rope_scaling": ROPE_SCALING_TYPES[kind]}
    for key, name in ROPE_SCALING_METADATA.items():
        if (value := metadata(reader, f"{arch}.rope.scaling.{key}")) is not None:
            fields[name] = value
    return fields


def tensor_names(config: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> tformer parameter name, for every tensor a LLaMA file of this config holds."""
    names = dict(GLOBAL_TENSORS)
    if config.tie_embeddings:
        del names["output.weight"]
    for i in range(config.n_decoder_layers):
        for gguf, ours in LAYER_TENSORS.items():
            names[f"blk.{i}.{gguf}"] = f"decoder.layers.{i}.{ours}"
    return names


def dequantize_tensor(reader: GGUFFile, tensor: TensorInfo) -> torch.Tensor:
    """One tensor as float32, in PyTorch's dimension order (outermost first)."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise GGUFError(
            f"{reader.path}: unsupported quantization type {tensor.tensor_type.name} for {tensor.name}; "
            f"supported: {supported}; re-quantize the model to one of these"
        )
    return reader.dequantize(tensor)


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a q or k projection (n_heads * head_dim, d_model).

    Within each head, llama.cpp stores row (i, half) at position 2 i + half; the half-split layout keeps it at
    half * head_dim / 2 + i.
    """
    rows, cols = weight.shape
    head_dim = rows // n_heads
    per_pair = weight.reshape(n_heads, head_dim // 2, 2, cols)  # (H, pair, half, in) as llama.cpp stores it
    return per_pair.transpose(1, 2).reshape(rows, cols)  # (H, half, pair, in) -> (H * head_dim, in)


def _check_tensor_list(reader: GGUFFile, names: dict[str, str], path: str | os.PathLike[str]) -> None:
    present = {t.name for t in reader.tensors}
    for name, feature in UNSUPPORTED_TENSORS.items():
        if name in present:
            raise GGUFError(f"{path}: tensor {name} needs {feature}, which tformer does not implement")
    missing = [name for name in names if name not in present]
    if missing:
        raise GGUFError(
            f"{path}: missing tensor {missing[0]} (tformer's {names[missing[0]]})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + "; the file is incomplete or its block_count metadata is wrong"
        )
    unexpected = sorted(present - set(names))
    if unexpected:
        raise GGUFError(f"{path}: unexpected tensors {unexpected[:5]}: this is not a plain LLaMA model")


def from_gguf(
    path: str | os.PathLike[str],
    reader: GGUFFile | None = None,
    leave_out: Collection[str] = (),
    dtype: torch.dtype = torch.float32,
) -> DecoderLM:
    """A tformer DecoderLM (in `dtype`, on the CPU, in eval mode) with the weights of a LLaMA GGUF file.

    The model is built without initializing its weights; each is dequantized straight into place. Parameters
    named in `leave_out` stay on the meta device, for a caller that replaces their modules (`q4_1_linears`).
    """
    reader = reader or open_gguf(path)
    config = config_from_gguf(reader, path)
    names = tensor_names(config)
    _check_tensor_list(reader, names, path)
    model = build_model(config, initialize=False).to(dtype)  # free on the meta device
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if set(names.values()) != set(shapes):
        raise RuntimeError("tformer's LLaMA parameters changed; update tformer.interop.gguf.LAYER_TENSORS")
    by_name = {t.name: t for t in reader.tensors}
    state = {
        ours: _read_weight(reader, by_name[gguf], config, shapes[ours], ours)
        for gguf, ours in names.items()
        if ours not in leave_out
    }
    missing, unexpected, mismatched = assign_weights(model, state)
    if set(missing) - set(leave_out) or unexpected or mismatched:
        raise RuntimeError(f"GGUF tensors left {missing} unset, {unexpected} unknown, {mismatched} misshaped")
    return model.eval()


def q4_1_linears(reader: GGUFFile) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """tformer parameter name -> (q, scales, minimums) of each layer's linear weight the file stores as Q4_1,
    with llama.cpp's q/k row permutation undone: what an INT4 layer takes without a round trip through float.
    The output head is left out: INT4 serving gives it 8 bits (`tformer.kernels.quantize.quantize`)."""
    config = config_from_gguf(reader, reader.path)
    names = tensor_names(config)
    groups = {}
    for tensor in reader.tensors:
        if tensor.tensor_type != Q.Q4_1 or not tensor.name.startswith("blk.") or tensor.name not in names:
            continue
        parts = q4_1_groups(reader.raw(tensor), tensor.torch_shape)
        heads_field = ROPE_PERMUTED.get(tensor.name.split(".", 2)[-1])
        if heads_field is not None:
            parts = tuple(unpermute_rope_rows(part, getattr(config, heads_field)) for part in parts)
        groups[names[tensor.name]] = parts
    return groups


def _read_weight(
    reader: GGUFFile, tensor: TensorInfo, config: ModelConfig, shape: tuple[int, ...], ours: str
) -> torch.Tensor:
    if tensor.torch_shape != shape:
        raise GGUFError(
            f"{reader.path}: {tensor.name} has shape {list(tensor.torch_shape)}, but the metadata imply "
            f"{list(shape)} for {ours}; the file's metadata and tensors disagree"
        )
    value = dequantize_tensor(reader, tensor)
    heads_field = ROPE_PERMUTED.get(tensor.name.split(".", 2)[-1]) if tensor.name.startswith("blk.") else None
    return value if heads_field is None else unpermute_rope_rows(value, getattr(config, heads_field))
