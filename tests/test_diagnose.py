"""Training diagnosis: a NaN injected into a chosen module, in the forward or the backward pass, is traced back to
that module; the trainer's divergence and out-of-memory errors carry the culprit, the estimate and the remedies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_model, tiny_config, tokens
from helpers import steps, trainer, write_recipe
from torch import nn

from tformer.errors import TrainingDiverged, TrainingOutOfMemory
from tformer.training.diagnose import LossSpikes, NonFinite, is_out_of_memory, locate_non_finite


class NaNGradient(torch.autograd.Function):
    """The identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


def poison(module: nn.Module, phase: str) -> None:
    """Makes `module` put a NaN in its output (forward) or in the gradient it passes back (backward)."""
    forward = module.forward

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        out = forward(*args, **kwargs)
        return out + float("nan") if phase == "forward" else NaNGradient.apply(out)

    module.forward = poisoned


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize(
    "name", ["decoder.layers.0.self_attn.q_proj", "decoder.layers.1.ffn.down_proj", "decoder.final_norm", "lm_head"]
)
def test_the_poisoned_module_is_named(name: str, phase: str) -> None:
    model = make_model(tiny_config("tiny-llama")).train()
    ids = tokens(2, 12, model.config.vocab_size)
    assert locate_non_finite(model, lambda: lm_loss(model, ids)) is None  # the healthy model stays finite
    poison(model.get_submodule(name), phase)
    assert locate_non_finite(model, lambda: lm_loss(model, ids)) == NonFinite(name, phase)
    assert all(p.grad is None for p in model.parameters())  # the replay leaves no gradients behind


def test_a_non_finite_loss_alone_is_blamed_on_the_loss() -> None:
    model = make_model(tiny_config("tiny-llama"))
    ids = tokens(1, 8, model.config.vocab_size)
    assert locate_non_finite(model, lambda: lm_loss(model, ids) * float("inf")) == NonFinite("the loss", "forward")


def test_diverged_training_names_the_module_and_the_remedies(tmp_path: Path) -> None:
    run = trainer(write_recipe(tmp_path), "train.max_steps=10", "train.save_every=3")
    layer = run.model.get_submodule("decoder.layers.1.ffn.up_proj")
    forward = layer.forward

    def poisoned(x: torch.Tensor) -> torch.Tensor:
        return forward(x) + (float("nan") if run.step >= 4 else 0.0)

    layer.forward = poisoned
    with pytest.raises(TrainingDiverged) as err:
        run.fit()
    message = str(err.value)
    assert message.startswith("step 5: loss nan")
    assert "First non-finite value: decoder.layers.1.ffn.up_proj (forward" in message
    for key in ("1. train.bf16: false, already safe", "2. train.lr:", "3. train.clip_grad: 1.0", "4. model.init: gpt2"):
        assert key in message
    assert steps(run.run_dir) == [3]


def test_out_of_memory_stops_with_the_fixes_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    run = trainer(write_recipe(tmp_path), "train.max_steps=10", "train.save_every=2")
    train_step = run.train_step

    def allocate(batches: list) -> tuple[float, int]:
        if run.step >= 3:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
        return train_step(batches)

    run.train_step = allocate
    with pytest.raises(TrainingOutOfMemory) as err:
        run.fit()
    message = str(err.value)
    assert message.startswith("step 4: out of memory (RuntimeError: [enforce fail")
    assert "estimated peak memory for this config:" in message and "peak per rank" in message
    assert "1. model.activation_checkpointing: true (now false)" in message
    assert "2. train.max_tokens: halve it to 128 and train.grad_accum: double it to 2" in message
    assert steps(run.run_dir) == [2]
    assert is_out_of_memory(MemoryError()) and not is_out_of_memory(RuntimeError("shape mismatch"))


def test_gradient_norm_is_logged_and_equals_the_clipping_norm(tmp_path: Path) -> None:
    run = trainer(write_recipe(tmp_path), "train.max_steps=5", "train.log_every=5")
    run.fit()
    record = next(
        json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines() if "grad_norm" in line
    )
    assert record["step"] == 5 and record["grad_norm"] == pytest.approx(run.grad_norm)
    assert 0 < record["grad_norm"] < 1e3


def test_loss_spikes_are_flagged_against_the_running_average() -> None:
    watch = LossSpikes(factor=2.0, warmup_steps=5)
    losses = [4.0, 3.9, 4.1, 3.8, 4.0, 3.9, 9.5, 4.0, 3.7]
    flagged = [i for i, loss in enumerate(losses) if watch.check(loss) is not None]
    assert flagged == [6]
    expected = losses[0]
    for loss in losses[1:6] + losses[7:]:  # the running average of every loss but the spike
        expected = 0.98 * expected + 0.02 * loss
    assert watch.average == pytest.approx(expected)
