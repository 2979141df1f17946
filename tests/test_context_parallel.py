"""Context parallelism: ring attention over real processes (torchrun, gloo) against full attention in one process.

The references: torch's SDPA on the whole sequence for the kernel (outputs and gradients, fp32, within 1e-5), the
unsharded model for a model with ring attention swapped in, and a one-process training run for the loss curve of
`train.context_parallel: 2`. The zigzag bookkeeping is checked in process against brute force.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import WORDS, run_processes, torchrun
from safetensors.torch import load_file

from tformer.checkpoints import checkpoint_dir
from tformer.config import ConfigError, ModelConfig
from tformer.data import LMBatch
from tformer.models import WEIGHTS_FILE
from tformer.training import TrainConfig
from tformer.training.context_parallel import (
    block_plan,
    check_context_parallel,
    check_world_size,
    shard_lm_batch,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)

TOLERANCE = 1e-5  # fp32; measured differences are about 1e-6 (summation order of the blocks)
WEIGHT_TOLERANCE = 1e-5
STEPS = 6


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_ring_attention_equals_full_attention_on_2_and_4_ranks(tmp_path: Path) -> None:
    """One launch of 4 processes (each start costs seconds on 2 cores): rings of ranks 0-1 and of all 4."""
    out = tmp_path / "report.json"
    worker = Path(__file__).with_name("cp_worker.py")
    result = run_processes(torchrun(4, str(worker), str(out)))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report) == 2 * 11  # on 2 and 4 ranks: 4 kernel cases x 2 block kernels, 3 models
    for case, differences in report.items():
        for what, difference in differences.items():
            assert difference < TOLERANCE, f"{case}: {what} differs by {difference:.2e}"


def test_the_two_rank_loss_curve_equals_one_process(tmp_path: Path) -> None:
    recipe = write_lm_recipe(tmp_path)
    runs, weights = {}, {}
    for ranks in (1, 2):
        run_dir = tmp_path / f"cp{ranks}"
        args = ["-m", "tformer", "train", str(recipe), f"train.out_dir={run_dir}", f"train.context_parallel={ranks}"]
        command = [sys.executable, *args] if ranks == 1 else torchrun(ranks, *args)
        result = run_processes(command)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[ranks] = losses(run_dir)
        weights[ranks] = load_file(checkpoint_dir(run_dir, STEPS) / WEIGHTS_FILE)
    assert sorted(runs[2]) == list(range(1, STEPS + 1))
    for step, loss in runs[1].items():  # measured: within 1e-7
        assert runs[2][step] == pytest.approx(loss, rel=TOLERANCE), f"step {step}"
    assert runs[2][STEPS] < runs[2][1], "it learns"
    assert weights[2].keys() == weights[1].keys()
    for name, expected in weights[1].items():  # measured: within 3e-6 after 6 Adam steps
        torch.testing.assert_close(weights[2][name], expected, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)


def write_lm_recipe(directory: Path) -> Path:
    """A tiny LLaMA-style LM (RoPE, GQA) on lines of 10 to 40 number words, two batches a step, no dropout."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for _ in range(200)]
    (directory / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    train = {
        "corpus": str(directory / "train.txt"),
        "objective": "clm",
        "vocab_size": 300,
        "max_len": 64,
        "max_tokens": 512,
        "grad_accum": 2,
        "max_steps": STEPS,
        "log_every": 1,
        "eval_every": 10_000,
        "save_every": 10_000,
        "optimizer": "adamw-cosine",
        "lr": 3e-3,
        "warmup": 2,
    }
    model = {"preset": "tiny-llama", "dropout": 0.0, "attn_dropout": 0.0}
    recipe = directory / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": model, "train": train}))
    return recipe


# ---- the zigzag layout, in process -----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zigzag_shards_cover_the_sequence_once_and_unshard_back(world_size: int) -> None:
    x = torch.arange(2 * 4 * world_size * 3).view(2, -1, 3)  # (B, T, d)
    shards = [zigzag_shard(x, r, world_size) for r in range(world_size)]
    assert torch.equal(zigzag_unshard(shards), x)
    chunk = x.shape[1] // (2 * world_size)
    assert zigzag_indices(x.shape[1], 0, world_size)[chunk:].min() == x.shape[1] - chunk  # rank 0 holds the end


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_the_ring_steps_visit_each_allowed_query_key_pair_exactly_once(world_size: int, causal: bool) -> None:
    """Brute force over global indices: the union of every rank's blocks is the causal (or full) pattern."""
    seq_len = 4 * world_size
    local = seq_len // world_size
    visits = torch.zeros(seq_len, seq_len, dtype=torch.long)
    for rank in range(world_size):
        queries = zigzag_indices(seq_len, rank, world_size)
        for step in range(world_size):
            source = (rank - step) % world_size
            keys = zigzag_indices(seq_len, source, world_size)
            rows, cols, diagonal = block_plan(rank, source, world_size, causal, local)
            allowed = torch.ones(local, local, dtype=torch.long)[rows, cols]
            if diagonal:
                allowed = allowed.tril()
            visits[queries[rows, None], keys[None, cols]] += allowed
    expected = torch.ones(seq_len, seq_len, dtype=torch.long)
    assert torch.equal(visits, expected.tril() if causal else expected)


def test_a_batch_is_padded_at_the_end_and_sharded_with_its_labels() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    mask = (ids != 0).long()
    batch = LMBatch(ids, mask, ids.masked_fill(mask == 0, -100))
    shards = [shard_lm_batch(batch, r, 2) for r in range(2)]
    assert [s.input_ids.shape for s in shards] == [(2, 4), (2, 4)]  # 5 tokens padded to 8 = 4 chunks of 2
    whole = zigzag_unshard([s.labels for s in shards])
    assert whole.tolist() == [[1, 2, 3, 4, 5, -100, -100, -100], [6, 7, 8, -100, -100, -100, -100, -100]]
    left_padded = LMBatch(ids.flip(1), mask.flip(1), ids.flip(1))
    with pytest.raises(ValueError, match="right-padded"):
        shard_lm_batch(left_padded, 0, 2)


# ---- what it refuses -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "objective", "message"),
    [
        ({"position": "alibi"}, "clm", "ALiBi"),
        ({"position": "t5", "scale_attention": False}, "clm", "T5's"),  # the first problem is named
        ({"scale_attention": False}, "clm", "scale_attention: true"),
        ({"sliding_window": 8}, "clm", "sliding window"),
        ({"attn_logit_softcap": 50.0}, "clm", "attn_logit_softcap"),
        ({"attention_scale_dim": 16}, "clm", "attention_scale_dim"),
        ({"attn_dropout": 0.1}, "clm", "attn_dropout=0"),
        ({}, "prefix_lm", "objective: clm"),
    ],
)
def test_what_ring_attention_cannot_do_exactly_is_a_config_error(model: dict, objective: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_context_parallel(
            ModelConfig.from_dict({"preset": "tiny-llama", "attn_dropout": 0.0, **model}), objective, 2
        )


def test_the_number_of_processes_must_match_and_the_strategy_must_replicate() -> None:
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        check_world_size(2, 1)
    check_world_size(1, 4)  # off: any number of processes
    with pytest.raises(ConfigError, match="context_parallel must be"):
        TrainConfig(context_parallel=2, parallel="fsdp")
    with pytest.raises(ConfigError, match="context_parallel must be"):
        TrainConfig(context_parallel=0)
