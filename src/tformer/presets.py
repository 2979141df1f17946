"""Named model configurations, as plain data. `ModelConfig.from_preset(name)` turns one into a config.

Sizes are those of the published models; the parameter counts of GPT-2, LLaMA-2 and Mistral match the
released checkpoints exactly (see tests/test_presets.py).
"""

from __future__ import annotations

from typing import Any

_PAPER = {  # "Attention Is All You Need": post-norm, ReLU FFN, sinusoidal positions, shared embeddings
    "family": "encoder-decoder",
    "vocab_size": 37000,  # the paper's shared EN-DE byte-pair vocabulary
    "max_seq_len": 1024,
    "position": "sinusoidal",
    "ffn": "relu",
    "norm": "layernorm",
    "norm_placement": "post",
    "scale_embeddings": True,
    "tie_embeddings": True,
    "share_embeddings": True,
    "init": "xavier",
    "attn_dropout": 0.1,
}

_GPT2 = {  # pre-norm, learned positions, tanh-GELU, tied output, scaled residual init
    "family": "decoder",
    "vocab_size": 50257,
    "n_encoder_layers": 0,
    "max_seq_len": 1024,
    "position": "learned",
    "ffn": "gelu-tanh",
    "norm": "layernorm",
    "norm_placement": "pre",
    "scale_embeddings": False,
    "tie_embeddings": True,
    "init": "gpt2",
    "dropout": 0.1,
    "attn_dropout": 0.1,
}

_LLAMA = {  # pre-RMSNorm, RoPE, SwiGLU, no biases, untied output
    "family": "decoder",
    "vocab_size": 32000,
    "n_encoder_layers": 0,
    "max_seq_len": 4096,
    "position": "rope",
    "rope_theta": 10000.0,
    "ffn": "swiglu",
    "ffn_bias": False,
    "attn_bias": False,
    "norm": "rmsnorm",
    "norm_eps": 1e-5,
    "norm_placement": "pre",
    "scale_embeddings": False,
    "tie_embeddings": False,
    "init": "normal",
    "dropout": 0.0,
}

_BERT = {  # post-norm encoder, learned positions + segments, embedding LayerNorm, MLM head with bias
    "family": "encoder",
    "vocab_size": 30522,
    "n_decoder_layers": 0,
    "max_seq_len": 512,
    "type_vocab_size": 2,
    "position": "learned",
    "ffn": "gelu",
    "norm": "layernorm",
    "norm_eps": 1e-12,
    "norm_placement": "post",
    "embedding_norm": True,
    "scale_embeddings": False,
    "tie_embeddings": True,
    "lm_head_bias": True,
    "init": "normal",
    "dropout": 0.1,
    "attn_dropout": 0.1,
}

_T5 = {  # T5: relative position buckets, pre-RMSNorm, no biases, unscaled scores, tied head on a scaled output
    "family": "encoder-decoder",
    "vocab_size": 32128,
    "max_seq_len": 512,
    "position": "t5",
    "ffn": "relu",
    "ffn_bias": False,
    "attn_bias": False,
    "norm": "rmsnorm",
    "norm_eps": 1e-6,
    "norm_placement": "pre",
    "scale_embeddings": False,
    "scale_attention": False,
    "tie_embeddings": True,
    "share_embeddings": True,
    "scale_decoder_output": True,
    "init": "normal",
    "dropout": 0.1,
    "attn_dropout": 0.1,
}
_T5_V1_1 = {**_T5, "ffn": "geglu-tanh", "tie_embeddings": False, "scale_decoder_output": False}  # gated, untied


def _t5(base: dict[str, Any], d_model: int, n_layers: int, n_heads: int, d_ff: int) -> dict[str, Any]:
    layers = {"n_encoder_layers": n_layers, "n_decoder_layers": n_layers}
    return {**base, "d_model": d_model, "n_heads": n_heads, "head_dim": 64, "d_ff": d_ff, **layers}


def _gpt2(d_model: int, n_layers: int, n_heads: int, **extra: Any) -> dict[str, Any]:
    return {**_GPT2, "d_model": d_model, "n_decoder_layers": n_layers, "n_heads": n_heads, "d_ff": 4 * d_model, **extra}


PRESETS: dict[str, dict[str, Any]] = {
    "transformer-base": {**_PAPER, "d_model": 512, "n_heads": 8, "d_ff": 2048, "dropout": 0.1},
    "transformer-big": {**_PAPER, "d_model": 1024, "n_heads": 16, "d_ff": 4096, "dropout": 0.3},
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "gpt3-175b": _gpt2(12288, 96, 96, max_seq_len=2048, dropout=0.0, attn_dropout=0.0),
    "llama2-7b": {**_LLAMA, "d_model": 4096, "n_decoder_layers": 32, "n_heads": 32, "d_ff": 11008},
    "llama2-13b": {**_LLAMA, "d_model": 5120, "n_decoder_layers": 40, "n_heads": 40, "d_ff": 13824},
    "llama2-70b": {
        **_LLAMA,
        "d_model": 8192,
        "n_decoder_layers": 80,
        "n_heads": 64,
        "n_kv_heads": 8,
        "d_ff": 28672,
    },
    "mistral-7b": {
        **_LLAMA,
        "d_model": 4096,
        "n_decoder_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "d_ff": 14336,
        "max_seq_len": 32768,
        "sliding_window": 4096,
    },
    "bert-base": {**_BERT, "d_model": 768, "n_encoder_layers": 12, "n_heads": 12, "d_ff": 3072},
    "bert-large": {**_BERT, "d_model": 1024, "n_encoder_layers": 24, "n_heads": 16, "d_ff": 4096},
    "smollm2-135m": {
        **_LLAMA,
        "vocab_size": 49152,
        "d_model": 576,
        "n_decoder_layers": 30,
        "n_heads": 9,
        "n_kv_heads": 3,
        "d_ff": 1536,
        "max_seq_len": 8192,
        "rope_theta": 100000.0,
        "tie_embeddings": True,
    },
    "t5-small": _t5(_T5, 512, 6, 8, 2048),
    "t5-base": _t5(_T5, 768, 12, 12, 3072),
    "t5-v1_1-small": _t5(_T5_V1_1, 512, 8, 6, 1024),
    "t5-v1_1-base": _t5(_T5_V1_1, 768, 12, 12, 2048),
    # tiny configs for tests and smoke runs, one per family
    "tiny-transformer": {
        **_PAPER,
        "vocab_size": 97,
        "d_model": 32,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "n_heads": 4,
        "d_ff": 64,
        "max_seq_len": 64,
    },
    "tiny-gpt2": _gpt2(32, 2, 4, vocab_size=97, max_seq_len=64),
    "tiny-llama": {
        **_LLAMA,
        "vocab_size": 97,
        "d_model": 32,
        "n_decoder_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "d_ff": 80,
        "max_seq_len": 64,
    },
    "tiny-t5": {
        **_T5_V1_1,
        "vocab_size": 97,
        "d_model": 32,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "n_heads": 4,
        "d_ff": 64,
        "max_seq_len": 64,
        "relative_attention_buckets": 8,
        "relative_attention_max_distance": 16,
    },
    "tiny-bert": {
        **_BERT,
        "vocab_size": 97,
        "d_model": 32,
        "n_encoder_layers": 2,
        "n_heads": 4,
        "d_ff": 64,
        "max_seq_len": 64,
    },
}
