"""`tformer info` counts weights from the config by formula, without torch: the formula must give the numbers of
the model built on the meta device (the reference) for every preset and every component choice, and fall back to
that model for the families it does not know."""

import dataclasses
import subprocess
import sys

import pytest

from tformer import ConfigError, ModelConfig, config
from tformer.info import (
    FORMULA_CHOICES,
    counted_by_formula,
    counted_on_meta_model,
    format_info,
    model_info,
    weight_counts,
)
from tformer.presets import PRESETS

# one tiny preset per family and style: post-norm paper model, T5 (relative buckets, gated GELU, RMSNorm, untied),
# GPT-2, LLaMA (RMSNorm, SwiGLU, RoPE, GQA, untied), BERT (segments, embedding norm, MLM head with bias)
BASES = ("tiny-transformer", "tiny-t5", "tiny-gpt2", "tiny-llama", "tiny-bert")

# each applied to every base; the combinations the config refuses are left out
VARIANTS: list[dict] = [
    *({"ffn": ffn, "ffn_bias": bias} for ffn in config.FFN_NAMES for bias in (True, False)),
    *({"attention": kind, "position": "rope"} for kind in config.ATTENTION_NAMES),
    {"attention": "longformer", "position": "learned", "n_kv_heads": 2, "attn_bias": False},
    *(
        {"norm": norm, "norm_bias": bias, "norm_placement": placement}
        for norm in config.NORM_NAMES
        for bias in (True, False)
        for placement in config.NORM_PLACEMENTS
    ),
    *({"position": position} for position in config.POSITION_NAMES),
    {"position": "t5", "relative_attention_per_layer": True},
    {"position": "learned", "position_offset": 2},
    *({"n_kv_heads": heads} for heads in (1, 2, 4)),  # MQA, GQA, MHA
    {"head_dim": 12, "n_kv_heads": 1},
    *({"attn_bias": bias, "attn_out_bias": out_bias} for bias in (True, False) for out_bias in (None, True, False)),
    {"qk_norm": True},
    {"qk_norm": True, "norm": "layernorm", "norm_bias": True},
    *({"tie_embeddings": tie, "lm_head_bias": bias} for tie in (True, False) for bias in (True, False)),
    {"share_embeddings": False, "tgt_vocab_size": 53},
    {"share_embeddings": False, "tgt_vocab_size": 53, "tie_embeddings": False},
    {"type_vocab_size": 3},
    {"embedding_norm": True},
    {"type_vocab_size": 0, "embedding_norm": False},
    {"n_experts": 4, "n_experts_per_token": 2, "init": "normal"},
    {"n_experts": 4, "n_experts_per_token": 1, "moe_d_ff": 24, "ffn": "swiglu", "init": "normal"},
    {"n_experts": 3, "n_experts_per_token": 3, "moe_d_ff": 16, "moe_dense_layers": [1], "init": "normal"},
    {"n_experts": 4, "moe_router": "softmax-topk", "ffn": "gelu", "ffn_bias": False, "init": "normal"},
    {"sliding_window": 8},
    *({"encoder_head": head} for head in config.ENCODER_HEAD_NAMES if head not in config.CLASSIFICATION_HEADS),
    *({"encoder_head": head, "num_labels": 5} for head in sorted(config.CLASSIFICATION_HEADS)),
    {"n_encoder_layers": 3, "n_decoder_layers": 1, "d_ff": 40},
]

# several choices at once, where a formula that counts one part twice or in the wrong stack would show
COMBINED: list[tuple[str, dict]] = [
    (
        "tiny-transformer",
        {
            "share_embeddings": False,
            "tgt_vocab_size": 61,
            "tie_embeddings": False,
            "lm_head_bias": True,
            "norm": "rmsnorm",
            "norm_placement": "sandwich",
            "n_kv_heads": 2,
            "qk_norm": True,
            "ffn": "geglu",
            "n_experts": 4,
            "n_experts_per_token": 2,
            "moe_d_ff": 24,
            "moe_dense_layers": [0],
            "init": "normal",
            "type_vocab_size": 2,
            "embedding_norm": True,
            "position": "learned",
            "position_offset": 3,
        },
    ),
    (
        "tiny-t5",
        {"relative_attention_per_layer": True, "attn_out_bias": True, "n_encoder_layers": 3, "moe_dense_layers": None},
    ),
    (
        "tiny-bert",
        {
            "attention": "longformer",
            "attention_window": 4,
            "n_kv_heads": 1,
            "encoder_head": "sequence-classification",
            "num_labels": 3,
            "norm_placement": "deepnorm",
        },
    ),
    ("tiny-llama", {"n_experts": 8, "n_experts_per_token": 2, "qk_norm": True, "attn_bias": True}),
]


def grid() -> list[tuple[str, ModelConfig]]:
    cases = []
    for base in BASES:
        for overrides in VARIANTS:
            name = f"{base}-" + "-".join(f"{key}={value}" for key, value in overrides.items())
            try:
                cases.append((name, ModelConfig.from_preset(base, dropout=0.0, attn_dropout=0.0, **overrides)))
            except ConfigError:
                continue  # a combination the config refuses (e.g. longformer in a decoder)
    for base, overrides in COMBINED:
        cases.append((f"{base}-combined", ModelConfig.from_preset(base, dropout=0.0, attn_dropout=0.0, **overrides)))
    return cases


GRID = grid()


@pytest.mark.parametrize("name", PRESETS)
def test_formula_equals_the_meta_model_for_every_preset(name):
    config = ModelConfig.from_preset(name)
    counts = counted_by_formula(config)
    assert counts is not None, f"the formula should cover preset {name}"
    assert counts == counted_on_meta_model(config)


def test_the_grid_covers_every_component_choice():
    """Every choice of the fields that change weights appears in a grid config the formula counts."""
    seen = {key: {getattr(c, key) for _, c in GRID} for key in ("ffn", "attention", "norm", "norm_placement")}
    seen |= {key: {getattr(c, key) for _, c in GRID} for key in ("position", "encoder_head", "family")}
    for key, choices in FORMULA_CHOICES.items():
        assert set(choices) <= seen[key], f"{key}: {set(choices) - seen[key]} never built"
    configs = [c for _, c in GRID]
    assert any(c.n_experts and c.moe_dense_layers for c in configs)
    assert any(1 < c.n_kv_heads < c.n_heads for c in configs) and any(c.n_kv_heads == 1 for c in configs)
    assert any(not c.share_embeddings and c.family == "encoder-decoder" for c in configs)
    assert len(GRID) > 250


@pytest.mark.parametrize("name, config", GRID, ids=[name for name, _ in GRID])
def test_formula_equals_the_meta_model_across_component_choices(name, config):
    assert counted_by_formula(config) == counted_on_meta_model(config)


@pytest.mark.parametrize("family", ["ssm", "lstm-encoder-decoder", "conv-encoder-decoder"])
def test_families_without_transformer_blocks_are_counted_on_the_meta_model(family):
    extra = {"position": "learned"} if family == "conv-encoder-decoder" else {}
    config = ModelConfig(family=family, vocab_size=50, d_model=16, n_heads=2, d_ff=32, max_seq_len=32, **extra)
    assert counted_by_formula(config) is None
    assert weight_counts(config) == counted_on_meta_model(config)
    assert model_info(config).n_params == counted_on_meta_model(config).n_params > 0


def test_every_model_config_field_is_read_by_the_formula_or_leaves_the_weights_alone():
    """A new config field must be sorted here: one that changes the weights needs the formula taught (and a grid
    row), or `counted_by_formula` must give None for it, so that `info` never prints a count the model does not
    have."""
    shapes_weights = {
        "family", "vocab_size", "tgt_vocab_size", "d_model", "n_encoder_layers", "n_decoder_layers", "n_heads",
        "n_kv_heads", "head_dim", "d_ff", "max_seq_len", "type_vocab_size", "position_offset", "position",
        "relative_attention_buckets", "relative_attention_per_layer", "ffn", "ffn_bias", "attn_bias",
        "attn_out_bias", "qk_norm", "norm", "norm_bias", "norm_placement", "embedding_norm", "tie_embeddings",
        "share_embeddings", "lm_head_bias", "encoder_head", "num_labels", "attention", "n_experts",
        "n_experts_per_token", "moe_d_ff", "moe_dense_layers",
        # only the families the formula leaves to the meta model
        "lstm_hidden", "conv_hidden", "conv_kernel", "ssm_state_size", "ssm_conv_width", "ssm_expand",
    }  # fmt: skip
    leaves_weights = {
        "pad_token_id", "dropout", "attn_dropout", "sinusoidal_base", "sinusoidal_layout", "rope_theta",
        "rope_scaling", "rope_factor", "rope_original_max_len", "yarn_beta_fast", "yarn_beta_slow",
        "rope_low_freq_factor", "rope_high_freq_factor", "rope_local_theta", "relative_attention_max_distance",
        "norm_eps", "scale_embeddings", "round_embed_scale", "final_logit_softcap", "scale_decoder_output",
        "label_names", "sliding_window", "layer_types", "attn_logit_softcap", "attention_scale_dim",
        "attention_backend", "scale_attention", "attention_window", "performer_features", "sparse_stride",
        "sparse_summary", "activation_checkpointing", "moe_router", "router_aux_loss_coef", "init", "init_std",
    }  # fmt: skip
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not shapes_weights & leaves_weights
    known = shapes_weights | leaves_weights
    assert fields == known, f"unsorted: {sorted(fields - known)}; gone: {sorted(known - fields)}"


@pytest.mark.parametrize("name", ["gpt2", "transformer-base", "bert-base", "mistral-7b", "gemma2-2b", "tiny-t5"])
def test_info_prints_what_the_meta_model_gives(name, monkeypatch):
    """Same figures and text as when every count came from the meta model, at several contexts and dtypes."""
    config = ModelConfig.from_preset(name)
    settings = [(None, "fp16"), (1, "int8"), (7, "fp32"), (100_000, "bf16")]
    by_formula = [format_info(name, config, model_info(config, *s)) for s in settings]
    monkeypatch.setattr("tformer.info.weight_counts", counted_on_meta_model)
    assert by_formula == [format_info(name, config, model_info(config, *s)) for s in settings]


@pytest.mark.parametrize("argv", [["info", "gpt2"], ["info", "t5-base", "--dtype", "int8"], ["presets"]])
def test_info_and_presets_never_import_torch(argv):
    """torch's import is most of a second; `info` and `presets` on the Transformer families need none of it."""
    code = (
        "import sys\nfrom tformer.cli import main\n"
        f"code = main({argv!r})\n"
        "print(code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')), file=sys.stderr)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stderr.strip().splitlines()[-1] == "0 []"
    assert "parameters" in run.stdout or "gpt2" in run.stdout
