"""The SSM family (a Mamba LM): its scans against a plain loop of the recurrence, decoding with the constant-size
state against the full forward, gradients, training and a checkpoint round trip, and its config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import trainer

import tformer
from tformer import ConfigError, ModelConfig
from tformer.checkpoints import list_checkpoints
from tformer.layers.ssm import selective_scan, selective_step


def ssm_config(**overrides: object) -> ModelConfig:
    base = dict(family="ssm", vocab_size=97, d_model=32, n_decoder_layers=2, dropout=0.0, norm="rmsnorm")
    return ModelConfig(**{**base, "ssm_state_size": 4, "ssm_conv_width": 3, **overrides})


def reference_scan(x, delta, A, B, C, D, h0):  # noqa: ANN001, ANN201 (the formula, written as plainly as it reads)
    """h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t, y_t = C_t h_t + D x_t: loops over batch, time, channel and state."""
    batch, length, d = x.shape
    n = A.shape[1]
    y = torch.zeros(batch, length, d, dtype=torch.float64)
    h = h0.clone().double()
    for b in range(batch):
        for t in range(length):
            for i in range(d):
                for j in range(n):
                    dt = float(delta[b, t, i])
                    h[b, i, j] = torch.exp(dt * A[i, j]) * h[b, i, j] + dt * B[b, t, j] * x[b, t, i]
                y[b, t] = (h[b] * C[b, t][None, :]).sum(-1) + D * x[b, t]
    return y, h


def scan_inputs(batch: int = 2, length: int = 37, d: int = 3, n: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, length, d, generator=g)
    delta = torch.nn.functional.softplus(torch.randn(batch, length, d, generator=g))  # Δ up to ~3: strong decay too
    A = -torch.rand(d, n, generator=g) * 4 - 0.1
    B, C = torch.randn(batch, length, n, generator=g), torch.randn(batch, length, n, generator=g)
    D, h0 = torch.randn(d, generator=g), torch.randn(batch, d, n, generator=g)
    return x, delta, A, B, C, D, h0


@pytest.mark.parametrize("scan", ["parallel", "sequential"])
def test_scan_equals_the_plain_recurrence(scan: str) -> None:
    inputs = scan_inputs()  # 37 tokens: a full 32-token chunk and a partial one, so the state crosses a boundary
    y, h = selective_scan(*inputs, scan=scan)
    y_ref, h_ref = reference_scan(*inputs)
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref.float(), rtol=1e-5, atol=1e-5)


def test_step_equals_the_plain_recurrence() -> None:
    x, delta, A, B, C, D, h = scan_inputs(length=5)
    y_ref, h_ref = reference_scan(x, delta, A, B, C, D, h)
    for t in range(5):
        y, h = selective_step(x[:, t], delta[:, t], A, B[:, t], C[:, t], D, h)
        torch.testing.assert_close(y, y_ref[:, t].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt", [1, 6])
def test_recurrent_decoding_equals_the_full_forward(prompt: int) -> None:
    torch.manual_seed(0)
    model = tformer.build_model(ssm_config()).eval()
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2)
        pieces = [model(ids[:, :prompt], cache=cache)]
        pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(prompt, 40)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)
    state_bytes = sum(s.nbytes() for s in cache)
    assert state_bytes == 2 * 2 * 64 * (2 * 4 + 4 * 4)  # 2 layers x B 2 x d_inner 64 x (conv 2 + state 4) x fp32


def test_gradients_reach_every_parameter() -> None:
    torch.manual_seed(0)
    model = tformer.build_model(ssm_config()).train()
    model(torch.randint(1, 97, (2, 40))).logsumexp(-1).mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient reaches {name}"


@pytest.mark.parametrize("scan", ["parallel", "sequential"])
def test_scan_gradients_equal_finite_differences(scan: str) -> None:
    inputs = [t.double().requires_grad_() for t in scan_inputs(batch=1, length=33, d=2, n=2)]
    assert torch.autograd.gradcheck(lambda *args: selective_scan(*args, scan=scan), inputs)


def test_trains_with_the_trainer_and_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_text("".join(f"the {w} went up and the {w} came down\n" for w in ("king", "man", "dog")) * 20)
    recipe = tmp_path / "recipe.yaml"
    model = {**ssm_config().to_dict(), "ssm_state_size": 8}
    train = dict(
        corpus=str(corpus), objective="clm", vocab_size=300, max_len=32, max_tokens=256, max_steps=20, log_every=2
    )
    train.update(optimizer="adamw-cosine", lr=1e-2, warmup=2, label_smoothing=0.0, save_every=20, eval_every=1000)
    recipe.write_text(yaml.safe_dump({"model": model, "train": {**train, "out_dir": str(tmp_path / "run")}}))
    run = trainer(recipe)
    run.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.5
    loaded = tformer.load(list_checkpoints(tmp_path / "run")[-1])
    assert isinstance(loaded, type(run.model)) and loaded.config == run.model.config
    ids = torch.randint(1, loaded.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), run.model.eval()(ids))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ssm_state_size": 0}, "ssm_state_size must be at least 1"),
        ({"ssm_conv_width": 0}, "ssm_conv_width must be at least 1"),
        ({"ssm_expand": -2}, "ssm_expand must be at least 1"),
        ({"n_decoder_layers": 0}, "family 'ssm' stacks n_decoder_layers Mamba blocks"),
        ({"ssm_expand": 1.5}, "ssm_expand must be int"),
    ],
)
def test_bad_ssm_configs_say_what_to_fix(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ssm_config(**overrides)


def test_an_ssm_cannot_train_an_objective_that_needs_attention(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    train = {"corpus": "bible:en", "objective": "prefix_lm", "out_dir": str(tmp_path / "run")}
    recipe.write_text(yaml.safe_dump({"model": ssm_config().to_dict(), "train": train}))
    with pytest.raises(ConfigError, match="objective 'prefix_lm' trains a 'decoder' model"):
        trainer(recipe)
