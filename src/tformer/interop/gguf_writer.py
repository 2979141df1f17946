"""Write LLaMA-style decoders as GGUF files (llama.cpp's format) for the `llama` architecture, Mixtral-style
mixtures of experts included.

The model goes out through the same table `to_hf` uses (as a LlamaForCausalLM or MixtralForCausalLM checkpoint),
and each tensor is
renamed with gguf-py's own name map, as llama.cpp's convert_hf_to_gguf.py does, with the one change that
converter makes for llama: the q and k rows permuted into the interleaved pairs llama.cpp's RoPE rotates (the
reader, `gguf_arch.unpermute_rope_rows`, undoes it). Llama 3's scaled RoPE goes out as `rope_freqs`. A mixture
of experts goes out as llama.cpp writes Mixtral: `llama` with expert_count and expert_used_count, the router as
`ffn_gate_inp` and each expert matrix of a layer stacked into one 3-D tensor (`ffn_{gate,up,down}_exps`).
Matrices are stored as F16, Q8_0 or Q4_0 (`gguf.quants.quantize`); norms and routers stay F32, as llama.cpp keeps them.
The tokenizer must be byte-level BPE (what tformer trains and Llama 3 / Qwen use): it goes out as
`tokenizer.ggml.model` "gpt2" with its tokens, merges, token types, special ids and chat template.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, LlamaFileType

from tformer.config import ConfigError
from tformer.data.tokenizer import Tokenizer
from tformer.interop.gguf_tokenizer import CONTROL, NORMAL, PRE_TOKENIZER_SPLITS, USER_DEFINED
from tformer.interop.hf import export_family, export_tensors
from tformer.models import CheckpointError, TransformerModel

ARCH = "llama"
# --type -> (the type of each matrix, general.file_type)
TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
# tokenizer.ggml.pre names llama.cpp's loader accepts, by the split each stands for (PRE_TOKENIZER_SPLITS); its
# name for GPT-2's split is "gpt-2" ("default" is another split, and "gpt2" it refuses)
GPT2_PRE = "gpt-2"
WRITTEN_PRE_TOKENIZERS = (GPT2_PRE, "smollm", "llama-bpe", "qwen2")
SUPPORTED = (
    "LLaMA-style decoders (family decoder, rope, rmsnorm, swiglu, no biases; GQA; tied or untied head; "
    "Mixtral-style experts)"
)
# a Mixtral checkpoint's expert matrix: model.layers.{i}.block_sparse_moe.experts.{j}.{w1,w2,w3}.weight
EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)(\.w[123])$")


def permute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's permutation of q or k rows (convert_hf_to_gguf.py's LlamaModel.permute): within each head,
    the half-split row half * head_dim / 2 + i goes to 2 i + half. The inverse of `unpermute_rope_rows`."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _hf_architecture(config: Any) -> str:
    """The Hugging Face checkpoint the file's tensors are renamed from: llama.cpp's converter reads Mixtral's."""
    return "MixtralForCausalLM" if config.n_experts else "LlamaForCausalLM"


def _llama_fields(model: TransformerModel) -> dict[str, Any]:
    config = model.config
    if config.family != "decoder":
        raise ConfigError(f"--to gguf writes {SUPPORTED}; this is a '{config.family}' model")
    try:
        _, fields = export_family(config, _hf_architecture(config))
    except CheckpointError as err:
        raise ConfigError(f"--to gguf writes {SUPPORTED}; this model is not one:\n{err}") from None
    return fields


def _gguf_tensor_name(names: gguf.TensorNameMap, stem: str) -> tuple[str, int | None]:
    """The GGUF name of a checkpoint tensor's stem, and the expert index for a matrix that goes into a stacked
    3-D expert tensor (None otherwise)."""
    expert = EXPERT_NAME.match(stem)
    gguf_name = names.get_name(expert[1] + expert[3] if expert else stem)
    if gguf_name is None:  # a table entry gguf-py does not know: a bug here, not the user's
        raise CheckpointError(f"no GGUF name for tensor {stem}")
    return gguf_name, int(expert[2]) if expert else None


def _rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Llama 3's RoPE divisors per frequency, as convert_hf_to_gguf.py writes them into `rope_freqs`."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    factors = np.where(wavelen < old_context / high, 1.0, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen > old_context / low, factor, factors).astype(np.float32)


def _pre_tokenizer(spec: dict[str, Any] | None) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for the word split of a byte-level tokenizer.json: one of the
    names its vocabulary loader accepts (it refuses to load a file with any other)."""
    if spec is None or (spec.get("type") == "ByteLevel" and spec.get("use_regex", True)):
        return GPT2_PRE
    patterns = [
        s.get("pattern", {}).get("Regex")
        for s in spec.get("pretokenizers", [])
        if s.get("type") == "Split" and s.get("pattern", {}).get("Regex")
    ]
    for name in WRITTEN_PRE_TOKENIZERS:
        if patterns == PRE_TOKENIZER_SPLITS[name]:
            return name
    warnings.warn(
        f"the tokenizer's word split is none llama.cpp names; writing tokenizer.ggml.pre '{GPT2_PRE}' (GPT-2's "
        "split), so llama.cpp may split some text differently",
        stacklevel=3,
    )
    return GPT2_PRE


def _tokenizer_keys(writer: gguf.GGUFWriter, tokenizer: Tokenizer, vocab_size: int) -> None:
    spec = json.loads(tokenizer.backend.to_str())
    bpe = spec["model"]
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    if bpe.get("type") != "BPE" or not byte_level:
        raise ConfigError(
            f"--to gguf writes byte-level BPE tokenizers (llama.cpp's 'gpt2' model); this one is a "
            f"{bpe.get('type')} model{'' if byte_level else ' without a ByteLevel decoder'}"
        )
    tokens = dict(bpe["vocab"])
    kinds = dict.fromkeys(tokens.values(), NORMAL)
    for added in spec.get("added_tokens", []):
        tokens[added["content"]] = added["id"]
        kinds[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    by_id = {i: text for text, i in tokens.items()}
    if len(by_id) > vocab_size:
        raise ConfigError(f"the tokenizer has {len(by_id)} tokens, more than the model's vocab_size {vocab_size}")
    # rows of the embedding no token uses get placeholder tokens, as llama.cpp's converter writes them
    texts = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [kinds.get(i, USER_DEFINED) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec.get("pre_tokenizer")))
    writer.add_token_list(texts)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for role, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("pad", writer.add_pad_token_id),
        ("unk", writer.add_unk_token_id),
    ):
        token = tokenizer.special_tokens.get(role)
        if token is not None:
            add(tokens[token])
    writer.add_add_bos_token(bool(tokenizer.add_bos))
    writer.add_add_eos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _store(name: str, tensor: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The tensor as written: matrices in `qtype`, except rows that are not whole blocks (F16 then). Norms, the
    rope factors and a mixture's routers stay F32, as llama.cpp's converter and quantizer keep them: a router's few
    weights pick every token's experts."""
    if tensor.ndim == 1 or name == "rope_freqs.weight" or name.endswith(".ffn_gate_inp.weight"):
        return tensor.astype(np.float32), GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if tensor.shape[-1] % block:
        qtype = GGMLQuantizationType.F16
    if qtype == GGMLQuantizationType.F16:
        return tensor.astype(np.float16), qtype
    return gguf.quants.quantize(tensor.astype(np.float32), qtype), qtype


def to_gguf(
    model: TransformerModel,
    path: str | os.PathLike[str],
    tokenizer: Tokenizer | None = None,
    type: str = "f16",
    name: str = "tformer model",
) -> None:
    """Write `model` (a LLaMA-style decoder, or a Mixtral-style mixture of experts) and its `tokenizer` as a GGUF
    file of architecture llama.

    type: f16, q8_0 or q4_0 for the matrices (a matrix whose rows are not whole 32-value blocks stays F16).
    Without a tokenizer the file holds no vocabulary, which llama.cpp refuses: pass one for llama.cpp.
    """
    if type not in TYPES:
        raise ConfigError(f"unknown GGUF type '{type}'; choose one of: {', '.join(TYPES)}")
    fields = _llama_fields(model)
    config, (qtype, file_type) = model.config, TYPES[type]
    family, _ = export_family(config, _hf_architecture(config))
    base, head = family.tensors(config)
    hf_tensors = export_tensors(model, {family.prefixes[0] + n: entry for n, entry in base.items()} | head)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.n_decoder_layers)
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}  # stacked tensor name -> expert index -> matrix
    for hf_name, tensor in hf_tensors.items():
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name, expert = _gguf_tensor_name(names, stem)
        tensor = tensor.float()
        if gguf_name.endswith("attn_q"):
            tensor = permute_rope_rows(tensor, config.n_heads)
        elif gguf_name.endswith("attn_k"):
            tensor = permute_rope_rows(tensor, config.n_kv_heads)
        if expert is None:
            tensors[f"{gguf_name}.{suffix}"] = tensor.numpy()
        else:
            experts.setdefault(f"{gguf_name}.{suffix}", {})[expert] = tensor.numpy()
    for stacked, by_index in experts.items():  # experts outermost, as llama.cpp's converter stacks them
        tensors[stacked] = np.stack([by_index[j] for j in range(len(by_index))])
    rope = fields.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _rope_freqs(rope, config.head_dim)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, ARCH)
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_decoder_layers)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if config.n_experts:
        writer.add_expert_count(config.n_experts)
        writer.add_expert_used_count(config.n_experts_per_token)
    if tokenizer is not None:
        _tokenizer_keys(writer, tokenizer, config.vocab_size)
    for tensor_name, tensor in tensors.items():
        data, kind = _store(tensor_name, tensor, qtype)
        writer.add_tensor(tensor_name, data, raw_dtype=kind)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(path)
