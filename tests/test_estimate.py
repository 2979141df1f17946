"""`tformer estimate` against measured training steps, the ZeRO paper's 16 bytes per parameter, and bad input."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tformer import ConfigError, ModelConfig
from tformer.training.estimate import estimate_memory, format_estimate, load_inputs
from tformer.training.lora import LoRAConfig
from tformer.training.memory import LiveTensorTracker, measure_training_step

LLAMA2_7B_PARAMS = 6_738_415_616
RECIPE = Path(__file__).resolve().parent.parent / "configs" / "en-de-10min.yaml"


def test_tracker_counts_new_storages_once_and_frees_them():
    tracker = LiveTensorTracker()
    with tracker:
        a = torch.ones(1000)  # 4,000 bytes
        view = a[10:20].view(2, 5)  # a view: no new storage
        b = torch.zeros(500, dtype=torch.bfloat16)  # 1,000 bytes
        assert tracker.current == 5000
        del a, view
        assert tracker.current == 1000
        c = b.float()  # 2,000 bytes
        del b, c
    assert tracker.current == 0
    assert tracker.peak == 5000


@pytest.mark.parametrize(
    ("name", "overrides", "dtype"),
    [
        ("tiny-transformer", {}, "fp32"),  # post-norm, dropout and attention dropout (torch's math fallback)
        ("tiny-gpt2", {"activation_checkpointing": True}, "bf16-autocast"),
        ("tiny-llama", {"attention_backend": "math"}, "fp32"),  # GQA, RoPE, SwiGLU, RMSNorm
        ("tiny-bert", {}, "bf16-autocast"),  # MLM head
    ],
)
def test_estimate_matches_the_measured_peak_of_a_training_step(name, overrides, dtype):
    config = ModelConfig.from_preset(name, d_model=64, d_ff=128, vocab_size=500, **overrides)
    batch, seq_len = 8, 32
    measured = measure_training_step(config, batch, seq_len, dtype)  # the reference: live tensors in a real step
    estimate = estimate_memory(config, batch * seq_len, seq_len, dtype, device="cpu")
    assert estimate.total == pytest.approx(measured.peak_bytes, rel=0.15)
    resident = estimate.weights + estimate.optimizer_state  # held before the step starts
    assert resident == pytest.approx(measured.start_bytes, rel=0.15)


@pytest.mark.parametrize("dtype", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_adam_is_16_bytes_per_parameter_for_llama2_7b(dtype):
    # ZeRO (Rajbhandari et al., 2020, sec. 3.1): 2 (half weights) + 2 (half gradients) + 12 (fp32 master weights,
    # momentum and variance) = 16 bytes per parameter.
    config = ModelConfig.from_preset("llama2-7b")
    estimate = estimate_memory(config, 4096, 4096, dtype, device="cuda")
    n = estimate.n_params
    assert n == LLAMA2_7B_PARAMS
    assert estimate.gradients == 2 * n
    rope_frequencies = (config.head_dim // 2) * 2  # the only buffer: head_dim / 2 RoPE frequencies in bf16
    assert estimate.weights == 2 * n + rope_frequencies
    step_counters = 4 * (2 + 9 * config.n_decoder_layers + 1)  # fused Adam's fp32 step per parameter tensor
    assert estimate.optimizer_state == 12 * n + step_counters
    assert estimate.model_states // n == 16
    assert "16.0 bytes per parameter" in format_estimate("llama2-7b", config, estimate)


def test_fp32_adam_is_16_and_pure_bf16_is_8_bytes_per_parameter():
    config = ModelConfig.from_preset("tiny-llama")
    for dtype, per_param in (("fp32", 16), ("bf16-autocast", 16), ("bf16-pure", 8)):
        estimate = estimate_memory(config, 64, 64, dtype)
        assert estimate.model_states // estimate.n_params == per_param


def test_zero_stages_shard_optimizer_state_then_gradients_then_weights():
    config = ModelConfig.from_preset("gpt2")
    alone = estimate_memory(config, 1024, 1024, "bf16-mixed", device="cuda")
    world = 8
    for stage in (1, 2, 3):
        estimate = estimate_memory(config, 1024, 1024, "bf16-mixed", stage=stage, world_size=world, device="cuda")
        assert estimate.optimizer_state == alone.optimizer_state // world
        if stage >= 2:
            assert estimate.gradients == alone.gradients // world
        else:
            assert estimate.gradients == alone.gradients
        buffers = alone.weights - 2 * alone.n_params  # buffers are not sharded
        assert estimate.weights == (2 * alone.n_params // world + buffers if stage == 3 else alone.weights)
        assert estimate.activations == alone.activations  # each rank runs its own micro-batch
    zero3 = estimate_memory(config, 1024, 1024, "bf16-mixed", stage=3, world_size=world, device="cuda")
    assert zero3.temporaries > alone.temporaries  # gathered blocks and the root's weights
    assert zero3.total < alone.total


def test_activations_grow_linearly_with_batch_tokens_and_depend_on_length():
    config = ModelConfig.from_preset("tiny-transformer", attention_backend="math")
    a1, a2, a3 = (estimate_memory(config, n * 256, 32).activations for n in (1, 2, 3))
    assert a2 - a1 == pytest.approx(a3 - a2, abs=2)
    assert a2 == pytest.approx(2 * a1, abs=2)
    short, long = (estimate_memory(config, 1024, seq_len).activations for seq_len in (16, 64))
    assert long > short  # the math path saves (B, H, T, T) attention weights: tokens x length


def test_checkpointing_keeps_only_block_inputs():
    config = ModelConfig.from_preset("tiny-gpt2")
    full = estimate_memory(config, 1024, 64)
    kept = estimate_memory(config, 1024, 64, checkpointing=True)
    assert kept.activations < full.activations / 2
    assert kept.weights == full.weights


def test_recipe_inputs_follow_the_train_section():
    model, kwargs = load_inputs(str(RECIPE), ["train.max_tokens=4096"])
    assert kwargs == {
        "batch_tokens": 4096,
        "seq_len": 101,  # max_len 100 + </s>
        "dtype": "bf16-autocast",
        "optimizer": "adam-noam",
        "stage": 0,
        "lora": None,  # a full training run: every parameter trains
    }
    assert model.vocab_size == 4000  # the recipe's tokenizer, as the trainer builds the model
    preset, defaults = load_inputs("tiny-llama")
    assert defaults == {"seq_len": preset.max_seq_len}


def test_a_fine_tuning_recipe_counts_the_pretrained_models_parameters(tmp_path: Path) -> None:
    """With train.init_from the vocabulary is the weights', not train.vocab_size: the count equals the model's."""
    from tformer import build_model

    pretrained = build_model(ModelConfig.from_preset("tiny-llama", vocab_size=500))
    pretrained.save(tmp_path / "base")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"train:\n  init_from: {tmp_path / 'base'}\n  objective: clm\n  vocab_size: 8000\n")
    model, _ = load_inputs(str(recipe))
    assert estimate_memory(model, batch_tokens=64, seq_len=32).n_params == pretrained.num_parameters()


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize(
    ("name", "dtype", "targets"),
    [
        ("tiny-llama", "fp32", ("q_proj", "v_proj")),  # the LoRA paper's choice: most layers stay frozen
        ("tiny-llama", "bf16-autocast", ALL_PROJECTIONS),
        ("tiny-transformer", "fp32", ("q_proj", "v_proj")),  # cross-attention's q_proj and v_proj too
    ],
)
def test_a_lora_estimate_matches_the_measured_peak_of_a_lora_step(name, dtype, targets):
    """Under LoRA only the adapters have gradients and Adam state, and frozen layers save less for backward; the
    full fine-tune's estimate of the same model is far above the measured LoRA step, so the test can fail."""
    overrides = {"attention_backend": "math"} if name == "tiny-llama" else {}
    config = ModelConfig.from_preset(name, d_model=256, d_ff=512, vocab_size=500, **overrides)
    lora = LoRAConfig(rank=8, target_modules=targets)
    measured = measure_training_step(config, 8, 32, dtype, lora=lora)
    estimate = estimate_memory(config, 256, 32, dtype, lora=lora)
    assert estimate.total == pytest.approx(measured.peak_bytes, rel=0.15)
    assert estimate.weights + estimate.optimizer_state == pytest.approx(measured.start_bytes, rel=0.02)
    assert estimate_memory(config, 256, 32, dtype).total > 1.3 * measured.peak_bytes
    per_adapter = {"q_proj": 256 + config.n_heads * config.head_dim}  # rank x (in + out) for each adapted layer
    if targets == ("q_proj", "v_proj") and name == "tiny-llama":
        kv_out = config.n_kv_heads * config.head_dim
        adapters = 8 * config.n_decoder_layers * (per_adapter["q_proj"] + 256 + kv_out)
        assert estimate.trainable == adapters
        assert estimate.gradients == 4 * adapters


def test_a_lora_recipe_estimates_its_adapters(tmp_path: Path) -> None:
    from tformer import build_model

    pretrained = build_model(ModelConfig.from_preset("tiny-llama", vocab_size=500))
    pretrained.save(tmp_path / "base")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"train:\n  init_from: {tmp_path / 'base'}\n  objective: clm\nlora:\n  rank: 4\n  target_modules: [q_proj]\n"
    )
    model, inputs = load_inputs(str(recipe))
    assert inputs["lora"] == LoRAConfig(rank=4, target_modules=("q_proj",))
    inputs.update(batch_tokens=64, seq_len=32)
    estimate = estimate_memory(model, **inputs)
    q_out = model.n_heads * model.head_dim
    assert estimate.trainable == 4 * model.n_decoder_layers * (model.d_model + q_out)
    assert "LoRA trains" in format_estimate("recipe", model, estimate)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp12"}, "unknown dtype 'fp12'; choose one of: fp32, bf16-autocast"),
        ({"world_size": 0}, "world size must be at least 1"),
        ({"stage": 4}, "ZeRO stage must be 0, 1, 2 or 3, got 4; use 0 for DDP"),
        ({"optimizer": "lion"}, "unknown optimizer 'lion'; choose one of"),
        ({"device": "tpu"}, "unknown device 'tpu'; choose one of: cpu, cuda"),
        ({"batch_tokens": 32, "seq_len": 64}, "must hold at least one sequence"),
    ],
)
def test_bad_inputs_say_what_to_change(kwargs, message):
    config = ModelConfig.from_preset("tiny-llama")
    arguments = {"batch_tokens": 64, "seq_len": 64, **kwargs}
    with pytest.raises(ConfigError, match=message):
        estimate_memory(config, **arguments)


def test_overrides_need_a_recipe():
    with pytest.raises(ConfigError, match="apply to a recipe"):
        load_inputs("tiny-llama", ["train.bf16=true"])


def test_checkpointing_argument_overrides_the_config():
    config = dataclasses.replace(ModelConfig.from_preset("tiny-llama"), activation_checkpointing=True)
    assert estimate_memory(config, 64, 64).checkpointing
    assert not estimate_memory(config, 64, 64, checkpointing=False).checkpointing


def test_a_sequence_longer_than_the_position_table_is_refused():
    config = ModelConfig.from_preset("tiny-gpt2")  # learned positions, max_seq_len 64
    with pytest.raises(ConfigError, match="lower seq_len or raise model.max_seq_len"):
        estimate_memory(config, 128, 128)


def test_measurement_refuses_a_precision_it_cannot_run():
    with pytest.raises(ConfigError, match="cannot measure dtype 'fp16-mixed'"):
        measure_training_step(ModelConfig.from_preset("tiny-llama"), 2, 8, "fp16-mixed")
