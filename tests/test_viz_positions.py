"""`tformer viz positions`: the numbers each figure draws, read back from the figure, against the scheme's formula
written out here (sinusoids, RoPE's frequencies with each scaling and its relative score, ALiBi's slopes), and a
learned table against the checkpoint file's weights."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import make_model, tiny_config
from helpers import assert_png
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from safetensors.torch import load_file

from tformer import ModelConfig, load
from tformer.errors import ConfigError
from tformer.viz import plot_positions, position_figure

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads would only wait on each other


def axis(figure: Figure, title_start: str) -> Axes:
    """The one visible axes whose title starts with `title_start`."""
    found = [ax for ax in figure.axes if ax.get_visible() and ax.get_title().startswith(title_start)]
    assert len(found) == 1, [ax.get_title() for ax in figure.axes]
    return found[0]


def image(ax: Axes) -> np.ndarray:
    return np.asarray(ax.images[0].get_array())


# ---- sinusoidal ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["interleaved", "split"])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_sinusoidal_figure_draws_the_papers_table(layout: str, base: float) -> None:
    n, d = 30, 32
    config = tiny_config("tiny-transformer", d_model=d, sinusoidal_base=base, sinusoidal_layout=layout)
    expected = np.zeros((n, d))
    for t in range(n):
        for i in range(d // 2):
            sin_column, cos_column = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, d // 2 + i)
            expected[t, sin_column] = math.sin(t / base ** (2 * i / d))
            expected[t, cos_column] = math.cos(t / base ** (2 * i / d))
    ax = axis(position_figure(config, n), "sinusoidal positions")
    np.testing.assert_allclose(image(ax), expected, atol=1e-6, rtol=0)
    assert layout in ax.get_title() and f"base {base:g}" in ax.get_title()


# ---- RoPE ------------------------------------------------------------------------------------------------------------

HEAD_DIM, ORIGINAL = 64, 4096


def rope_config(scaling: str, factor: float, theta: float = 10000.0) -> ModelConfig:
    return tiny_config(
        "tiny-llama",
        d_model=4 * HEAD_DIM,
        n_heads=4,
        n_kv_heads=4,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_factor=factor,
        max_seq_len=4 * ORIGINAL,
        rope_original_max_len=ORIGINAL,
    )


def yarn_by_hand(theta: list[float], base: float, factor: float, beta_fast: float, beta_slow: float) -> list[float]:
    """YaRN (Peng et al., 2023): pairs that turn more than beta_fast times over the original context keep their
    frequency, those turning fewer than beta_slow times are interpolated (divided by the factor), a linear ramp over
    the pair index between the two boundaries (rounded outwards, as in the reference code)."""

    def boundary(turns: float) -> float:  # the pair index whose wavelength fits `turns` times in the context
        return HEAD_DIM * math.log(ORIGINAL / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(boundary(beta_fast)), 0), min(math.ceil(boundary(beta_slow)), HEAD_DIM - 1)
    scaled = []
    for i, f in enumerate(theta):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep the frequency, 1: interpolate
        scaled.append(f * (1 - ramp) + f / factor * ramp)
    return scaled


def rope_by_hand(scaling: str, factor: float, length: int, theta: float) -> tuple[list[float], list[float], float]:
    """(unscaled theta_i, theta_i as the model uses them over `length` tokens, the cos/sin scale)."""
    unscaled = [theta ** (-2 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)]
    if scaling == "linear":  # position interpolation: positions divided by the factor
        return unscaled, [f / factor for f in unscaled], 1.0
    if scaling == "dynamic-ntk":  # the base grows once the sequence outgrows the original context
        grown = theta * (factor * max(length, ORIGINAL) / ORIGINAL - (factor - 1)) ** (HEAD_DIM / (HEAD_DIM - 2))
        return unscaled, [grown ** (-2 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)], 1.0
    if scaling == "yarn":
        return unscaled, yarn_by_hand(unscaled, theta, factor, 32.0, 1.0), 0.1 * math.log(factor) + 1.0
    return unscaled, unscaled, 1.0


ROPE_CASES = [("none", 1.0, 300), ("linear", 4.0, 300), ("dynamic-ntk", 4.0, 300), ("dynamic-ntk", 4.0, 6000)]
ROPE_CASES += [("yarn", 8.0, 300)]


@pytest.mark.parametrize(("scaling", "factor", "length"), ROPE_CASES)
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_figure_draws_its_frequencies_and_relative_score(
    scaling: str, factor: float, length: int, theta: float
) -> None:
    unscaled, scaled, scale = rope_by_hand(scaling, factor, length, theta)
    figure = position_figure(rope_config(scaling, factor, theta), length)
    lines = axis(figure, "RoPE rotation frequency").lines
    assert len(lines) == (1 if scaling == "none" else 2)
    np.testing.assert_allclose(lines[0].get_ydata(), unscaled, rtol=1e-6)
    np.testing.assert_allclose(lines[-1].get_ydata(), scaled, rtol=1e-5)
    if scaling == "dynamic-ntk" and length <= ORIGINAL:
        np.testing.assert_array_equal(lines[0].get_ydata(), lines[1].get_ydata())  # not grown yet
    # q = k = (1, ..., 1): each pair contributes scale^2 * 2 cos(m theta_i), so the score is the sum over pairs
    score = [scale**2 * 2 * sum(math.cos(m * f) for f in scaled) / HEAD_DIM for m in range(length)]
    drawn = axis(figure, "relative score").lines[0]
    np.testing.assert_array_equal(drawn.get_xdata(), np.arange(length))
    atol = 1e-7 * length + 1e-6  # the model's angles m * theta_i are fp32
    np.testing.assert_allclose(drawn.get_ydata(), score, atol=atol, rtol=0)
    assert drawn.get_ydata()[0] == pytest.approx(scale**2, rel=1e-6)
    assert abs(np.asarray(drawn.get_ydata()[length // 2 :])).max() < 0.9 * scale**2  # it decays from m = 0


# ---- ALiBi -----------------------------------------------------------------------------------------------------------


def slopes_by_hand(n_heads: int) -> list[float]:
    """2^(-8i/n) for i = 1..n when n is a power of two; otherwise those of the power of two below n, then the
    odd-numbered slopes of twice that power (the ALiBi paper's reference code)."""
    power = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-8 * i / power) for i in range(1, power + 1)]
    return slopes + [2 ** (-8 * i / (2 * power)) for i in range(1, 2 * power, 2)][: n_heads - power]


@pytest.mark.parametrize("n_heads", [4, 8, 12, 16])
def test_alibi_figure_draws_minus_slope_times_distance_per_head(n_heads: int) -> None:
    n = 12
    config = tiny_config(position="alibi", n_heads=n_heads, n_kv_heads=n_heads, d_model=4 * n_heads)
    figure = position_figure(config, n)
    slopes = slopes_by_hand(n_heads)
    lines = axis(figure, "ALiBi bias").lines
    assert len(lines) == n_heads
    for h, line in enumerate(lines):
        np.testing.assert_allclose(line.get_ydata(), [-slopes[h] * j for j in range(n)], rtol=1e-6)
    maps = [ax for ax in figure.axes if ax.get_visible() and ax.get_title().startswith("head ")]
    drawn_heads = [int(ax.get_title().split()[1].rstrip(",")) for ax in maps]
    if n_heads <= 8:
        assert drawn_heads == list(range(n_heads))
    else:  # eight heads spread from the first to the last, each once
        assert len(drawn_heads) == 8 and drawn_heads == sorted(set(drawn_heads))
        assert drawn_heads[0] == 0 and drawn_heads[-1] == n_heads - 1
    for ax, h in zip(maps, drawn_heads, strict=True):
        expected = [[-slopes[h] * abs(i - j) for j in range(n)] for i in range(n)]
        np.testing.assert_allclose(image(ax), expected, rtol=1e-6)


# ---- learned tables and schemes with nothing to draw -----------------------------------------------------------------


@pytest.mark.parametrize(("preset", "stacks"), [("tiny-gpt2", ["decoder"]), ("tiny-bert", ["encoder"])])
def test_learned_figure_draws_the_checkpoints_trained_table(tmp_path: Path, preset: str, stacks: list[str]) -> None:
    config = tiny_config(preset)
    assert config.position == "learned"
    make_model(config, seed=3).save(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    figure = position_figure(load(tmp_path), length=config.max_seq_len + 10)  # more than the table holds
    for stack in stacks:
        ax = axis(figure, f"learned positions ({stack})")
        np.testing.assert_array_equal(image(ax), saved[f"{stack}.positions.embedding.weight"].numpy())


def test_learned_figure_of_a_translation_model_draws_both_tables(tmp_path: Path) -> None:
    make_model(tiny_config("tiny-transformer", position="learned"), seed=5).save(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    figure = position_figure(load(tmp_path), length=20)
    drawn = {stack: image(axis(figure, f"learned positions ({stack})")) for stack in ("encoder", "decoder")}
    for stack, table in drawn.items():
        np.testing.assert_array_equal(table, saved[f"{stack}.positions.embedding.weight"][:20].numpy())
    assert not np.array_equal(drawn["encoder"], drawn["decoder"])  # two tables, not one drawn twice


def test_a_preset_with_learned_positions_says_it_has_no_trained_table() -> None:
    with pytest.raises(ConfigError, match="no trained table.*checkpoint directory"):
        position_figure(ModelConfig.from_preset("gpt2"))


def test_position_none_says_there_is_nothing_to_draw(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nothing to draw"):
        plot_positions(tiny_config(position="none"), tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_a_checkpoint_of_a_fixed_scheme_draws_that_scheme(tmp_path: Path) -> None:
    config = tiny_config("tiny-llama")
    make_model(config).save(tmp_path)
    from_checkpoint, from_config = position_figure(load(tmp_path), 50), position_figure(config, 50)
    for title in ("RoPE rotation frequency", "relative score"):
        drawn, expected = axis(from_checkpoint, title).lines[0], axis(from_config, title).lines[0]
        np.testing.assert_array_equal(drawn.get_ydata(), expected.get_ydata())


@pytest.mark.parametrize("position", ["sinusoidal", "rope", "alibi"])
def test_every_scheme_writes_a_png(tmp_path: Path, position: str) -> None:
    config = tiny_config("tiny-llama" if position == "rope" else "tiny-transformer", position=position)
    assert_png(plot_positions(config, tmp_path / f"{position}.png", length=40))


# ---- T5's learned relative bias -----------------------------------------------------------------------------------


def test_t5_figure_draws_each_stacks_learned_bias_by_bucket_of_distance() -> None:
    """Each drawn map is the stack's table looked up at transformers' own bucket of j - i (bidirectional in the
    encoder, past-only in the decoder)."""
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    n = 20
    model = make_model(ModelConfig.from_preset("tiny-t5"))
    config = model.config
    tables = {}
    for stack in ("encoder", "decoder"):
        embedding = getattr(model, stack).positions.relative_bias.embedding
        torch.nn.init.normal_(embedding.weight)
        tables[stack] = embedding.weight.detach()
    figure = position_figure(model, n)
    relative = torch.arange(n)[None, :] - torch.arange(n)[:, None]  # j - i
    drawn = [ax for ax in figure.axes if ax.get_title().startswith(("encoder, head", "decoder, head"))]
    assert len(drawn) == 2 * config.n_heads
    for ax in drawn:
        stack, head = ax.get_title().split(", head ")
        buckets = T5Attention._relative_position_bucket(
            relative,
            bidirectional=stack == "encoder",
            num_buckets=config.relative_attention_buckets,
            max_distance=config.relative_attention_max_distance,
        )
        np.testing.assert_allclose(image(ax), tables[stack][buckets, int(head)].numpy(), rtol=1e-6)


def test_t5_figure_needs_trained_weights() -> None:
    with pytest.raises(ConfigError, match="T5 learns its bias per head"):
        position_figure(ModelConfig.from_preset("tiny-t5"), 10)
