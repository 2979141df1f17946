"""Tiny GGUF files written from `transformers` models as llama.cpp's convert_hf_to_gguf.py writes them.

Names come from gguf-py's own tensor-name map (`gguf.get_tensor_name_map`, what the converter uses); the
changes the converter makes on the way are written out here, independently of tformer's loader: llama's q/k row
permutation, Gemma's norm weights stored as 1 + w, GPT-2's Conv1D weights transposed, experts stacked into 3-D
tensors, Llama 3's RoPE divisors as `rope_freqs`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from helpers import llama_cpp_permute

# general.architecture -> gguf-py's MODEL_ARCH, for the tensor-name map
ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "gpt2": gguf.MODEL_ARCH.GPT2,
}
GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# the GGUF tests' tiny Llama: GQA (4 heads, 2 KV heads), a vocabulary as small as the tiny tokenizers'
TINY_SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_llama(**overrides: Any) -> Any:
    """A random `transformers` LlamaForCausalLM in eval mode, of TINY_SIZES changed by `overrides` (LlamaConfig's)."""
    import transformers  # the writers need only gguf; a test that builds a model has transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_SIZES, **overrides})).eval()


def llama3_divisors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3, as it is written there."""
    base, factor = rope["rope_theta"], rope["factor"]
    low_freq_factor, high_freq_factor = rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def metadata(model: Any, arch: str) -> dict[str, Any]:
    """The `{arch}.*` keys the converter writes for `model.config`."""
    cfg = model.config
    if arch == "gpt2":
        return {
            "context_length": cfg.n_positions,
            "embedding_length": cfg.n_embd,
            "feed_forward_length": cfg.n_inner or 4 * cfg.n_embd,
            "block_count": cfg.n_layer,
            "attention.head_count": cfg.n_head,
            "attention.layer_norm_epsilon": float(cfg.layer_norm_epsilon),
        }
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)
    meta = {
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.dimension_count": head_dim,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "vocab_size": cfg.vocab_size,
    }
    if rope.get("rope_type") == "linear":
        meta |= {"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])}
    if getattr(cfg, "num_local_experts", None):  # Mixtral: a llama file with experts
        meta |= {"expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok}
    if arch.endswith("moe"):
        meta |= {
            "expert_count": cfg.num_experts,
            "expert_used_count": cfg.num_experts_per_tok,
            "expert_feed_forward_length": cfg.moe_intermediate_size,
        }
    if arch == "qwen2moe":
        meta["expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    if arch.startswith("gemma"):
        meta["attention.sliding_window"] = cfg.sliding_window
    if arch == "gemma2":
        meta |= {
            "attn_logit_softcapping": float(cfg.attn_logit_softcapping),
            "final_logit_softcapping": float(cfg.final_logit_softcapping),
        }
    return meta


def tensors(model: Any, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names, changed as the converter changes them."""
    cfg, state = model.config, {k: v.float().numpy() for k, v in model.state_dict().items()}
    n_layers = cfg.n_layer if arch == "gpt2" else cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(ARCHS[arch], n_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, value in state.items():
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts.gate_up_proj" in hf_name:  # transformers 5 fuses experts; the converter reads them apart
            layer = hf_name.split(".")[2]
            gate, up = np.split(value, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
            continue
        if ".mlp.experts.down_proj" in hf_name:
            out[f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight"] = value
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(stem)
        assert name is not None, hf_name
        name = f"{name}.{suffix}"
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            value = value + 1
        if arch == "gpt2" and hf_name.endswith(GPT2_CONV1D):
            value = value.T.copy()
        if name.endswith("ffn_gate_inp_shexp.weight"):
            value = value[0]
        out[name] = value
    if arch == "gpt2" and "output.weight" not in out:  # the converter writes GPT-2's tied head as its own copy
        out["output.weight"] = out["token_embd.weight"]
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        out["rope_freqs.weight"] = llama3_divisors(rope, head_dim)
    return out


def write(
    path: Path,
    model: Any,
    arch: str,
    qtype: Q = Q.F32,
    name: str = "tiny test model",
    meta: dict[str, Any] | None = None,
    tensors_override: dict[str, np.ndarray] | None = None,
    types: dict[str, Q] | None = None,
    keys: dict[str, Any] | None = None,
) -> Path:
    """`model` as a GGUF file of architecture `arch`; matrices quantized to `qtype` (1-D tensors stay F32, as
    llama.cpp keeps them); uint8 arrays in `tensors_override` are raw blocks of the type `types` names; `meta`
    adds or replaces `{arch}.` keys, `keys` whole keys."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    arch_keys = {f"{arch}.{key}": value for key, value in (metadata(model, arch) | (meta or {})).items()}
    for key, value in (arch_keys | (keys or {})).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for tensor_name, value in (tensors(model, arch) | (tensors_override or {})).items():
        kind = (types or {}).get(tensor_name, qtype)
        if value.dtype == np.uint8:
            writer.add_tensor(tensor_name, value, raw_dtype=kind)
        elif value.ndim == 1 or kind == Q.F32:
            writer.add_tensor(tensor_name, value.astype(np.float32))
        else:
            data = gguf.quants.quantize(value.astype(np.float32), kind)
            writer.add_tensor(tensor_name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """A valid Q4_K encoding of (rows, cols) floats, cols a multiple of 256 (gguf-py cannot quantize K-quants):
    per 32 values an asymmetric 4-bit grid, its scale and minimum rounded to 6 bits of the block's d and dmin.
    Simpler than llama.cpp's search, and read back by `gguf.quants.dequantize` like any Q4_K block."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 8, 32)  # (super-blocks, sub-blocks, values)
    low = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - low) / 15
    d = (scale.max(axis=1, keepdims=True) / 63).astype(np.float16)
    dmin = (-low.min(axis=1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.round((x + offset) / np.where(step == 0, 1, step)), 0, 15).astype(np.uint8)
    packed = np.empty((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    nibbles = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, nibbles], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


# a 96-token byte-level BPE vocabulary (printable ASCII, the space as GPT-2 spells it, one merge) for files that
# must carry a tokenizer: tokenizer.ggml.* keys for `write(..., keys=TINY_TOKENIZER)`
TINY_TOKENIZER: dict[str, Any] = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.tokens": [chr(c) for c in range(33, 127)] + ["\u0120", "\u0120t"],
    "tokenizer.ggml.merges": ["\u0120 t"],
    "tokenizer.ggml.eos_token_id": 0,
}
