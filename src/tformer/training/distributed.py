"""Training on several processes with torch.distributed, launched by torchrun.

    torchrun --nproc-per-node 2 -m tformer train recipe.yaml train.parallel=fsdp

A process learns its place from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); without them (or with WORLD_SIZE=1) it trains alone and nothing here changes the model. The
backend is gloo on the CPU and NCCL on CUDA. The ranks form a 2-D mesh ("dp", "tp"):

- ddp: DistributedDataParallel, every rank holds the whole model and gradients are averaged (tp = 1);
- fsdp: FSDP2 (`fully_shard`) on every block and on the root; `fsdp_sharding: full` frees the gathered
  parameters after forward (ZeRO-3), `grad-op` keeps them until backward (ZeRO-2); with optional mixed
  precision (`fsdp_param_dtype`, `fsdp_reduce_dtype`);
- tp: Megatron-style tensor parallelism with DTensor over all ranks: column-parallel Q/K/V and FFN up/gate
  projections, row-parallel attention output and FFN down projections, so a block all-reduces twice in
  forward; embeddings, norms and the output head stay replicated;
- fsdp+tp: TP inside groups of `tp_size` ranks, FSDP across the groups;
- cp (`train.context_parallel: N`): each sequence split over the N ranks, ring attention (context_parallel.py).

Ranks of one tp group see the same batches; the dp groups split each step's batches between them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from tformer.config import ConfigError
from tformer.data import LMBatch, Seq2SeqBatch
from tformer.errors import DistributedFailure
from tformer.layers.attention import Attention
from tformer.layers.block import Block
from tformer.layers.ffn import MLP, GatedMLP
from tformer.training.config import TrainConfig
from tformer.training.context_parallel import check_world_size, context_parallel, shard_lm_batch

FSDP_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}  # None: FSDP keeps the parameters' own dtype


@dataclass
class DistContext:
    """Where this process sits: its rank among `world_size`, and the ("dp", "tp") mesh when there are several."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None
    timeout: float = 600.0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, draws the progress bar, evaluates and writes the files that are not sharded."""
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else 1

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size() if self.mesh is not None else 1

    # ---- small collectives (no-ops when training alone) --------------------------------------------------
    def sum_over_data_parallel(self, values: list[float]) -> list[float]:
        """Sums per-rank numbers (tokens, loss) across the dp groups: tp ranks hold the same numbers."""
        if not self.enabled:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.mesh.get_group("dp"))
        return tensor.tolist()

    def takes_batch(self, j: int) -> bool:
        """Whether this rank trains on the step's j-th batch: dp ranks split them, cp ranks share every one."""
        return self.strategy == "cp" or j % self.dp_size == self.dp_rank

    def local_part(self, batch: LMBatch | Seq2SeqBatch) -> LMBatch | Seq2SeqBatch:
        """This rank's part of a batch it takes: all of it, or under cp its zigzag shard of the sequence."""
        return shard_lm_batch(batch, self.rank, self.world_size) if self.strategy == "cp" else batch

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on one (a Ctrl-C or an exhausted time budget stops all together)."""
        if not self.enabled:
            return flag
        tensor = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def from_main(self, value: float) -> float:
        """Rank 0's `value` on every rank (e.g. the dev BLEU only rank 0 computed)."""
        if not self.enabled:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.broadcast(tensor, src=0)
        return tensor.item()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def failure(self, err: BaseException) -> DistributedFailure:
        """The error a rank reports when a collective fails under it."""
        return DistributedFailure(
            f"rank {self.rank} of {self.world_size}: a collective failed ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else 'no message'}). Another rank has "
            f"probably died, hung or been stopped; collectives give up after train.dist_timeout={self.timeout:g} s. "
            f"The checkpoints already written are complete: the same command resumes from the latest one"
        )


COLLECTIVE_ERROR_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer")


def is_collective_failure(err: BaseException) -> bool:
    """Whether `err` came out of a collective (gloo raises plain RuntimeErrors naming its transport)."""
    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(marker in text for marker in COLLECTIVE_ERROR_MARKERS)


def init_distributed(config: TrainConfig, device: torch.device) -> DistContext:
    """Joins the process group torchrun set up (a no-op context when this process trains alone)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(config.context_parallel, world_size)
    if world_size == 1:
        return DistContext(device=device, timeout=config.dist_timeout)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    strategy = "cp" if config.context_parallel > 1 else "ddp" if config.parallel == "auto" else config.parallel
    tp_size = {"ddp": 1, "fsdp": 1, "cp": 1, "tp": world_size, "fsdp+tp": config.tp_size}[strategy]
    if strategy == "fsdp+tp" and not (1 < tp_size < world_size and world_size % tp_size == 0):
        raise ConfigError(
            f"parallel 'fsdp+tp' on {world_size} ranks needs tp_size dividing {world_size}, above 1 and below it "
            f"(got {config.tp_size}); e.g. train.tp_size=2 on 4 ranks, or use 'tp' or 'fsdp' alone"
        )
    dp_size = world_size // tp_size
    if config.grad_accum % dp_size and strategy != "cp":  # cp ranks split every batch, not the step's batches
        raise ConfigError(
            f"grad_accum ({config.grad_accum}) batches per step cannot be split evenly over {dp_size} data-parallel "
            f"ranks; the global batch is grad_accum x max_tokens tokens whatever the number of ranks, so set "
            f"train.grad_accum to a multiple of {dp_size} (and lower max_tokens to keep the same global batch)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=config.dist_timeout))
    mesh = init_device_mesh(device.type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return DistContext(rank, world_size, local_rank, strategy, device, mesh, config.dist_timeout)


def parallelize(model: nn.Module, context: DistContext, config: TrainConfig) -> nn.Module:
    """Shards `model` in place as the strategy says; returns the module to call forward on (DDP wraps it)."""
    if not context.enabled:
        return model
    if context.strategy == "cp":  # dp over tokens: every rank has the model, gradients are all-reduced
        return context_parallel(model, config.objective, context.device, context.local_rank)
    if context.strategy in ("tp", "fsdp+tp"):
        shard_tensor_parallel(model, context.mesh["tp"])
    if context.strategy in ("fsdp", "fsdp+tp"):
        shard_fully(model, context.mesh["dp"], config)
    if context.strategy == "ddp":
        return DistributedDataParallel(
            model, device_ids=[context.local_rank] if context.device.type == "cuda" else None
        )
    return model


def shard_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Column-parallel Q/K/V and up/gate projections, row-parallel output and down projections (Megatron-LM)."""
    size, rank = mesh.size(), mesh.get_local_rank()
    config = model.config
    for name in ("n_heads", "n_kv_heads", "d_ff"):
        if getattr(config, name) % size:
            raise ConfigError(
                f"tensor parallelism over {size} ranks splits model.{name} ({getattr(config, name)}) evenly; "
                f"pick a tp size that divides it"
            )
    for module in model.modules():
        if isinstance(module, Attention):
            plan = {
                "q_proj": ColwiseParallel(),
                "k_proj": ColwiseParallel(),
                "v_proj": ColwiseParallel(),
                "out_proj": RowwiseParallel(),
            }
            parallelize_module(module, mesh, plan)
            local_heads = module.n_heads // size
            module.heads = slice(rank * local_heads, (rank + 1) * local_heads)
        elif isinstance(module, (MLP, GatedMLP)):
            plan = {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            if isinstance(module, GatedMLP):
                plan["gate_proj"] = ColwiseParallel()
            parallelize_module(module, mesh, plan)


def shard_fully(model: nn.Module, mesh: DeviceMesh, config: TrainConfig) -> None:
    """FSDP2 on each block, then on the root (embeddings, final norm, head); ZeRO-3 or ZeRO-2."""
    policy = MixedPrecisionPolicy(
        param_dtype=FSDP_DTYPES[config.fsdp_param_dtype], reduce_dtype=FSDP_DTYPES[config.fsdp_reduce_dtype]
    )
    reshard = config.fsdp_sharding == "full"
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


@contextmanager
def gradient_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """Accumulating micro-batches skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) until the last."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync)
    if isinstance(module, DistributedDataParallel) and not sync:
        with module.no_sync():
            yield
    else:
        yield


def clip_gradients(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Total gradient norm (clipped to `max_norm` when finite), over plain and sharded (DTensor) gradients.

    With no limit (`max_norm` inf: train.clip_grad 0) the norm alone is computed: torch's clip_grad_norm_ would
    still multiply every gradient by its clamped coefficient of 1.0, a pass over all of them (26 MB of fp32
    gradients in the main recipe) for nothing."""
    parameters = [p for p in parameters if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in parameters):
        if not math.isfinite(max_norm):
            return torch.nn.utils.get_total_norm([p.grad for p in parameters])
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    by_mesh: dict[object, list[torch.Tensor]] = {}  # a sharded norm reduces over its own mesh
    for p in parameters:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if math.isfinite(max_norm):
        coefficient = max_norm / (total.item() + 1e-6)
        if coefficient < 1.0:
            for p in parameters:
                p.grad.mul_(coefficient)
    return total


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on rank 0's CPU (empty on the other ranks); a collective every rank must call."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def shutdown() -> None:
    """Leaves the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
