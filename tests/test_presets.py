"""Presets: each builds, and parameter counts equal the released models' (and transformers' own count)."""

import functools

import pytest
import torch
import transformers

from tformer import ModelConfig, build_model
from tformer.presets import PRESETS

RELEASED_COUNTS = {
    "gpt2": 124_439_808,
    "llama2-7b": 6_738_415_616,
    "llama2-70b": 68_976_648_192,
    "mistral-7b": 7_241_732_096,
    # the families of issue 51 (their safetensors headers); MoE counts hold every expert
    "llama3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,
    "gemma2-2b": 2_614_341_888,
    "phi3-mini": 3_821_079_552,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
}


@functools.cache
def built_on_meta(name: str) -> tuple[str, int]:
    """The class and parameter count of preset `name` built on the meta device, once per run (the MoE presets'
    thousands of experts take seconds to build, and several tests ask for the same preset)."""
    with torch.device("meta"):
        model = build_model(ModelConfig.from_preset(name))
    return type(model).__name__, model.num_parameters()


def meta_count(name: str) -> int:
    return built_on_meta(name)[1]


def hf_meta_count(model_class: type, config: transformers.PretrainedConfig) -> int:
    with torch.device("meta"):
        model = model_class(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds(name):
    config = ModelConfig.from_preset(name)
    model_class, parameters = built_on_meta(name)
    assert parameters > 0
    assert (
        model_class
        == {"encoder-decoder": "EncoderDecoder", "decoder": "DecoderLM", "encoder": "EncoderMLM"}[config.family]
    )


@pytest.mark.parametrize("name, count", RELEASED_COUNTS.items())
def test_parameter_counts_equal_released_models(name, count):
    assert meta_count(name) == count


@pytest.mark.parametrize(
    "name, model_class, hf_config",
    [
        ("gpt2-medium", transformers.GPT2LMHeadModel, transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16)),
        (
            "llama2-13b",
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(
                hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40
            ),
        ),
        (
            "smollm2-135m",
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(
                vocab_size=49152,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                tie_word_embeddings=True,
            ),
        ),
        ("bert-base", transformers.BertForMaskedLM, transformers.BertConfig()),
        (
            "bert-large",
            transformers.BertForMaskedLM,
            transformers.BertConfig(
                hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
            ),
        ),
    ],
)
def test_parameter_counts_equal_transformers(name, model_class, hf_config):
    assert meta_count(name) == hf_meta_count(model_class, hf_config)


def test_paper_models_are_about_the_published_size():
    # The paper reports 65M (base) and 213M (big) parameters with a 37k shared vocabulary.
    assert meta_count("transformer-base") == pytest.approx(65e6, rel=0.05)
    assert meta_count("transformer-big") == pytest.approx(213e6, rel=0.02)


def test_gpt3_is_175b():
    assert meta_count("gpt3-175b") == pytest.approx(175e9, rel=0.01)


def test_tformer_presets_lists_each_released_count(capsys: pytest.CaptureFixture[str]) -> None:
    from tformer.commands.inspect import presets

    presets()
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()}
    assert rows.keys() == PRESETS.keys()
    for name, count in RELEASED_COUNTS.items():
        assert rows[name] == f"{count:,}"
