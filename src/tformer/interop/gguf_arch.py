"""llama.cpp's architectures as data: how a GGUF file's metadata and tensors become a Hugging Face checkpoint.

A GGUF file of architecture `llama`, `qwen3`, `gemma2`, ... holds what llama.cpp's converter made of a Hugging Face
checkpoint: config.json keys renamed (`{arch}.embedding_length` for `hidden_size`), tensors renamed
(`blk.3.attn_q.weight` for `model.layers.3.self_attn.q_proj.weight`), and a few tensors changed on the way:

- llama's q and k rows are permuted for llama.cpp's adjacent-pair RoPE (`unpermute_rope_rows` undoes it);
- Gemma's RMSNorm weights are stored as 1 + w (llama.cpp's norm multiplies by its weight alone);
- GPT-2's Conv1D weights are stored transposed, as (out, in);
- a mixture of experts stores each expert matrix of a layer in one 3-D tensor (experts outermost).

An `Architecture` undoes these, so that the Hugging Face families of `hf_decoders` (which already know how each
config.json maps onto a ModelConfig) build the model: one description per family, shared by both formats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Transform = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]  # (GGUF tensor, config.json) -> HF tensor


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a q or k projection (n_heads * head_dim, ...) or its bias.

    Within each head, llama.cpp stores row (i, half) at position 2 i + half; the half-split layout keeps it at
    half * head_dim / 2 + i.
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    head_dim = rows // n_heads
    per_pair = weight.reshape(n_heads, head_dim // 2, 2, *rest)  # (H, pair, half, ...) as llama.cpp stores it
    return per_pair.transpose(1, 2).reshape(rows, *rest)  # (H, half, pair, ...) -> (H * head_dim, ...)


def _unpermute_q(tensor: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    return unpermute_rope_rows(tensor, hf["num_attention_heads"])


def _unpermute_k(tensor: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    return unpermute_rope_rows(tensor, hf.get("num_key_value_heads") or hf["num_attention_heads"])


def _minus_one(tensor: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    return tensor - 1  # llama.cpp stores Gemma's (1 + w) RMSNorm weight with the 1 added


def _transpose(tensor: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    return tensor.T  # GPT-2's Conv1D keeps (in, out); llama.cpp stores (out, in)


def _row(tensor: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    return tensor[None]  # Qwen2-MoE's shared-expert gate is a (1, d) linear; llama.cpp keeps (d,)


@dataclass(frozen=True)
class Architecture:
    """One `general.architecture` of llama.cpp and the Hugging Face checkpoint it came from.

    Tensor tables are keyed by GGUF names without `.weight` / `.bias` (the suffix carries over); per-layer names
    lose their `blk.{i}.` prefix and gain `layer_prefix` + `{i}.`. `transforms` are keyed by the full suffix-less
    name (`attn_q` matches `attn_q.weight` only when keyed as `attn_q.weight`; see `transform_for`).
    """

    hf_architecture: str
    model_type: str
    metadata: dict[str, str]  # "{arch}.<key>" -> config.json key
    global_tensors: dict[str, str]
    layer_tensors: dict[str, str]
    layer_prefix: str = "model.layers."
    transforms: dict[str, Transform] = field(default_factory=dict)  # "attn_q.weight" -> its transform
    experts: dict[str, str] = field(default_factory=dict)  # "ffn_gate_exps" -> "mlp.experts.{j}.gate_proj"
    fixed: dict[str, Any] = field(default_factory=dict)  # config.json keys the architecture fixes
    # config.json keys that need more than a rename: (the "{arch}." metadata reader, config so far) -> keys
    extra: Callable[[Callable[[str], Any], dict[str, Any]], dict[str, Any]] | None = None
    rope: bool = True  # whether rope.* metadata and rope_freqs apply
    consumed: tuple[str, ...] = ()  # tensors read into config.json (llama3's rope_freqs), not weights

    def transform_for(self, short_name: str) -> Transform | None:
        """The transform of `attn_q.weight`, `attn_q.bias`, ...: keyed by the full name, else by the stem."""
        return self.transforms.get(short_name) or self.transforms.get(short_name.rsplit(".", 1)[0])


# ---- shared tables --------------------------------------------------------------------------------------------------

LLAMA_METADATA = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "attention.sliding_window": "sliding_window",
}
MOE_METADATA = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
LLAMA_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
MLP = {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{j}.gate_proj",
    "ffn_up_exps": "mlp.experts.{j}.up_proj",
    "ffn_down_exps": "mlp.experts.{j}.down_proj",
}
ROUTER = {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}
LLAMA_PERMUTED = {"attn_q": _unpermute_q, "attn_k": _unpermute_k}

# ---- architectures --------------------------------------------------------------------------------------------------

LLAMA = Architecture(
    "LlamaForCausalLM",
    "llama",
    LLAMA_METADATA,
    LLAMA_GLOBAL,
    {**ATTENTION, **MLP},
    transforms=LLAMA_PERMUTED,
    consumed=("rope_freqs.weight",),
)
MIXTRAL = Architecture(  # llama.cpp writes Mixtral as `llama` with experts
    "MixtralForCausalLM",
    "mixtral",
    {**LLAMA_METADATA, "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    LLAMA_GLOBAL,
    {**ATTENTION, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "block_sparse_moe.gate"},
    transforms=LLAMA_PERMUTED,
    experts={
        "ffn_gate_exps": "block_sparse_moe.experts.{j}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{j}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{j}.w2",
    },
    consumed=("rope_freqs.weight",),
)
MISTRAL = Architecture(
    "MistralForCausalLM",
    "mistral",
    LLAMA_METADATA,
    LLAMA_GLOBAL,
    {**ATTENTION, **MLP},
    transforms=LLAMA_PERMUTED,
    fixed={"sliding_window": None},  # llama.cpp runs Mistral files without a window unless the metadata set one
)
QWEN2 = Architecture("Qwen2ForCausalLM", "qwen2", LLAMA_METADATA, LLAMA_GLOBAL, {**ATTENTION, **MLP})
QWEN3 = Architecture("Qwen3ForCausalLM", "qwen3", LLAMA_METADATA, LLAMA_GLOBAL, {**ATTENTION, **QK_NORM, **MLP})
QWEN2_MOE = Architecture(
    "Qwen2MoeForCausalLM",
    "qwen2_moe",
    {**LLAMA_METADATA, **MOE_METADATA, "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    LLAMA_GLOBAL,
    {
        **ATTENTION,
        **ROUTER,
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    },
    transforms={"ffn_gate_inp_shexp": _row},
    experts=EXPERTS,
    fixed={"norm_topk_prob": False},  # llama.cpp's qwen2moe keeps the softmax weights of the chosen experts
)
QWEN3_MOE = Architecture(
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    {**LLAMA_METADATA, **MOE_METADATA},
    LLAMA_GLOBAL,
    {**ATTENTION, **QK_NORM, **ROUTER},
    experts=EXPERTS,
    fixed={"norm_topk_prob": True},  # llama.cpp's qwen3moe renormalizes the chosen experts' weights
)
PHI3 = Architecture(
    "Phi3ForCausalLM",
    "phi3",
    LLAMA_METADATA,
    LLAMA_GLOBAL,
    {
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",  # gate and up in one matrix, gate first, in both formats
        "ffn_down": "mlp.down_proj",
    },
)
GEMMA_LAYER = {
    **ATTENTION,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA_NORMS = {
    name: _minus_one
    for name in (
        "output_norm",
        "attn_norm",
        "post_attention_norm",
        "ffn_norm",
        "post_ffw_norm",
        "attn_q_norm",
        "attn_k_norm",
    )
}
GEMMA_METADATA = {
    **LLAMA_METADATA,
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
GPT2 = Architecture(
    "GPT2LMHeadModel",
    "gpt2",
    {
        "context_length": "n_positions",
        "embedding_length": "n_embd",
        "block_count": "n_layer",
        "feed_forward_length": "n_inner",
        "attention.head_count": "n_head",
        "attention.layer_norm_epsilon": "layer_norm_epsilon",
        "vocab_size": "vocab_size",
    },
    {
        "token_embd": "transformer.wte",
        "position_embd": "transformer.wpe",
        "output_norm": "transformer.ln_f",
        "output": "lm_head",
    },
    {
        "attn_norm": "ln_1",
        "attn_qkv": "attn.c_attn",
        "attn_output": "attn.c_proj",
        "ffn_norm": "ln_2",
        "ffn_up": "mlp.c_fc",
        "ffn_down": "mlp.c_proj",
    },
    layer_prefix="transformer.h.",
    transforms={
        name: _transpose for name in ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")
    },
    fixed={"activation_function": "gelu_new"},  # llama.cpp's gpt2 graph uses the tanh GELU
    rope=False,
)


def _query_scale(hf: dict[str, Any], n_layers_27b: int) -> float:
    """llama.cpp's Gemma query scaling: 1 / sqrt(head_dim), except the 27B models' 1 / sqrt(d_model / n_heads)."""
    if hf["num_hidden_layers"] == n_layers_27b:
        return hf["hidden_size"] // hf["num_attention_heads"]
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _gemma2(meta: Callable[[str], Any], hf: dict[str, Any]) -> dict[str, Any]:
    n = hf["num_hidden_layers"]
    return {  # llama.cpp's gemma2: every other layer local, starting with the first
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "query_pre_attn_scalar": _query_scale(hf, 46),
        "hidden_activation": "gelu_pytorch_tanh",
    }


GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's gemma3 fixes the local layers' RoPE base; the file keeps the global one


def _gemma3(meta: Callable[[str], Any], hf: dict[str, Any]) -> dict[str, Any]:
    n, pattern = hf["num_hidden_layers"], meta("attention.sliding_window_pattern") or 6
    if not isinstance(pattern, int):
        raise ValueError(f"attention.sliding_window_pattern {pattern!r} is not a layer period")
    full = dict(hf["rope_parameters"])
    return {  # llama.cpp's gemma3: five local layers, then one global
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)],
        "query_pre_attn_scalar": _query_scale(hf, 62),
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA},
        },
    }


GEMMA2 = Architecture(
    "Gemma2ForCausalLM",
    "gemma2",
    GEMMA_METADATA,
    {"token_embd": "model.embed_tokens", "output_norm": "model.norm"},
    GEMMA_LAYER,
    transforms=GEMMA_NORMS,
    extra=_gemma2,
)
GEMMA3 = Architecture(
    "Gemma3ForCausalLM",
    "gemma3_text",
    LLAMA_METADATA,
    {"token_embd": "model.embed_tokens", "output_norm": "model.norm"},
    {**GEMMA_LAYER, **QK_NORM},
    transforms=GEMMA_NORMS,
    extra=_gemma3,
)

# general.architecture -> Architecture (a `llama` file with experts is Mixtral: see `architecture_of` in gguf.py)
ARCHITECTURES: dict[str, Architecture] = {
    "llama": LLAMA,
    "mistral": MISTRAL,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "qwen2moe": QWEN2_MOE,
    "qwen3moe": QWEN3_MOE,
    "phi3": PHI3,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "gpt2": GPT2,
}


# ---- config.json keys that need more than a rename --------------------------------------------------------------


def llama3_rope(factors: torch.Tensor, theta: float, head_dim: int, original: int) -> dict[str, Any] | None:
    """Llama 3's rope_parameters from the per-frequency divisors llama.cpp's converter wrote (`rope_freqs`).

    The converter keeps no factor in the metadata, only divisors: 1 for short wavelengths, `factor` for long
    ones, 1 / ((1 - s) / factor + s) between, with s linear in original / wavelength. Their extremes give
    `factor`; a straight-line fit of s gives low_freq_factor and high_freq_factor (the three are defined up to
    a common scale with `original`, which the file does not keep, so Llama 3's 8192 stands in). None when the
    divisors fit no Llama 3 scaling; `llama3_divisors` is the check.
    """
    factors = factors.double()
    factor = factors.max().item()
    if factor <= 1.0:
        return None
    wavelength = 2 * torch.pi * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    x = original / wavelength
    if int(between.sum()) >= 2:
        s = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = (
            torch.linalg.lstsq(torch.stack([x[between], torch.ones_like(s)], dim=1), s[:, None])
            .solution.flatten()
            .tolist()
        )
        low = -intercept / slope
        high = low + 1 / slope
    else:  # no blend to fit: boundaries between the divided and the kept frequencies reproduce the divisors
        divided, kept = factors >= factor * (1 - 1e-6), factors <= 1 + 1e-6
        if between.any() or not kept.any():
            return None
        low = (x[divided].max() * x[kept].min()).sqrt().item()
        high = (low + x[kept].min().item()) / 2
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    if not 0 < low < high or not torch.allclose(llama3_divisors(params, theta, head_dim), factors, rtol=1e-5):
        return None
    return params


def llama3_divisors(params: dict[str, Any], theta: float, head_dim: int) -> torch.Tensor:
    """What llama.cpp's converter writes as rope_freqs for Llama 3's rope_parameters (float64)."""
    wavelength = 2 * torch.pi * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    smooth = (original / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelength > original / low, torch.full_like(wavelength, factor), blended)
    return torch.where(wavelength < original / high, torch.ones_like(wavelength), divisors)
