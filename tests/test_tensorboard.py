"""train.log_to: [jsonl, tensorboard]: the event files, read back with TensorBoard's own reader (EventAccumulator),
hold every number of metrics.jsonl at its step with its value, the histograms of the weights and gradients of the
step they were taken at, and after a resume each step once, as metrics.jsonl does."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import trainer, write_corpus, write_recipe

from tformer.checkpoints import checkpoint_dir
from tformer.config import ConfigError
from tformer.training import TrainConfig
from tformer.training.sinks import TENSORBOARD_DIR, MetricsSinks, scalar_tag

pytest.importorskip("tensorboard", reason="`pip install tensorboard==2.21.0` (the test extra installs it)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

TENSORBOARD = "train.log_to=[jsonl, tensorboard]"
pytestmark = pytest.mark.usefixtures("one_thread")


def read_events(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()  # purge_orphaned_data (the default) applies the purge step a resumed run writes
    return events


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_every_number_at_its_step(run_dir: Path) -> None:
    """Each number of metrics.jsonl is the scalar of its tag at its step (float32 in the event file), in the same
    order, and the event file holds nothing else."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records(run_dir):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                expected.setdefault(scalar_tag(key), []).append((record["step"], value))
    events = read_events(run_dir)
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, logged in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [step for step, _ in got] == [step for step, _ in logged], tag
        for (step, value), (_, reference) in zip(got, logged, strict=True):
            assert value == pytest.approx(reference, rel=1e-6, nan_ok=True), (tag, step)


def test_the_event_file_holds_metrics_jsonl_and_the_histograms_of_the_last_step(tmp_path: Path) -> None:
    dev = write_corpus(tmp_path / "dev.tsv", n=6)
    recipe = write_recipe(tmp_path, max_steps=6, log_every=2, eval_every=3, save_every=100, dev_corpus=str(dev))
    run = trainer(recipe, "model.dropout=0", "train.beam_size=1", TENSORBOARD, "train.histogram_every=2")
    run.fit()
    logged = records(run.run_dir)
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(logged[0]), logged[0]
    assert [r["step"] for r in logged if "dev_bleu" in r] == [3, 6, 6]  # every 3 steps, then the final evaluation
    assert_every_number_at_its_step(run.run_dir)

    events = read_events(run.run_dir)
    parameters = dict(run.model.named_parameters())
    assert sorted(events.Tags()["histograms"]) == sorted(
        [f"weights/{name}" for name in parameters] + [f"gradients/{name}" for name in parameters]
    )
    for name, parameter in parameters.items():  # step 6 is the last: the weights after it, its gradients
        for kind, tensor in (("weights", parameter.detach()), ("gradients", parameter.grad)):
            histograms = events.Histograms(f"{kind}/{name}")
            assert [h.step for h in histograms] == [2, 4, 6]
            last = histograms[-1].histogram_value
            assert (last.num, last.min, last.max) == (tensor.numel(), tensor.min().item(), tensor.max().item())
            assert last.sum == pytest.approx(tensor.double().sum().item(), rel=1e-5, abs=1e-6), (
                kind,
                name,
            )  # a float32 sum
            if last.min == last.max:  # a constant, e.g. a norm's weights that did not move: one bucket
                assert list(last.bucket) == [tensor.numel()]
                continue
            counts, edges = np.histogram(tensor.numpy(), bins=len(last.bucket), range=(last.min, last.max))
            assert list(last.bucket) == counts.tolist(), (kind, name)  # numpy's histogram over the same range
            assert list(last.bucket_limit) == pytest.approx(edges[1:].tolist(), rel=1e-6), (kind, name)  # f32 edges


def test_a_resumed_run_logs_each_step_once(tmp_path: Path) -> None:
    """A run killed after logging steps it had not saved: the resumed run logs them again, and TensorBoard keeps
    only the new events (tokens/s and elapsed time differ from the first run's), as metrics.jsonl does."""
    recipe = write_recipe(tmp_path, max_steps=4, log_every=1, save_every=2)
    first = trainer(recipe, TENSORBOARD)
    first.fit()
    shutil.rmtree(checkpoint_dir(first.run_dir, 4))  # killed after step 4's logs, before its checkpoint
    before = {r["step"]: r for r in records(first.run_dir)}
    resumed = trainer(recipe, TENSORBOARD)
    assert resumed.step == 2
    resumed.fit()
    after = {r["step"]: r for r in records(resumed.run_dir)}
    assert sorted(after) == [1, 2, 3, 4]
    assert after[3]["loss"] == before[3]["loss"]  # bit-exact resume ...
    assert after[3]["elapsed"] != before[3]["elapsed"]  # ... but not the clock
    assert len(list((resumed.run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2
    assert_every_number_at_its_step(resumed.run_dir)


def test_non_finite_gradients_are_left_out_of_their_histogram(tmp_path: Path) -> None:
    """An fp16 step that overflowed (and was skipped) leaves inf and NaN gradients: the finite ones are counted."""
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.tensor([[1.0, math.inf, 2.0], [math.nan, 0.0, 3.0]])
    model.bias.grad = torch.full((2,), math.nan)
    sinks = MetricsSinks(["tensorboard"], tmp_path, model, histogram_every=1)
    sinks.write({"step": 1, "loss": 1.0})
    sinks.close()
    events = read_events(tmp_path)
    assert sorted(events.Tags()["histograms"]) == ["gradients/weight", "weights/bias", "weights/weight"]
    counted = events.Histograms("gradients/weight")[0].histogram_value
    assert (counted.num, counted.min, counted.max, counted.sum) == (4, 0.0, 3.0, 6.0)


def test_sharded_parameters_get_no_histogram_and_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """FSDP and tensor parallelism leave DTensor shards on each rank; gathering them for a histogram is not cheap."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        model.weight = torch.nn.Parameter(
            distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (1,)), [Shard(0)])
        )
        model.bias.grad = torch.ones(4)
        sinks = MetricsSinks(["tensorboard"], tmp_path, model, histogram_every=1)
        sinks.write({"step": 1, "loss": 1.0})
        sinks.write({"step": 2, "loss": 0.5})
        sinks.close()
    finally:
        dist.destroy_process_group()
    assert sorted(read_events(tmp_path).Tags()["histograms"]) == ["gradients/bias", "weights/bias"]
    assert capsys.readouterr().err.count("their histograms are not written") == 1  # once, not every step


def test_without_the_tensorboard_package_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'tformer\[tensorboard\]'.*tensorboard==2\.21\.0"):
        MetricsSinks(["jsonl", "tensorboard"], tmp_path, torch.nn.Linear(2, 2))
    MetricsSinks(["jsonl"], tmp_path, torch.nn.Linear(2, 2)).close()  # the default needs nothing more


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"log_to": ["jsonl", "wandb"]}, "unknown train.log_to sink 'wandb'; choose from: jsonl, tensorboard"),
        ({"log_to": []}, "at least one"),
        ({"log_to": ["tensorboard", "tensorboard"]}, "each sink once"),
        ({"log_to": "tensorboard"}, "log_to must be list"),
        ({"histogram_every": 20}, "add tensorboard to train.log_to"),
        ({"log_to": ["tensorboard"], "histogram_every": 30}, r"multiple of train.log_every \(20\)"),
        ({"log_to": ["tensorboard"], "histogram_every": -1}, "histogram_every must be 0"),
    ],
)
def test_bad_log_to_keys_are_config_errors(keys: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**keys)
