"""GGUF files of every supported architecture, written from tiny random `transformers` models as llama.cpp's
converter writes them (tests/gguf_writers.py), loaded by tformer.

References: the `transformers` model the weights came from (an F32 file is lossless, so logits agree to float
rounding), and `transformers` loading the same quantized file (`from_pretrained(dir, gguf_file=...)`), which
dequantizes the same bits. Where transformers' GGUF reader departs from llama.cpp (it ignores Llama 3's
rope_freqs and Gemma's query scale) only the source model is the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf_writers
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tformer.interop.gguf import GGUFError, from_gguf
from tformer.interop.gguf_arch import ARCHITECTURES, llama3_rope
from tformer.interop.hf import FAMILIES as HF_FAMILIES

transformers = pytest.importorskip("transformers")

SIZES = {**gguf_writers.TINY_SIZES, "rms_norm_eps": 1e-5, "initializer_range": 0.15}
IDS = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2, 71, 33, 12, 50]])


def _llama() -> Any:
    return gguf_writers.tiny_llama(**SIZES, rope_theta=500.0)


def _llama3() -> Any:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return gguf_writers.tiny_llama(**SIZES, rope_parameters=rope)


def _mistral() -> Any:  # llama.cpp writes Mistral as a llama file; a window past the context changes nothing
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, sliding_window=4096))


def _mixtral() -> Any:
    config = transformers.MixtralConfig(**{**SIZES, "intermediate_size": 32}, num_local_experts=4)
    return transformers.MixtralForCausalLM(config)


def _qwen2() -> Any:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES, tie_word_embeddings=True))


def _qwen3(for_transformers: bool = False) -> Any:
    head_dim = 128 if for_transformers else 24  # transformers' reader skips key_length: Qwen3Config's 128 holds
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**SIZES, head_dim=head_dim, tie_word_embeddings=False)
    )


def _qwen3_moe(for_transformers: bool = False) -> Any:
    width = 768 if for_transformers else 32  # transformers' reader skips expert_feed_forward_length
    config = transformers.Qwen3MoeConfig(
        **SIZES, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=width, norm_topk_prob=True
    )
    return transformers.Qwen3MoeForCausalLM(config)


def _qwen2_moe() -> Any:
    config = transformers.Qwen2MoeConfig(
        **SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    )
    return transformers.Qwen2MoeForCausalLM(config)


def _phi3() -> Any:
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**SIZES, pad_token_id=0))


def _gemma2() -> Any:
    config = transformers.Gemma2Config(
        **SIZES,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )
    return transformers.Gemma2ForCausalLM(config)


def _gemma3() -> Any:
    config = transformers.Gemma3TextConfig(
        **{**SIZES, "num_hidden_layers": 6},
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    return transformers.Gemma3ForCausalLM(config)


def _gpt2(for_transformers: bool = False) -> Any:
    positions = 1024 if for_transformers else 128  # transformers' reader skips context_length: GPT2Config's 1024
    config = transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=positions, initializer_range=0.15
    )
    return transformers.GPT2LMHeadModel(config)


# arch -> (model builder, whether transformers' GGUF reader is a reference for it)
CASES: dict[str, tuple[Callable[[], Any], bool]] = {
    "llama": (_llama, True),
    "llama3": (_llama3, False),  # transformers' reader drops rope_freqs
    "mistral": (_mistral, False),  # transformers' reader has no tensor names for a "mistral" model
    "mixtral": (_mixtral, False),  # nor for Mixtral
    "qwen2": (_qwen2, True),
    "qwen3": (_qwen3, True),
    "qwen3moe": (_qwen3_moe, True),
    "qwen2moe": (_qwen2_moe, False),  # (a shared expert: the test checks the error while tformer has none)
    "phi3": (_phi3, True),
    "gemma2": (_gemma2, False),  # transformers' reader keeps Gemma2Config's query_pre_attn_scalar 256
    "gemma3": (_gemma3, False),
    "gpt2": (_gpt2, True),
}


LLAMA_FILES = ("llama3", "mistral", "mixtral")  # what llama.cpp writes as general.architecture llama
FOR_TRANSFORMERS = ("qwen3", "qwen3moe", "gpt2")  # builders with a variant for what transformers' reader skips


def tiny(case: str, for_transformers: bool = False) -> Any:
    torch.manual_seed(0)
    build = CASES[case][0]
    model = (build(for_transformers=True) if for_transformers and case in FOR_TRANSFORMERS else build()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_((0.0 if "gemma" in case else 1.0) + 0.3 * torch.randn_like(p))
    return model


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def supported(arch: str) -> bool:
    return ARCHITECTURES[arch].hf_architecture in HF_FAMILIES


@pytest.mark.parametrize("case", list(CASES))
def test_each_architecture_matches_its_source_model(case: str, tmp_path: Path) -> None:
    arch = "llama" if case in LLAMA_FILES else case
    model = tiny(case)
    path = gguf_writers.write(tmp_path / f"{case}.gguf", model, arch)
    if not supported(arch):
        with pytest.raises(
            GGUFError, match=f"this GGUF model is a {ARCHITECTURES[arch].hf_architecture}, which tformer cannot"
        ):
            from_gguf(path)
        return
    ours = from_gguf(path)
    assert (logits(ours, IDS) - logits(model, IDS)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", [case for case, (_, reference) in CASES.items() if reference])
def test_quantized_file_matches_transformers_reading_it(case: str, tmp_path: Path) -> None:
    if not supported(case):
        pytest.skip(f"{case}: tformer's Hugging Face family is not there yet (the test above checks the error)")
    keys = {
        "tokenizer.ggml.padding_token_id": 0,  # else transformers keeps Phi3Config's 32000, past the vocabulary
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(96)],  # transformers' gpt2 reads the vocabulary size here
    }
    path = gguf_writers.write(tmp_path / f"{case}.gguf", tiny(case, for_transformers=True), case, Q.Q8_0, keys=keys)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    assert (logits(from_gguf(path), IDS) - logits(theirs, IDS)).abs().max().item() <= 1e-4


def test_llama3_divisors_give_back_the_scaling_they_came_from() -> None:
    for head_dim, theta, original in [(64, 500000.0, 8192), (128, 500000.0, 8192), (16, 500.0, 32)]:
        rope = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original,
        }
        divisors = torch.from_numpy(gguf_writers.llama3_divisors(rope, head_dim))
        found = llama3_rope(divisors, theta, head_dim, original)
        assert found is not None
        assert found["factor"] == 32.0 and found["original_max_position_embeddings"] == original
        assert abs(found["low_freq_factor"] - 1.0) < 1e-3 and abs(found["high_freq_factor"] - 4.0) < 1e-3
    assert llama3_rope(torch.linspace(1, 3, 8), 500.0, 16, 32) is None  # no Llama 3 scaling makes these
