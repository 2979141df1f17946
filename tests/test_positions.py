"""Position tests: sinusoidal tables, ALiBi and RoPE (with its linear, dynamic-NTK and YaRN scalings), each against
its paper's formula written out by hand, or against `transformers`.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config

from tformer.layers import alibi_slopes, build_mask, make_positions, sinusoidal_table
from tformer.layers.positions import RotaryPositions, apply_rotary, rope_inv_freq

# ---- sinusoidal positions -----------------------------------------------------------------------------------------


# where the sine and the cosine of frequency pair i go among d channels
SINUSOIDAL_COLUMNS = {"interleaved": lambda i, d: (2 * i, 2 * i + 1), "split": lambda i, d: (i, d // 2 + i)}


@pytest.mark.parametrize("layout", SINUSOIDAL_COLUMNS)
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_sinusoidal_table_matches_paper(base: float, layout: str) -> None:
    n, d = 12, 10
    expected = torch.zeros(n, d)
    for t in range(n):
        for i in range(d // 2):
            sin_column, cos_column = SINUSOIDAL_COLUMNS[layout](i, d)
            expected[t, sin_column] = math.sin(t / base ** (2 * i / d))
            expected[t, cos_column] = math.cos(t / base ** (2 * i / d))
    torch.testing.assert_close(sinusoidal_table(n, d, base, layout), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", SINUSOIDAL_COLUMNS)
def test_sinusoidal_scheme_uses_the_configured_base_and_layout(layout: str) -> None:
    config = tiny_config("tiny-transformer", sinusoidal_base=1000.0, sinusoidal_layout=layout)
    positions = torch.tensor([[0, 3, 5, 63]])
    expected = sinusoidal_table(config.max_seq_len, config.d_model, 1000.0, layout)[positions]
    torch.testing.assert_close(make_positions(config).embed(positions), expected, atol=0, rtol=0)


# ---- ALiBi --------------------------------------------------------------------------------------------------------


def test_alibi_slopes_for_eight_heads_are_the_papers() -> None:
    expected = [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    assert alibi_slopes(8).tolist() == pytest.approx(expected, rel=1e-6)


def test_alibi_slopes_for_twelve_heads() -> None:
    # the 8-head slopes, then every other slope of the 16-head sequence 2^-0.5, 2^-1, 2^-1.5, ...
    expected = [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    expected += [0.7071067811865476, 0.35355339059327373, 0.17677669529663687, 0.08838834764831843]
    assert alibi_slopes(12).tolist() == pytest.approx(expected, rel=1e-6)


def test_alibi_bias_is_minus_slope_times_distance() -> None:
    config = tiny_config(position="alibi", n_heads=4)
    scheme = make_positions(config)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]])  # the second row is left-padded by one
    bias = scheme.attention_bias(positions, positions)
    slopes = [2**-2, 2**-4, 2**-6, 2**-8]  # 2^(-8/4 * (h + 1))
    for b in range(2):
        for h in range(4):
            for i in range(5):
                for j in range(5):
                    expected = -slopes[h] * abs(positions[b, i].item() - positions[b, j].item())
                    assert bias[b, h, i, j].item() == pytest.approx(expected, abs=1e-7)


def test_alibi_bias_reaches_the_scores_with_the_causal_mask() -> None:
    config = tiny_config(position="alibi", n_heads=4)
    positions = torch.arange(4)[None]
    scheme = make_positions(config)
    alibi = scheme.attention_bias(positions, positions)
    mask = build_mask(
        n_queries=4,
        n_keys=4,
        causal=True,
        dtype=torch.float32,
        device=torch.device("cpu"),
        position_bias=scheme.attention_bias,
        query_positions=positions,
        key_positions=positions,
    )
    lower = torch.ones(4, 4).tril().bool()
    assert torch.equal(mask.bias[0][:, lower], alibi[0][:, lower])
    assert (mask.bias[0][:, ~lower] == torch.finfo(torch.float32).min).all()


# ---- RoPE ---------------------------------------------------------------------------------------------------------

ROPE_SCALINGS = [("none", 1.0), ("linear", 4.0), ("yarn", 8.0)]


def rope_config(scaling: str, factor: float, theta: float = 10000.0, **extra):
    return tiny_config(
        "tiny-llama",
        d_model=256,
        n_heads=4,
        n_kv_heads=4,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_factor=factor,
        max_seq_len=16384,
        rope_original_max_len=4096,
        **extra,
    )


def rotate(scheme: RotaryPositions, x: torch.Tensor, position: int) -> torch.Tensor:
    return apply_rotary(x, scheme.rotary(torch.tensor([[position]])))


@pytest.mark.parametrize(("scaling", "factor"), ROPE_SCALINGS)
def test_rope_score_depends_only_on_relative_offset(scaling: str, factor: float) -> None:
    scheme = RotaryPositions(rope_config(scaling, factor))
    q, k = torch.randn(2, 1, 1, 64, dtype=torch.float64).unbind(0)
    q, k = q[None], k[None]  # (1, 1, 1, head_dim)

    def score(m: int, n: int) -> float:
        return (rotate(scheme, q, m) * rotate(scheme, k, n)).sum().item()

    for m, n in [(0, 0), (5, 2), (2, 5), (17, 3), (100, 40)]:
        for shift in (1, 7, 300):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-4, abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)  # but it does depend on the offset


def hf_llama_config(config, rope_type: str, **params):
    from transformers import LlamaConfig

    rope = {"rope_type": rope_type, "rope_theta": config.rope_theta, "factor": config.rope_factor, **params}
    return LlamaConfig(
        hidden_size=config.d_model,
        num_attention_heads=config.n_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_rope_linear_matches_transformers(theta: float, factor: float) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = rope_config("linear", factor, theta)
    inv_freq, scale = rope_inv_freq(config)
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS["linear"](hf_llama_config(config, "linear"), "cpu")
    torch.testing.assert_close(inv_freq, hf_inv_freq, atol=0, rtol=1e-6)
    assert scale == hf_scale == 1.0


@pytest.mark.parametrize("seq_len", [1000, 4096, 6000, 16384])
def test_rope_dynamic_ntk_matches_transformers(seq_len: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = rope_config("dynamic-ntk", 4.0)
    # transformers' dynamic scaling treats max_position_embeddings as the original context
    hf_config = hf_llama_config(config, "dynamic")
    hf_config.max_position_embeddings = config.rope_original_max_len
    inv_freq, scale = rope_inv_freq(config, seq_len)
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=seq_len)
    torch.testing.assert_close(inv_freq, hf_inv_freq, atol=0, rtol=1e-5)
    assert scale == hf_scale == 1.0
    base_inv_freq, _ = rope_inv_freq(rope_config("none", 1.0))
    assert torch.equal(inv_freq, base_inv_freq) == (seq_len <= config.rope_original_max_len)


@pytest.mark.parametrize(("factor", "theta", "betas"), [(4.0, 10000.0, (32.0, 1.0)), (8.0, 500000.0, (16.0, 2.0))])
def test_rope_yarn_matches_transformers(factor: float, theta: float, betas: tuple[float, float]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = rope_config("yarn", factor, theta, yarn_beta_fast=betas[0], yarn_beta_slow=betas[1])
    hf_config = hf_llama_config(
        config,
        "yarn",
        original_max_position_embeddings=config.rope_original_max_len,
        beta_fast=betas[0],
        beta_slow=betas[1],
    )
    inv_freq, scale = rope_inv_freq(config)
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    torch.testing.assert_close(inv_freq, hf_inv_freq, atol=0, rtol=1e-6)
    assert scale == pytest.approx(hf_scale, rel=1e-12)
    assert scale == pytest.approx(0.1 * math.log(factor) + 1.0)
    plain, _ = rope_inv_freq(rope_config("none", 1.0, theta))
    assert inv_freq[0] == plain[0] and inv_freq[-1] == pytest.approx(plain[-1] / factor)  # extrapolate / interpolate


@pytest.mark.parametrize(("scaling", "hf_type"), [("linear", "linear"), ("dynamic-ntk", "dynamic"), ("yarn", "yarn")])
def test_rope_cos_sin_match_transformers_rotary_embedding(scaling: str, hf_type: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = rope_config(scaling, 4.0)
    extra = {"original_max_position_embeddings": config.rope_original_max_len} if hf_type == "yarn" else {}
    hf_config = hf_llama_config(config, hf_type, **extra)
    if hf_type == "dynamic":
        hf_config.max_position_embeddings = config.rope_original_max_len
    hf_rope = LlamaRotaryEmbedding(hf_config)
    scheme = RotaryPositions(config)
    for positions in (torch.tensor([[0, 1, 2, 100, 4000]]), torch.tensor([[3, 5000, 9000, 12000, 16383]])):
        cos, sin = scheme.rotary(positions)
        hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions)
        atol = 1e-7 * positions.max().item() + 1e-6  # an fp32 angle m * f is only good to about m * 1e-7
        torch.testing.assert_close(cos, hf_cos, atol=atol, rtol=0)
        torch.testing.assert_close(sin, hf_sin, atol=atol, rtol=0)


def test_apply_rotary_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    scheme = RotaryPositions(rope_config("none", 1.0))
    positions = torch.tensor([[0, 1, 2, 3, 7], [4, 9, 10, 20, 30]])
    cos, sin = scheme.rotary(positions)
    q, k = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 5, 64)  # (B, H, T, D), GQA-sized keys
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rotary(q, (cos, sin)), hf_q, atol=0, rtol=0)
    torch.testing.assert_close(apply_rotary(k, (cos, sin)), hf_k, atol=0, rtol=0)


def test_rope_rotates_each_pair_by_position_times_frequency() -> None:
    """The half-split layout: dims i and i + D/2 form a pair rotated by angle m * theta^(-2i/D)."""
    config = rope_config("none", 1.0)
    scheme = RotaryPositions(config)
    x = torch.randn(1, 1, 1, 64, dtype=torch.float64)
    m = 13
    out = rotate(scheme, x, m)[0, 0, 0]
    for i in range(32):
        angle = m * 10000.0 ** (-2 * i / 64)
        a, b = x[0, 0, 0, i].item(), x[0, 0, 0, i + 32].item()
        assert out[i].item() == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-5)
        assert out[i + 32].item() == pytest.approx(a * math.sin(angle) + b * math.cos(angle), abs=1e-5)
