"""Sliding-window perplexity, packing and passkey scoring (training/extrapolation.py) against plain references."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import assert_png

from tformer.config import ConfigError, ModelConfig
from tformer.data import Tokenizer
from tformer.training.extrapolation import (
    PASSKEY_FILLER,
    PASSKEY_INTRO,
    PasskeyExample,
    pack_texts,
    passkey_example,
    passkey_scores,
    plan_windows,
    sliding_window_nll,
)
from tformer.training.init_from import check_agrees
from tformer.viz.plots import plot_extrapolation

BOS = 1
SCHEMES = ("sinusoidal", "rope", "alibi")


def _model(position: str):
    return make_model(tiny_config(position=position, max_seq_len=64, vocab_size=50))


def _stream(n: int) -> list[int]:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(5, 50, (n,), generator=generator).tolist()


def _naive_nll(model, ids: list[int], target: int, context: int) -> float:
    """-log p(ids[target]) from one forward pass over bos + the `context` tokens before it."""
    inputs = torch.tensor([[BOS, *ids[target - context : target]]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(inputs)[0, -1].float(), dim=-1)
    return -logprobs[ids[target]].item()


@pytest.mark.parametrize("position", SCHEMES)
def test_one_window_over_the_whole_text_is_the_ordinary_perplexity(position: str) -> None:
    model, ids = _model(position), _stream(40)
    total, scored = sliding_window_nll(model, ids, window=len(ids), stride=len(ids), bos_id=BOS)
    with torch.no_grad():
        logits = model(torch.tensor([[BOS, *ids[:-1]]]))[0]
    reference = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids), reduction="sum").item()
    assert scored == len(ids)
    assert total == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("position", SCHEMES)
def test_stride_one_scores_each_token_with_its_full_left_window(position: str) -> None:
    model, ids, window = _model(position), _stream(30), 8
    total, scored = sliding_window_nll(model, ids, window=window, stride=1, bos_id=BOS, start=3, batch_size=5)
    reference = sum(_naive_nll(model, ids, i, min(i, window - 1)) for i in range(3, len(ids)))
    assert scored == len(ids) - 3
    assert total == pytest.approx(reference, rel=1e-5)


def test_a_larger_stride_gives_each_target_the_context_its_window_holds() -> None:
    """Stride 4 in windows of 10: the k-th of each window's 4 scored targets sees 6 + k tokens before it."""
    model, ids = _model("rope"), _stream(33)
    start, count, window, stride = 12, 16, 10, 4
    total, scored = sliding_window_nll(model, ids, window=window, stride=stride, bos_id=BOS, start=start, count=count)
    reference = sum(
        _naive_nll(model, ids, i, window - stride + (i - start) % stride) for i in range(start, start + count)
    )
    assert scored == count
    assert total == pytest.approx(reference, rel=1e-5)


def test_windows_tile_the_targets_once_and_never_pass_the_window() -> None:
    plan = plan_windows(start=5, count=23, window=8, stride=3)
    scored = [t for w in plan for t in range(w.score_from, w.end)]
    assert scored == list(range(5, 28))
    assert all(w.end - w.first <= 8 and w.first >= 0 for w in plan)
    with pytest.raises(ValueError, match="stride"):
        plan_windows(0, 10, window=4, stride=5)


def test_pack_texts_keeps_order_and_budget() -> None:
    lengths = [5, 4, 9, 12, 1, 1, 7]
    groups = pack_texts(lengths, max_tokens=10)
    assert groups == [[0, 1], [2], [4, 5, 6]]  # 12 alone is over the budget and left out
    assert all(sum(lengths[i] for i in g) <= 10 for g in groups)


def test_passkey_scores_agree_with_greedy_decoding() -> None:
    model = _model("alibi")
    rng = random.Random(0)
    prompt = [BOS, *(rng.randrange(5, 50) for _ in range(20))]
    sequence, decoded = list(prompt), []
    with torch.no_grad():
        for _ in range(4):
            decoded.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
            sequence.append(decoded[-1])
    # the greedy continuation itself is retrieved; changing its third token breaks it from there on
    assert passkey_scores(model, PasskeyExample(prompt, decoded, [True] * 4, 0.5)) == (True, 4, 0)
    wrong = [*decoded[:2], (decoded[2] + 1) % 50, decoded[3]]
    greedy, correct, _ = passkey_scores(model, PasskeyExample(prompt, wrong, [True, True, True, False], 0.5))
    assert not greedy
    assert correct == 2  # the first two, not the changed one; the fourth is not a digit
    # digits are counted after the true prefix: the fourth token is scored after `wrong`'s third
    with torch.no_grad():
        fourth = int(model(torch.tensor([prompt + wrong[:3]]))[0, -1].argmax())
    assert passkey_scores(model, PasskeyExample(prompt, wrong, [False, False, False, True], 0.5))[1] == int(
        fourth == wrong[3]
    )


def test_passkey_digit_choice_is_the_likeliest_of_the_ten_digits() -> None:
    model, digit_ids = _model("rope"), list(range(20, 30))  # tokens 20..29 stand for the digits 0..9
    prompt = [BOS, *range(5, 25)]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [21, 22]]))[0, len(prompt) - 1 :]  # predicting 3 answer tokens
    best = [digit_ids[int(row[digit_ids].argmax())] for row in logits]
    for answer in ([21, 22, 23], best):
        example = PasskeyExample(prompt, answer, [True, True, True], 0.5, digit_ids)
        _, _, among = passkey_scores(model, replace(example, answer=answer))
        expected = sum(
            int(model(torch.tensor([prompt + answer[:i]]))[0, -1][digit_ids].argmax()) == answer[i] - 20
            for i in range(3)
        )
        assert among == expected
    assert passkey_scores(model, PasskeyExample(prompt, best, [True] * 3, 0.5, digit_ids))[2] >= 1


def test_passkey_example_fits_its_length_and_places_the_needle() -> None:
    tokenizer = Tokenizer.train([PASSKEY_FILLER, PASSKEY_INTRO, "The pass key is 123. Remember it."] * 20, 500)
    for n_tokens in (256, 1024):
        for depth in (0.0, 0.5, 1.0):
            example = passkey_example(tokenizer, n_tokens, depth, random.Random(1))
            assert len(example.prompt) + len(example.answer) <= n_tokens
            text = tokenizer.decode(example.prompt)
            key = tokenizer.decode(example.answer).strip()
            assert len(key) == 5 and key.isdigit() and text.count(key) == 2
            needle = text.index(key) / len(text)
            assert abs(needle - depth) < 0.25, (n_tokens, depth, needle)


def test_init_from_accepts_rope_scaling_for_a_longer_context_and_nothing_else() -> None:
    """Fine-tuning at a longer length (PI, NTK, YaRN) changes only RoPE's scaling keys, which add no weights."""
    weights = tiny_config(position="rope", max_seq_len=64)
    for scaling, factor in (("linear", 4.0), ("dynamic-ntk", 1.0), ("yarn", 4.0)):
        check_agrees(
            ModelConfig.from_dict({**weights.to_dict(), "rope_scaling": scaling, "rope_factor": factor}), weights, "w"
        )
    with pytest.raises(ConfigError, match="model.rope_theta"):
        check_agrees(ModelConfig.from_dict({**weights.to_dict(), "rope_theta": 500.0}), weights, "w")


def test_plot_extrapolation_draws_every_curve(tmp_path) -> None:
    curves = {"alibi": {128: 90.0, 256: 85.0, 4096: 84.0}, "rope + PI, zero-shot": {128: 90.0, 256: 120.0}}
    assert_png(plot_extrapolation(curves, 128, tmp_path / "extrapolation.png"))
