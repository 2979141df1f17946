"""ModelConfig: serialization round trips and the ConfigError messages a user sees."""

import json

import pytest

from tformer import ConfigError, ModelConfig


def test_defaults_are_the_paper_base_model():
    config = ModelConfig()
    assert (config.family, config.d_model, config.n_heads, config.d_ff) == ("encoder-decoder", 512, 8, 2048)
    assert (config.n_encoder_layers, config.n_decoder_layers) == (6, 6)
    assert config.sinusoidal_base == 10000.0  # seed 000 writes 1000, a typo for the paper's 10000
    assert (config.norm_placement, config.ffn, config.position) == ("post", "relu", "sinusoidal")
    assert (config.n_kv_heads, config.head_dim, config.tgt_vocab_size) == (8, 64, config.vocab_size)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_round_trip(tmp_path, suffix):
    config = ModelConfig.from_preset("mistral-7b", rope_scaling="yarn", rope_factor=4.0)
    path = tmp_path / f"model{suffix}"
    config.to_file(path)
    assert ModelConfig.from_file(path) == config
    if suffix == ".json":
        assert json.loads(path.read_text())["sliding_window"] == 4096


def test_recipe_file_with_model_section(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  family: decoder\n  n_encoder_layers: 0\n  d_model: 64\n  n_heads: 4\n")
    config = ModelConfig.from_file(path)
    assert (config.family, config.d_model, config.head_dim) == ("decoder", 64, 16)


def test_int_is_accepted_for_float_fields():
    value = ModelConfig(rope_theta=500000).rope_theta
    assert type(value) is float and value == 500000.0  # 500000 == 500000.0 holds for an int too


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 500, "n_heads": 8}, "d_model (500) must be divisible by n_heads (8)"),
        ({"n_heads": 8, "n_kv_heads": 3}, "n_heads (8) must be divisible by n_kv_heads (3)"),
        ({"position": "rope", "d_model": 24, "n_heads": 8}, "head_dim must be even, got 3"),
        ({"position": "rop"}, "unknown position 'rop'; did you mean 'rope'?"),
        ({"ffn": "swishglu"}, "unknown ffn 'swishglu'; did you mean 'swiglu'?"),
        ({"norm_placement": "middle"}, "choose one of: post, pre, sandwich, deepnorm"),
        ({"attention_backend": "flash3"}, "unknown attention_backend 'flash3'"),
        ({"family": "encoder", "sliding_window": 128}, "sliding_window applies to causal self-attention"),
        ({"dropout": 1.5}, "dropout must be in [0, 1)"),
        ({"d_model": "512"}, "d_model must be int, got '512' (str)"),
        ({"tie_embeddings": 1}, "tie_embeddings must be bool"),
        ({"sliding_window": 0, "family": "decoder"}, "sliding_window must be at least 1"),
        ({"rope_scaling": "yarn"}, "rope_scaling 'yarn' needs position 'rope'"),
        ({"tgt_vocab_size": 100}, "share_embeddings needs one joint vocabulary"),
        ({"family": "decoder", "n_decoder_layers": 0}, "needs n_decoder_layers >= 1"),
        ({"pad_token_id": 50000}, "pad_token_id (50000) must be a token id below vocab_size"),
        ({"sinusoidal_layout": "spilt"}, "unknown sinusoidal_layout 'spilt'; did you mean 'split'?"),
        ({"family": "encoder", "encoder_head": "pooler"}, "unknown encoder_head 'pooler'; choose one of: mlm, none"),
        ({"encoder_head": "none"}, "encoder_head 'none' applies to family 'encoder' only"),
    ],
)
def test_config_errors_say_what_to_change(overrides, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**overrides)
    assert message in str(err.value)


def test_unknown_key_in_file_names_file_and_suggests(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("d_modle: 512\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'd_modle'; did you mean 'd_model'\?"):
        ModelConfig.from_file(path)


def test_bad_value_in_file_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("n_heads: 7\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: d_model \(512\) must be divisible by n_heads \(7\)"):
        ModelConfig.from_file(path)


def test_unparseable_and_missing_files(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("d_model: [512\n")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML/JSON"):
        ModelConfig.from_file(path)
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_file(tmp_path / "nope.yaml")
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of config keys, got list"):
        ModelConfig.from_file(path)


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match="unknown preset 'lama2-7b'; did you mean 'llama2-7b'"):
        ModelConfig.from_preset("lama2-7b")


def test_deepnorm_coefficients_match_the_deepnet_paper():
    # DeepNet Table 1: decoder-only alpha = (2M)^(1/4), beta = (8M)^(-1/4);
    # encoder-decoder encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16); decoder (3M)^(1/4), (12M)^(-1/4)
    decoder = ModelConfig(family="decoder", n_decoder_layers=18, norm_placement="deepnorm")
    assert decoder.deepnorm_coefficients("decoder") == pytest.approx((36**0.25, 144**-0.25))
    seq2seq = ModelConfig(n_encoder_layers=6, n_decoder_layers=6, norm_placement="deepnorm")
    assert seq2seq.deepnorm_coefficients("encoder") == pytest.approx(
        (0.81 * 7776 ** (1 / 16), 0.87 * 7776 ** (-1 / 16))
    )
    assert seq2seq.deepnorm_coefficients("decoder") == pytest.approx((18**0.25, 72**-0.25))


def test_yaml_exponent_without_dot_reads_as_float(tmp_path):
    path = tmp_path / "eps.yaml"
    path.write_text("norm_eps: 1e-6\nrope_theta: 1e5\n")  # PyYAML reads these as strings
    config = ModelConfig.from_file(path)
    assert (config.norm_eps, config.rope_theta) == (1e-6, 1e5)
    path.write_text("norm_eps: tiny\n")
    with pytest.raises(ConfigError, match="norm_eps must be float, got 'tiny'"):
        ModelConfig.from_file(path)
