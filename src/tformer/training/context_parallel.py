"""Context parallelism: ring attention over torch.distributed, so that one long sequence trains on N ranks.

The sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r (zigzag), so that under a causal mask every
rank does the same amount of work. Each rank keeps its queries; keys and values travel around the ring by
point-to-point sends (the next block is in flight while the current one is computed), and the partial results of
the blocks merge in fp32 through their log-sum-exp (as in flash attention). Backward is a ring too: K and V go round
again, each rank adds its queries' share of dK and dV to an accumulator that travels with them, and after one more
hop every accumulator is back with the rank that owns those keys. Nothing gathers the sequence (Liu et al., Ring
Attention, 2023; zigzag as in zhuzilin/ring-flash-attention). It runs on the CPU with gloo; torch's own is CUDA-only.

Training: `train.context_parallel: N` under `torchrun --nproc-per-node N`. Every rank reads the same batches, takes
its zigzag shard of each sequence (`shard_lm_batch`) and feeds the model its tokens' global positions; the loss is
summed over all ranks' tokens and divided by their global count; gradients are all-reduced (DDP): each has the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from tformer.config import ConfigError, ModelConfig
from tformer.data import IGNORE_INDEX, LMBatch
from tformer.layers.attention import Attention, repeat_kv
from tformer.layers.masks import AttentionMask
from tformer.models.stack import TransformerStack

KV_TAG, GRAD_KV_TAG = 1, 2  # keys/values and their gradients can be in flight between the same two ranks at once
Grads = tuple[Tensor, Tensor, Tensor]  # dq, dk, dv


# ---- the zigzag layout ------------------------------------------------------------------------------------------
def zigzag_indices(seq_len: int, rank: int, world_size: int, device: torch.device | None = None) -> Tensor:
    """The global indices of rank `rank`'s tokens: chunks rank and 2N-1-rank of 2N equal chunks, in that order."""
    n_chunks = 2 * world_size
    if seq_len % n_chunks:
        raise ValueError(f"a zigzag layout over {world_size} ranks needs a length divisible by {n_chunks}: {seq_len}")
    chunk = seq_len // n_chunks
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((n_chunks - 1 - rank) * chunk, (n_chunks - rank) * chunk, device=device)
    return torch.cat([first, last])


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """Rank `rank`'s share of `x` along `dim` (the sequence)."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], rank, world_size, x.device))


def zigzag_unshard(shards: list[Tensor], dim: int = 1) -> Tensor:
    """The whole sequence back from every rank's shard (shards[r] from rank r): the inverse of zigzag_shard."""
    world_size = len(shards)
    seq_len = shards[0].shape[dim] * world_size
    order = torch.cat([zigzag_indices(seq_len, r, world_size, shards[0].device) for r in range(world_size)])
    return torch.cat(shards, dim).index_select(dim, torch.argsort(order))


def block_plan(rank: int, source: int, world_size: int, causal: bool, local_len: int) -> tuple[slice, slice, bool]:
    """Which of our queries see which of `source`'s keys: (query rows, key columns, causal within the block).

    Under the zigzag layout a block is never partly masked except on the diagonal: the keys of an earlier rank's
    first chunk precede both our chunks, and both chunks of a later rank precede our second chunk only.
    """
    everything = slice(None)
    if not causal:
        return everything, everything, False
    half = local_len // 2
    if source == rank:
        return everything, everything, True  # our own chunks are in global order: plain causal attention
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


# ---- block kernels: (out, lse) of one block, and its gradients given the merged out and lse -----------------------
class MathBlock:
    """softmax(q k^T / sqrt(d)) v written out in fp32: the reference, and the kernel on devices other than the CPU."""

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool) -> Tensor:
        scores = q.float() @ k.float().transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, tq, tk)
        if causal:
            future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return scores

    @classmethod
    def forward(cls, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, ...]:
        scores = cls._scores(q, k, causal)
        lse = scores.logsumexp(-1)  # (B, H, tq)
        return torch.exp(scores - lse[..., None]) @ v.float(), lse

    @classmethod
    def backward(
        cls, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool
    ) -> Grads:
        probs = torch.exp(cls._scores(q, k, causal) - lse[..., None])  # this block's share of the full softmax
        grad_out = grad_out.float()
        grad_v = probs.transpose(-2, -1) @ grad_out
        delta = (grad_out * out.float()).sum(-1, keepdim=True)  # (B, H, tq, 1)
        grad_scores = probs * (grad_out @ v.float().transpose(-2, -1) - delta) * q.shape[-1] ** -0.5
        return grad_scores @ k.float(), grad_scores.transpose(-2, -1) @ q.float(), grad_v


class FlashCpuBlock:
    """torch's CPU flash-attention kernel, which also returns the log-sum-exp: no (tq, tk) matrix is kept."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, ...]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)

    @staticmethod
    def backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool) -> Grads:
        grad_out, out = grad_out.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q.contiguous(), k, v, out, lse.contiguous(), 0.0, causal
        )


BlockKernel = type[MathBlock] | type[FlashCpuBlock]
BLOCK_KERNELS: dict[str, BlockKernel] = {"math": MathBlock, "flash": FlashCpuBlock}


def default_kernel(device: torch.device) -> str:
    return "flash" if device.type == "cpu" else "math"


# ---- the ring --------------------------------------------------------------------------------------------------
@dataclass
class Transfer:
    """A send to the next rank and a receive from the previous one, in flight."""

    requests: list
    sent: Tensor  # kept alive until the send completes
    received: Tensor

    def wait(self) -> Tensor:
        for request in self.requests:
            request.wait()
        return self.received


class Ring:
    """The ranks of `group` in a ring: rank r sends to r+1 and receives from r-1."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group or dist.group.WORLD
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        """Whose keys and values this rank holds at `step`."""
        return (self.rank - step) % self.size

    def pass_on(self, tensor: Tensor, tag: int) -> Transfer:
        """Sends `tensor` to the next rank and receives the previous rank's, without waiting."""
        if self.size == 1:
            return Transfer([], tensor, tensor)
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        send = dist.isend(tensor, self.next, group=self.group, tag=tag)
        receive = dist.irecv(received, self.prev, group=self.group, tag=tag)
        return Transfer([send, receive], tensor, received)


def _sum_groups(grad: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv * n_rep, T, D) -> (B, Hkv, T, D): a KV head's gradient sums over the query heads it served."""
    B, H, T, D = grad.shape
    return grad.float().view(B, H // n_rep, n_rep, T, D).sum(2)


def _merge(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor, rows: slice
) -> tuple[Tensor, Tensor]:
    """Folds one block's (out, lse) into the running ones for query `rows`, in fp32."""
    block_out, block_lse = block_out.float(), block_lse.float()
    if out is None:  # the first block (our own keys) covers every row
        return block_out.clone(), block_lse.clone()
    new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
    out[:, :, rows] = (
        out[:, :, rows] * torch.exp(lse[:, :, rows] - new_lse)[..., None]
        + block_out * torch.exp(block_lse - new_lse)[..., None]
    )
    lse[:, :, rows] = new_lse
    return out, lse


def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, ring: Ring, kernel: BlockKernel
) -> tuple[Tensor, Tensor]:
    n_rep, kv = q.shape[1] // k.shape[1], torch.stack([k, v])  # one message a step: (2, B, Hkv, T, D)
    out = lse = None
    for step in range(ring.size):
        incoming = ring.pass_on(kv, KV_TAG) if step + 1 < ring.size else None
        rows, cols, diagonal = block_plan(ring.rank, ring.source(step), ring.size, causal, q.shape[2])
        k_block, v_block = (repeat_kv(t[:, :, cols], n_rep) for t in kv)
        block_out, block_lse = kernel.forward(q[:, :, rows], k_block, v_block, diagonal)
        out, lse = _merge(out, lse, block_out, block_lse, rows)
        if incoming is not None:
            kv = incoming.wait()
    return out, lse


def _ring_backward(grad_out: Tensor, saved: tuple[Tensor, ...], causal: bool, ring: Ring, kernel: BlockKernel) -> Grads:
    q, k, v, out, lse = saved
    n_rep, kv = q.shape[1] // k.shape[1], torch.stack([k, v])
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    outgoing = None  # the gradient accumulator of the keys we hold, travelling with them
    for step in range(ring.size):
        incoming = ring.pass_on(kv, KV_TAG) if step + 1 < ring.size else None
        rows, cols, diagonal = block_plan(ring.rank, ring.source(step), ring.size, causal, q.shape[2])
        k_block, v_block = (repeat_kv(t[:, :, cols], n_rep) for t in kv)
        grads = kernel.backward(
            grad_out[:, :, rows], q[:, :, rows], k_block, v_block, out[:, :, rows], lse[:, :, rows], diagonal
        )
        grad_q[:, :, rows] += grads[0].float()
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device) if outgoing is None else outgoing.wait()
        grad_kv[0][:, :, cols] += _sum_groups(grads[1], n_rep)
        grad_kv[1][:, :, cols] += _sum_groups(grads[2], n_rep)
        outgoing = ring.pass_on(grad_kv, GRAD_KV_TAG)
        if incoming is not None:
            kv = incoming.wait()
    grad_kv = outgoing.wait()  # one more hop brings each accumulator home
    return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys and values, with a ring forward and backward."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, group: dist.ProcessGroup | None, kernel_name: str
    ) -> Tensor:
        ring, kernel = Ring(group), BLOCK_KERNELS[kernel_name]
        with torch.autocast(q.device.type, enabled=False):  # the merge stays in fp32 whatever autocast says
            out, lse = _ring_forward(q, k, v, causal, ring, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.ring, ctx.kernel = causal, ring, kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        with torch.autocast(grad_out.device.type, enabled=False):
            grads = _ring_backward(grad_out, ctx.saved_tensors, ctx.causal, ctx.ring, ctx.kernel)
        return *grads, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    group: dist.ProcessGroup | None = None,
    kernel: str | None = None,
) -> Tensor:
    """softmax(Q K^T / sqrt(d)) V over a zigzag-sharded sequence: q (B, H, T/N, D), k and v (B, Hkv, T/N, D).

    Every rank of `group` calls it with its own shard; the result is this rank's rows of full attention. Under
    autocast q, k and v run in its dtype, as SDPA does; blocks merge in fp32 in any case.
    """
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return RingAttention.apply(q, k, v, causal, group, kernel or default_kernel(q.device))


# ---- making a model use it -------------------------------------------------------------------------------------
class RingAttend:
    """Stands in for `Attention.attend` on one self-attention layer whose inputs are zigzag shards."""

    def __init__(self, causal: bool, group: dist.ProcessGroup | None, kernel: str | None = None) -> None:
        self.causal, self.group, self.kernel = causal, group, kernel

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float) -> tuple[Tensor, None]:
        if dropout_p:
            raise ConfigError("ring attention has no attention dropout; set model.attn_dropout=0")
        if mask.bias is not None or mask.key_padding is not None:
            raise ValueError(
                "ring attention follows the zigzag layout, not a mask: call the model with positions and no "
                "attention_mask (padding goes at the end of each row, where causal attention never reads it)"
            )
        return ring_attention(q, k, v, self.causal, self.group, self.kernel), None


def self_attentions(model: nn.Module) -> list[tuple[Attention, bool]]:
    """Every self-attention layer of `model`, with whether its stack is causal."""
    return [
        (layer.self_attn, stack.causal)
        for stack in model.modules()
        if isinstance(stack, TransformerStack)
        for layer in stack.layers
    ]


def enable_ring_attention(model: nn.Module, group: dist.ProcessGroup | None = None, kernel: str | None = None) -> None:
    """Makes every self-attention layer of `model` attend by ring over `group` (an instance attribute)."""
    for attention, causal in self_attentions(model):
        attention.attend = RingAttend(causal, group, kernel)


def disable_ring_attention(model: nn.Module) -> None:
    """Gives every self-attention layer its own kernel back."""
    for attention, _ in self_attentions(model):
        attention.__dict__.pop("attend", None)


@contextmanager
def ring_attention_on(
    model: nn.Module, group: dist.ProcessGroup | None = None, kernel: str | None = None
) -> Iterator[nn.Module]:
    """`model` with ring attention inside the block; its own kernels again after it."""
    enable_ring_attention(model, group, kernel)
    try:
        yield model
    finally:
        disable_ring_attention(model)


# ---- training: train.context_parallel ---------------------------------------------------------------------------
def check_context_parallel(model: ModelConfig, objective: str, ranks: int) -> None:
    """Raises ConfigError when ring attention over `ranks` cannot train `model` exactly (the first problem)."""
    problems = [
        (objective != "clm", f"it trains causal language models (train.objective: clm), not '{objective}'"),
        (model.position in ("alibi", "t5"), "ALiBi's and T5's biases need all query-key distances; use rope"),
        (not model.scale_attention, "ring attention scales scores by 1/sqrt(head_dim); set scale_attention: true"),
        (model.sliding_window is not None, "a sliding window is not supported; remove model.sliding_window"),
        (model.attn_logit_softcap is not None, "capped scores (Gemma 2) are not supported; remove attn_logit_softcap"),
        (
            model.attention_scale_dim is not None,
            "ring attention scales scores by 1/sqrt(head_dim); remove model.attention_scale_dim",
        ),
        (model.attention != "softmax", f"attention '{model.attention}' has its own kernel; use attention: softmax"),
        (model.attn_dropout > 0, "ring attention has no attention dropout; set model.attn_dropout=0"),
    ]  # fmt: skip
    for failed, why in problems:
        if failed:
            raise ConfigError(f"train.context_parallel={ranks}: {why}")


def check_world_size(ranks: int, world_size: int) -> None:
    """Context parallelism splits each sequence over exactly `ranks` processes, all of them."""
    if ranks > 1 and world_size != ranks:
        raise ConfigError(
            f"train.context_parallel={ranks} splits each sequence over {ranks} processes, but {world_size} "
            f"started; launch it with `torchrun --nproc-per-node {ranks} -m tformer train ...`"
        )


def shard_lm_batch(batch: LMBatch, rank: int, world_size: int) -> LMBatch:
    """Rank `rank`'s zigzag shard of a right-padded LM batch, padded first to a multiple of 2 x world_size.

    The padding goes at the end of each row: causal attention never lets a real token read it, and its labels
    are ignored, so the loss and gradients are those of the unsharded batch.
    """
    if batch.prefix_len is not None:
        raise ConfigError("context parallelism trains causal LMs; a prefix LM's batch cannot be sharded")
    mask = batch.attention_mask
    if (mask[:, 1:] > mask[:, :-1]).any():
        raise ValueError("context parallelism needs right-padded batches (padding after each row's tokens)")
    pad = -batch.input_ids.shape[1] % (2 * world_size)
    parts = (
        F.pad(batch.input_ids, (0, pad), value=0),
        F.pad(mask, (0, pad), value=0),
        F.pad(batch.labels, (0, pad), value=IGNORE_INDEX),
    )
    return LMBatch(*(zigzag_shard(t, rank, world_size) for t in parts))


class ContextParallel(DistributedDataParallel):
    """DDP over ranks that each hold a zigzag shard of every sequence, with ring attention inside the model.

    forward(input_ids, attention_mask) takes this rank's shard (from `shard_lm_batch`) and gives the model the
    tokens' global positions (0 on padding, so learned positions never index past the real length).
    DDP averages gradients: the trainer scales each rank's loss by the number of ranks to make that a sum.
    """

    def __init__(self, model: nn.Module, ring_group: dist.ProcessGroup, **ddp_options: object) -> None:
        super().__init__(model, **ddp_options)
        enable_ring_attention(model, ring_group)
        self.ring_rank, self.ring_size = dist.get_rank(ring_group), dist.get_world_size(ring_group)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        seq_len = input_ids.shape[1] * self.ring_size
        positions = zigzag_indices(seq_len, self.ring_rank, self.ring_size, input_ids.device)[None]  # (1, T/N)
        positions = positions.expand_as(input_ids) if attention_mask is None else positions * attention_mask
        return super().forward(input_ids, positions=positions)


def context_parallel(model: nn.Module, objective: str, device: torch.device, local_rank: int) -> ContextParallel:
    """`model` replicated on every rank, its attention a ring over all of them (its own gloo/NCCL group, so that
    the ring's sends never interleave with DDP's gradient all-reduces)."""
    world_size = dist.get_world_size()
    check_context_parallel(model.config, objective, world_size)
    ring_group = dist.new_group(list(range(world_size)))
    device_ids = [local_rank] if device.type == "cuda" else None
    return ContextParallel(model, ring_group, device_ids=device_ids)
