"""The Hugging Face tests' reference models: transformers models built from configs with random weights, one per
case of `CASES`, which the interop tests load into tformer and compare logit for logit."""

from __future__ import annotations

from typing import Any

import torch

# ---- Hugging Face: reference models built by transformers from configs, with random weights ---------------

ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 500.0}
# case -> (model_type, architecture, config fields). The "-odd" cases have odd head counts and widths, a vocabulary
# that is no multiple of 8, GQA with an odd number of KV heads, untied or unshared embeddings and other activations.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("gpt2", "GPT2LMHeadModel", dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
    "gpt2-odd": (
        "gpt2",
        "GPT2LMHeadModel",
        dict(
            vocab_size=101,
            n_positions=48,
            n_embd=33,
            n_layer=3,
            n_head=3,
            n_inner=50,
            activation_function="gelu",
            layer_norm_epsilon=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "llama": (
        "llama",
        "LlamaForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            rope_parameters=ROPE_DEFAULT,
        ),
    ),
    "llama-odd": (
        "llama",
        "LlamaForCausalLM",
        dict(
            vocab_size=101,
            hidden_size=36,
            intermediate_size=50,
            num_hidden_layers=3,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=6,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        ),
    ),
    "llama-dynamic": (
        "llama",
        "LlamaForCausalLM",
        dict(  # inputs run past the 8 trained positions
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=8,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0},
        ),
    ),
    "llama-yarn": (
        "llama",
        "LlamaForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=256,
            rope_parameters={  # betas that move the ramp's ends
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 2.0,
                "beta_slow": 0.25,
                "rope_theta": 50.0,
            },
        ),
    ),
    "mistral": (
        "mistral",
        "MistralForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=4,
        ),
    ),
    "mistral-odd": (
        "mistral",
        "MistralForCausalLM",
        dict(
            vocab_size=101,
            hidden_size=36,
            intermediate_size=50,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=6,
            max_position_embeddings=64,
            sliding_window=5,
            tie_word_embeddings=True,
        ),
    ),
    "bert-mlm": (
        "bert",
        "BertForMaskedLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        ),
    ),
    "bert-mlm-odd": (
        "bert",
        "BertForMaskedLM",
        dict(
            vocab_size=101,
            hidden_size=33,
            num_hidden_layers=3,
            num_attention_heads=3,
            intermediate_size=50,
            max_position_embeddings=40,
            type_vocab_size=3,
            hidden_act="gelu_new",
            layer_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "bert": (
        "bert",
        "BertModel",
        dict(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        ),
    ),
    "bert-odd": (
        "bert",
        "BertModel",
        dict(
            vocab_size=101,
            hidden_size=33,
            num_hidden_layers=1,
            num_attention_heads=11,
            intermediate_size=50,
            max_position_embeddings=40,
            type_vocab_size=1,
            hidden_act="relu",
        ),
    ),
    "bart": (
        "bart",
        "BartForConditionalGeneration",
        dict(
            vocab_size=96,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
        ),
    ),
    "bart-odd": (
        "bart",
        "BartForConditionalGeneration",
        dict(
            vocab_size=101,
            d_model=33,
            encoder_layers=3,
            decoder_layers=2,
            encoder_attention_heads=3,
            decoder_attention_heads=3,
            encoder_ffn_dim=50,
            decoder_ffn_dim=50,
            max_position_embeddings=64,
            scale_embedding=True,
            activation_function="relu",
            tie_word_embeddings=False,
        ),
    ),
    "marian": (
        "marian",
        "MarianMTModel",
        dict(
            vocab_size=96,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            pad_token_id=95,
            decoder_start_token_id=95,
            eos_token_id=0,
            scale_embedding=True,
            activation_function="swish",
        ),
    ),
    "marian-odd": (
        "marian",
        "MarianMTModel",
        dict(
            vocab_size=101,
            decoder_vocab_size=89,
            share_encoder_decoder_embeddings=False,
            d_model=30,
            encoder_layers=3,
            decoder_layers=2,
            encoder_attention_heads=3,
            decoder_attention_heads=3,
            encoder_ffn_dim=50,
            decoder_ffn_dim=50,
            max_position_embeddings=64,
            pad_token_id=88,
            decoder_start_token_id=88,
            eos_token_id=0,
            scale_embedding=True,
        ),
    ),
}


def hf_model(case: str) -> Any:
    """The transformers model of a case with random weights: every parameter moved off its initial value."""
    import transformers  # slow to import: only the tests that build a reference model pay for it

    model_type, architecture, fields = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # norm gains away from 1, biases away from 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if not (model_type == "marian" and "embed_positions" in name):  # Marian's fixed sinusoids
                p.add_(torch.randn_like(p) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("final_logits_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.2)
    return model.eval()
