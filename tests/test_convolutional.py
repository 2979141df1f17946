"""ConvS2S (models/convolutional.py, layers/convolution.py) against references: the GLU and the convolution written
out as explicit sums, the whole teacher-forced forward rebuilt from those formulas layer by layer, the decoder's
causality (a later target token never changes an earlier output), incremental decoding against the full forward,
a padded batch against each sentence alone, beam search on a batch against each source alone, its config checks,
its parameter count against the main recipe's, and a run of the real trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_model, tokens, uncached_greedy
from helpers import trainer, write_recipe

from tformer import ModelConfig, build_model, load
from tformer.checkpoints import resolve_checkpoint
from tformer.decoding.search import beam_search, greedy_search, translate_ids
from tformer.decoding.translator import Translator
from tformer.errors import ConfigError
from tformer.layers.convolution import GLUConv, glu
from tformer.models.convolutional import ConvS2S
from tformer.training import load_recipe

PAD, BOS, EOS = 0, 1, 2
CONFIGS = Path(__file__).resolve().parents[1] / "configs"

pytestmark = pytest.mark.usefixtures("one_thread")


def conv_model(vocab_size: int = 97, seed: int = 0, **overrides: object) -> ConvS2S:
    settings = {
        "family": "conv-encoder-decoder",
        "vocab_size": vocab_size,
        "d_model": 16,
        "conv_hidden": 12,
        "conv_kernel": 3,
        "n_encoder_layers": 2,
        "n_decoder_layers": 3,
        "position": "learned",
        "max_seq_len": 32,
        "scale_embeddings": False,  # as ConvS2S (and the recipe)
        "dropout": 0.0,
        **overrides,
    }
    return make_model(ModelConfig.from_preset("tiny-transformer", **settings), seed=seed)


def padded_sources(lengths: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = tokens(len(lengths), max(lengths), vocab_size, seed=3).clamp_min(3)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return src * mask, mask


# ---- the layers against their formulas ---------------------------------------------------------------------------


def test_glu_is_a_times_sigmoid_of_b_element_by_element() -> None:
    x = torch.randn(2, 5, 6)
    out = glu(x)
    for b, t, c in [(0, 0, 0), (1, 4, 2), (0, 3, 1)]:
        a_value, b_value = x[b, t, c].item(), x[b, t, c + 3].item()
        assert out[b, t, c].item() == pytest.approx(a_value / (1 + math.exp(-b_value)), rel=1e-6)


def conv_formula(conv: GLUConv, x: torch.Tensor) -> torch.Tensor:
    """y_t = GLU(b + sum_i W[:, :, i] x_{t - left + i}), with zeros outside the sequence: loops, no conv1d."""
    B, T, C = x.shape
    out = torch.zeros(B, T, C, dtype=torch.float64)
    weight, bias = conv.weight.double(), conv.bias.double()
    for t in range(T):
        total = bias.expand(B, -1).clone()  # (B, 2C)
        for i in range(conv.kernel):
            s = t - conv.left + i
            if 0 <= s < T:
                total = total + x[:, s].double() @ weight[:, :, i].T
        a, g = total[:, :C], total[:, C:]
        out[:, t] = a * torch.sigmoid(g)
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "centred"])
@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_a_gated_convolution_equals_its_sum_position_by_position(causal: bool, kernel: int) -> None:
    torch.manual_seed(0)
    conv = GLUConv(6, kernel, causal)
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 7, 6)
    torch.testing.assert_close(conv(x).double(), conv_formula(conv, x), rtol=1e-5, atol=1e-6)


def test_a_causal_convolution_with_a_history_equals_it_on_the_longer_sequence() -> None:
    torch.manual_seed(0)
    conv = GLUConv(4, 3, causal=True)
    x = torch.randn(2, 9, 4)
    full = conv(x)
    torch.testing.assert_close(conv(x[:, 5:], history=x[:, 3:5]), full[:, 5:], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="causal"):
        GLUConv(4, 3, causal=False)(x, history=x[:, :2])


@torch.no_grad()
def convs2s_formula(model: ConvS2S, src: torch.Tensor, src_mask: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """The whole forward from the paper's equations, in float64, with conv_formula for every convolution."""
    d = {name: p.double() for name, p in model.named_parameters()}
    r = math.sqrt(0.5)
    S, T = src.shape[1], tgt.shape[1]
    mask = src_mask.double()[..., None]
    e = d["src_tokens.weight"][src] + d["src_positions.weight"][:S]  # (B, S, E)
    x = e @ d["encoder.in_proj.weight"].T + d["encoder.in_proj.bias"]
    for conv in model.encoder.convs:
        x = (conv_formula(conv, x * mask) + x) * r
    z = (x @ d["encoder.out_proj.weight"].T + d["encoder.out_proj.bias"]) * mask  # encoder outputs z_j
    values = (z + e) * r
    m = src_mask.sum(1).double()  # real source tokens per row
    g = model.tgt_tokens.weight.double()[tgt] + d["tgt_positions.weight"][:T]  # (B, T, E)
    x = g @ d["in_proj.weight"].T + d["in_proj.bias"]
    for i, layer in enumerate(model.layers):
        h = conv_formula(layer.conv, x)
        p = f"layers.{i}.attention."
        query = (h @ d[p + "in_proj.weight"].T + d[p + "in_proj.bias"] + g) * r  # d_i
        scores = (query @ z.transpose(1, 2)).masked_fill(src_mask[:, None, :] == 0, -math.inf)
        context = torch.softmax(scores, -1) @ values * m.sqrt()[:, None, None]  # c_i, times m sqrt(1/m)
        h = (context @ d[p + "out_proj.weight"].T + d[p + "out_proj.bias"] + h) * r
        x = (h + x) * r
    out = x @ d["out_proj.weight"].T + d["out_proj.bias"]
    return out @ model.lm_head.weight.double().T


def test_teacher_forced_logits_equal_the_papers_equations_layer_by_layer() -> None:
    model = conv_model()
    with torch.no_grad():  # biases start at zero: give them values, so that each one is checked
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    src, src_mask = padded_sources([6, 3, 5], model.config.vocab_size)
    tgt = tokens(3, 7, model.config.vocab_size, seed=5)
    with torch.no_grad():
        logits = model(src, tgt, src_mask)
    torch.testing.assert_close(logits.double(), convs2s_formula(model, src, src_mask, tgt), rtol=1e-4, atol=1e-5)


# ---- causality, padding and incremental decoding -----------------------------------------------------------------


@torch.no_grad()
def test_the_decoder_never_reads_a_later_target_position() -> None:
    """Perturb target token t: the logits at positions before t do not move; those from t on do."""
    model = conv_model(n_decoder_layers=4, conv_kernel=5)
    src, src_mask = padded_sources([6, 4], model.config.vocab_size)
    tgt = tokens(2, 12, model.config.vocab_size, seed=7)
    base = model(src, tgt, src_mask)
    for t in (0, 5, 11):
        changed = tgt.clone()
        changed[:, t] = (changed[:, t] + 1) % model.config.vocab_size
        out = model(src, changed, src_mask)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
        assert (out[:, t] - base[:, t]).abs().max() > 1e-4


@torch.no_grad()
def test_a_padded_batch_row_equals_the_sentence_alone() -> None:
    model = conv_model()
    src, src_mask = padded_sources([6, 2, 4], model.config.vocab_size)
    tgt = tokens(3, 5, model.config.vocab_size, seed=5)
    batched = model(src, tgt, src_mask)
    for b, n in enumerate([6, 2, 4]):
        alone = model(src[b : b + 1, :n], tgt[b : b + 1], src_mask[b : b + 1, :n])
        torch.testing.assert_close(batched[b : b + 1], alone, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_incremental_decoding_equals_the_teacher_forced_forward() -> None:
    model = conv_model(conv_kernel=5)
    src, src_mask = padded_sources([6, 2, 4], model.config.vocab_size)
    tgt = tokens(3, 9, model.config.vocab_size, seed=5)
    full = model(src, tgt, src_mask)
    memory, cache = model.encode(src, src_mask), model.new_cache(3, 10)
    steps = [model.decode(tgt[:, :3], memory, src_mask, cache=cache, start=0)]  # a three-token first call
    steps += [model.decode(tgt[:, t : t + 1], None, src_mask, cache=cache, start=t) for t in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="start=4"):
        model.decode(tgt[:, :1], None, src_mask, cache=cache, start=4)
    with pytest.raises(ValueError, match="position 32"):
        model(src, tokens(3, 33, model.config.vocab_size), src_mask)


def test_greedy_translation_equals_an_uncached_argmax_loop() -> None:
    model = conv_model(vocab_size=12, seed=1)
    sources = [[5, 7, 3, 9], [4], [8, 8, 6], [11, 3, 5, 7, 10, 6]]
    eos = uncached_greedy(model, sources[:1], BOS, EOS, max_extra=4)[0][2]  # a token row 0 picks: rows end early
    expected = uncached_greedy(model, sources, BOS, eos, max_extra=4)
    assert any(len(hyp) < len(src) + 5 for hyp, src in zip(expected, sources, strict=True)), "some stop on </s>"
    assert translate_ids(model, sources, BOS, eos, PAD, beam_size=1, extra_len=4) == expected
    src, src_mask = padded_sources([4, 2], 12)
    one_beam = beam_search(model, src, src_mask, 6, BOS, EOS, beam_size=1, alpha=0.0)
    assert one_beam == greedy_search(model, src, src_mask, 6, BOS, EOS)


def test_beam_search_on_a_batch_equals_beam_search_on_each_source_alone() -> None:
    """Sources leave the batch at different steps: each layer's history and the memory must follow the beams."""
    model = conv_model(vocab_size=12, seed=2)
    sources = [[5, 7, 3, 9], [4], [8, 8, 6], [11, 3, 5, 7, 10, 6]]
    batched = translate_ids(model, sources, BOS, EOS, PAD, beam_size=3, extra_len=6)
    assert batched == [translate_ids(model, [s], BOS, EOS, PAD, beam_size=3, extra_len=6)[0] for s in sources]
    assert len({len(hyp) for hyp in batched}) > 1, "rows should end at different steps"


# ---- config, recipe and the trainer ------------------------------------------------------------------------------


def test_config_errors_say_what_to_change() -> None:
    family = "conv-encoder-decoder"
    assert ModelConfig(family=family, position="learned").conv_kernel == 3
    with pytest.raises(ConfigError, match="conv_kernel must be odd"):
        ModelConfig(family=family, position="learned", conv_kernel=4)
    with pytest.raises(ConfigError, match="conv_hidden must be at least 1"):
        ModelConfig(family=family, position="learned", conv_hidden=0)
    with pytest.raises(ConfigError, match="set position: learned"):
        ModelConfig(family=family, position="sinusoidal")
    with pytest.raises(ConfigError, match="sliding_window, activation_checkpointing .* remove sliding_window, act"):
        ModelConfig(family=family, position="learned", sliding_window=8, activation_checkpointing=True)
    with pytest.raises(ConfigError, match="conv_hidden, conv_kernel applies to family 'conv-encoder-decoder' only"):
        ModelConfig(conv_hidden=256, conv_kernel=3)
    with pytest.raises(ConfigError, match="n_decoder_layers >= 1"):
        ModelConfig(family=family, position="learned", n_decoder_layers=0)


def test_the_recipe_has_the_main_transformers_parameter_count_within_half_a_percent() -> None:
    def count(recipe: str) -> int:
        config, _ = load_recipe(CONFIGS / recipe, ["model.vocab_size=4000"])
        return build_model(config, initialize=False).num_parameters()

    transformer, conv = count("en-de-10min.yaml"), count("convs2s-en-de.yaml")
    assert abs(conv / transformer - 1) <= 0.005, (conv, transformer)


def test_the_trainer_trains_it_and_its_checkpoint_translates(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, max_steps=12, save_every=12, log_every=4)
    overrides = ["model.family=conv-encoder-decoder", "model.position=learned", "model.conv_hidden=24"]
    run = trainer(recipe, *overrides, "model.dropout=0.0", "train.bf16=true", "train.bf16_weights=true")
    result = run.fit()
    assert result["step"] == 12 and isinstance(run.model, ConvS2S)
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0], losses
    restored = load(resolve_checkpoint(run.run_dir))
    for name, value in run.model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name
    sentences, tok = ["three one four", "two"], run.data.tokenizer
    ids = translate_ids(run.model.eval(), tok.encode_batch(sentences), tok.bos_id, tok.eos_id, tok.pad_id, 2)
    assert Translator.load(run.run_dir).translate_batch(sentences, 2) == tok.decode_batch(ids)
