"""Llama 3, Qwen2 / Qwen3, Phi-3, Gemma 2 and Gemma 3 from Hugging Face directories, against `transformers`.

Each reference is transformers' own class built from a tiny config with random weights, saved with save_pretrained
and read back with `from_hf`: logits on padded batches, the round trip through `to_hf`, and greedy tokens of the
engine (paged KV cache, continuous batching) against transformers' `generate`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tokens

from tformer import ModelConfig, TransformerModel, build_model
from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.interop.hf import from_hf, to_hf

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # max |difference| of fp32 logits (measured: 0 for LLaMA and Qwen, 0.8-1.6e-6 for Phi-3 and Gemma)

# case -> (model_type, architecture, config fields); every case is small enough to build in milliseconds
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": (  # wavelengths 6.3, 30, 140, 664 against 32 / 4 and 32 / 1: kept, blended and scaled pairs
        "llama",
        "LlamaForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500.0,
            },
        ),
    ),
    "llama3-tied": (
        "llama",
        "LlamaForCausalLM",
        dict(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 8.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 1000.0,
            },
        ),
    ),
    "qwen2": (
        "qwen2",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
    ),
    "qwen2-window": (  # layer 0 sees everything, layers 1 and 2 a window of 4
        "qwen2",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=64,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3": (  # head_dim 12, not hidden_size / heads
        "qwen3",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        ),
    ),
    "phi3": (
        "phi3",
        "Phi3ForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            original_max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "gemma2": (  # soft caps small enough to bite on random weights; scores over sqrt(24), not sqrt(16)
        "gemma2",
        "Gemma2ForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            max_position_embeddings=64,
            sliding_window=4,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
        ),
    ),
    "gemma3": (  # windowed layers rotate with base 100, full ones with base 1000 and linear scaling
        "gemma3_text",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=24,
            max_position_embeddings=64,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
            },
            final_logit_softcapping=2.0,
        ),
    ),
}


def hf_model(case: str) -> Any:
    """The transformers model of a case with random weights: every parameter moved off its initial value."""
    model_type, architecture, fields = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # norm gains away from their start, so a misplaced one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (a copy of its transformers model, the directory save_pretrained wrote), each saved once."""
    models: dict[str, tuple[Any, Path]] = {}

    def get(case: str) -> tuple[Any, Path]:
        if case not in models:
            torch.manual_seed(0)
            model, path = hf_model(case), tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            models[case] = model, path
        model, path = models[case]
        return copy.deepcopy(model), path

    return get


def max_difference(ours: TransformerModel, theirs: Any) -> float:
    """max |tformer - transformers| logits over the real tokens of right- and left-padded batches."""
    worst = 0.0
    for side in ("right", "left"):
        ids = tokens(3, 12, ours.config.vocab_size, seed=1)
        mask = torch.zeros_like(ids)
        for row, n in enumerate([12, 9, 5]):
            mask[row, :n] = 1
        mask = mask if side == "right" else mask.flip(-1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            mine = ours(ids, mask)
            reference = theirs(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        real = mask.bool()
        worst = max(worst, (mine[real] - reference[real]).abs().max().item())
    return worst


@pytest.mark.parametrize("case", CASES)
def test_from_hf_gives_the_logits_of_transformers(case: str, saved) -> None:
    theirs, path = saved(case)
    assert max_difference(from_hf(path), theirs) <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_to_hf_then_transformers_gives_the_same_logits(case: str, saved, tmp_path: Path) -> None:
    _, path = saved(case)
    ours = from_hf(path)
    architecture = CASES[case][1]
    to_hf(ours, tmp_path, architecture=architecture)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [architecture]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == architecture
    assert max_difference(ours, theirs) <= TOLERANCE
    assert max_difference(from_hf(tmp_path), theirs) <= TOLERANCE  # and back again


def test_phi3_exports_as_llama_unless_asked(saved, tmp_path: Path) -> None:
    """A Phi-3 model is a LLaMA model with fused tensors: to_hf picks LlamaForCausalLM first."""
    theirs, path = saved("phi3")
    to_hf(from_hf(path), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert max_difference(from_hf(tmp_path), theirs) <= TOLERANCE
    names = set(json.loads((path / "config.json").read_text()))  # the file holds fused tensors
    assert "original_max_position_embeddings" in names


# ---- greedy tokens of the engine ------------------------------------------------------------------------------------

N_NEW = 8
PROMPT_LENGTHS = (11, 3, 7)


@pytest.mark.parametrize("case", CASES)
def test_engine_greedy_tokens_equal_transformers_generate(case: str, saved) -> None:
    """Prompts longer than the windows, in blocks of 4, batched together: windows, soft caps and local RoPE
    bases go through the paged cache as through the uncached forward."""
    theirs, path = saved(case)
    ours = from_hf(path)
    theirs.generation_config.update(eos_token_id=None, pad_token_id=0)
    prompts = [tokens(1, n, ours.config.vocab_size, seed=7 + n)[0].tolist() for n in PROMPT_LENGTHS]
    engine = Engine(ours, None, EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=16))
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, logprobs=0)
    completions = engine.generate(prompts, params)
    for prompt, completion in zip(prompts, completions, strict=True):
        out = theirs.generate(
            torch.tensor([prompt]),
            max_new_tokens=N_NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert completion.token_ids == out.sequences[0, len(prompt) :].tolist()
        # the chosen tokens' log-probabilities: the final soft cap is applied in the engine too
        expected = [torch.log_softmax(step[0], -1).max().item() for step in out.logits]
        assert [entry.logprob for entry in completion.logprobs] == pytest.approx(expected, abs=1e-4)


# ---- configs without a checkpoint ---------------------------------------------------------------------------------


def test_per_layer_windows_equal_separate_masks() -> None:
    """A model whose layers alternate windowed and full attention, uncached, against the same layers run one by one
    with the cached forward: the incremental path keeps every key for the full layers."""
    config = ModelConfig(
        family="decoder",
        vocab_size=64,
        d_model=32,
        n_decoder_layers=3,
        n_heads=4,
        d_ff=48,
        position="rope",
        norm="rmsnorm-plus-one",
        norm_placement="sandwich",
        ffn="geglu-tanh",
        sliding_window=3,
        layer_types=["sliding", "full", "sliding"],
        rope_local_theta=50.0,
        attn_logit_softcap=2.0,
        final_logit_softcap=3.0,
        qk_norm=True,
        dropout=0.0,
    )
    torch.manual_seed(0)
    model = build_model(config).eval()
    ids = tokens(2, 10, config.vocab_size, seed=2)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 10)
        steps = [model(ids[:, :4], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache, start=t) for t in range(4, 10)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5
    assert model.decoder.window is None and model.decoder.windows == [3, None, 3]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": ["sliding", "full"]}, "sliding_window is null"),
        ({"layer_types": ["full"]}, "one entry per layer"),
        ({"layer_types": ["local", "full"], "sliding_window": 4}, "layer_types"),
        ({"attn_logit_softcap": 0.0}, "attn_logit_softcap must be positive"),
        ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 1.0}, "llama3"),
    ],
)
def test_bad_family_fields_are_refused(fields: dict[str, Any], message: str) -> None:
    from tformer.errors import ConfigError

    base = dict(family="decoder", vocab_size=64, d_model=32, n_decoder_layers=2, n_heads=4, position="rope")
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**base, **fields)


# ---- presets of the released models ---------------------------------------------------------------------------------

RELEASED_COUNTS = {  # parameters of the released checkpoints (their safetensors headers)
    "llama3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,
    "gemma2-2b": 2_614_341_888,
    "phi3-mini": 3_821_079_552,
}


@pytest.mark.parametrize(("name", "count"), RELEASED_COUNTS.items())
def test_family_presets_have_the_released_parameter_counts(name: str, count: int) -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig.from_preset(name))
    assert model.num_parameters() == count


@pytest.mark.parametrize(
    ("name", "case"),
    [("llama3.2-1b", "llama3"), ("qwen2.5-0.5b", "qwen2"), ("qwen3-0.6b", "qwen3"), ("gemma2-2b", "gemma2")],
)
def test_family_presets_hold_what_from_hf_reads(name: str, case: str, saved) -> None:
    """Each preset sets the variant fields a checkpoint of its family gets from from_hf (sizes, tying and eps
    aside), and its layers alternate windows the same way."""
    preset, loaded = ModelConfig.from_preset(name), from_hf(saved(case)[1]).config
    variant = ("norm", "norm_placement", "ffn", "ffn_bias", "position", "rope_scaling", "attn_bias", "attn_out_bias")
    variant += ("qk_norm", "scale_embeddings", "round_embed_scale")
    assert {k: getattr(preset, k) for k in variant} == {k: getattr(loaded, k) for k in variant}
    n = loaded.n_decoder_layers
    assert [w is None for w in preset.layer_windows()[:n]] == [w is None for w in loaded.layer_windows()]


# ---- serving precision: fused projections and kernels, bf16, INT8 --------------------------------------------------


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("case", ["qwen2-window", "qwen3", "phi3", "gemma2", "gemma3"])
def test_served_families_decode_as_their_forward(case: str, quantize: str | None, saved) -> None:
    """The engine on a model prepared for serving (fused q/k/v and gate/up, fused norms and rotary, bf16, INT8
    weights) picks its greedy tokens as the same model's uncached forward does, up to bf16 near-ties; that forward
    stays near the fp32 model."""
    from helpers import greedy_within_rounding

    from tformer.kernels.quantize import set_precision

    _, path = saved(case)
    reference = from_hf(path)
    served = set_precision(from_hf(path), "bfloat16", quantize)
    prompts = [tokens(1, n, reference.config.vocab_size, seed=7 + n)[0].tolist() for n in PROMPT_LENGTHS]
    engine = Engine(served, None, EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=16))
    completions = engine.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0.0))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert greedy_within_rounding(served, prompt, completion.token_ids, margin=0.05)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        # logits reach about 2-4 here; bf16 moved them by up to 0.11, INT8 weights by up to 0.24
        assert (served(ids).float() - reference(ids)).abs().max().item() <= (0.15 if quantize is None else 0.35)


# ---- what these families refuse -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
        ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_"),
        ("qwen3", {"hidden_act": "relu"}, "hidden_act 'relu' has no tformer equivalent"),
    ],
)
def test_unsupported_family_configs_are_named(case: str, changes: dict, message: str, saved, tmp_path: Path) -> None:
    import shutil

    from tformer.models import CheckpointError

    _, path = saved(case)
    path = Path(shutil.copytree(path, tmp_path / case))
    fields = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**fields, **changes}))
    with pytest.raises(CheckpointError, match=message) as err:
        from_hf(path)
    assert str(path / "config.json") in str(err.value)


def test_to_hf_refuses_an_architecture_that_cannot_hold_the_model(saved, tmp_path: Path) -> None:
    from tformer.models import CheckpointError

    ours = from_hf(saved("gemma2")[1])
    with pytest.raises(CheckpointError, match="Gemma3ForCausalLM: .*attn_logit_softcap"):
        to_hf(ours, tmp_path, architecture="Gemma3ForCausalLM")
    with pytest.raises(CheckpointError, match="not 'BertModel'"):
        to_hf(ours, tmp_path, architecture="BertModel")


def test_multimodal_gemma3_loads_its_text_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration (the 4B-27B releases): the text model under language_model., its config in
    text_config; the vision tower is left out with a warning, and text-only logits equal transformers'."""
    from tformer.interop.hf import DroppedWeightsWarning

    _, _, text = CASES["gemma3"]
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = transformers.Gemma3Config(
        text_config={**text, "vocab_size": 100},
        vision_config={**vision, "patch_size": 14},
        mm_tokens_per_image=4,
        boi_token_index=97,
        eoi_token_index=98,
        image_token_index=99,
    )
    torch.manual_seed(0)
    theirs = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    theirs.save_pretrained(tmp_path)
    with pytest.warns(DroppedWeightsWarning, match="vision tower"):
        ours = from_hf(tmp_path)
    ids = tokens(2, 12, 96, seed=4)
    with torch.no_grad():
        assert (ours(ids) - theirs(input_ids=ids).logits).abs().max().item() <= TOLERANCE
    assert ours.config.rope_local_theta == 100.0 and ours.config.qk_norm


@pytest.mark.parametrize("rules", ["causal", "window", "padding"])
def test_softcapped_attention_by_blocks_equals_the_whole_score_matrix(rules: str) -> None:
    """Past QUERY_BLOCK^2 query-key pairs capped attention goes by blocks of queries (memory linear in the length):
    equal to math_attention over the whole dense bias, forward and gradients."""
    from tformer.layers.attention import QUERY_BLOCK, math_attention, softcapped_attention
    from tformer.layers.masks import build_mask

    torch.manual_seed(0)
    n = QUERY_BLOCK + 200
    q, k, v = (torch.randn(2, 4, n, 8, requires_grad=True) for _ in range(3))
    padding = torch.ones(2, n, dtype=torch.bool)
    padding[1, -50:] = False
    mask = build_mask(
        n_queries=n,
        n_keys=n,
        causal=True,
        dtype=torch.float32,
        device=torch.device("cpu"),
        window=300 if rules == "window" else None,
        key_padding=padding if rules == "padding" else None,
    )
    assert mask.bias is None or rules == "causal"  # too long for a dense bias: the blocks build their own
    blocks, _ = softcapped_attention(q, k, v, mask, 0.0, softcap=1.5)
    dense_mask = copy.copy(mask)
    dense_mask.bias = mask.bias_block(0, n, 0, n, n, n, torch.float32, torch.device("cpu"))
    whole, _ = math_attention(q, k, v, dense_mask, 0.0, softcap=1.5)
    assert (blocks - whole).abs().max().item() <= 1e-5
    grads = torch.autograd.grad(blocks.square().sum(), (q, k, v))
    reference = torch.autograd.grad(whole.square().sum(), (q, k, v))
    assert max((a - b).abs().max().item() for a, b in zip(grads, reference, strict=True)) <= 1e-4


def test_gemma_embedding_scale_is_rounded_to_the_weights_dtype(saved, tmp_path: Path) -> None:
    """transformers casts sqrt(d_model) to the embedding's dtype before multiplying (sqrt(32) is 5.65625 in bf16):
    tformer's bf16 embeddings equal theirs bit for bit, and differ from an unrounded scale."""
    theirs, path = saved("gemma2")
    ours = from_hf(path, dtype=torch.bfloat16)
    theirs = theirs.to(torch.bfloat16)
    ids = tokens(2, 12, ours.config.vocab_size, seed=5)
    with torch.no_grad():
        mine = ours.decoder.embed(ids, torch.arange(12)[None])
        reference = theirs.model.embed_tokens(ids)
        unrounded = ours.decoder.tokens(ids) * ours.decoder.embed_scale
    assert torch.equal(mine, reference) and not torch.equal(unrounded, reference)
