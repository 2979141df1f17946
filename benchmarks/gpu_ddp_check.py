"""Two processes training a tiny tformer decoder with DDP, against one process on the whole batch: the losses of
every step must agree (DDP averages the ranks' gradients, and each rank holds half of the batch's tokens).

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_ddp_check.py --device cuda   # NCCL, a GPU a rank
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_ddp_check.py --device cpu    # gloo (a smoke test)

The backend is NCCL where every rank has a GPU of its own. NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), so on a machine with a single GPU both ranks share it through gloo (CUDA tensors), and the report says
that NCCL was not run and why. Rank 0 prints one line: the backend, the devices, the losses and the largest
difference from the one-process run, then PASS or FAIL (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tformer import ModelConfig, build_model

TOLERANCE = 1e-4  # fp32 losses: the two runs differ only in the order of the gradient sums


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the global batch (split over the ranks)")
    parser.add_argument("--seq", type=int, default=32)
    return parser.parse_args()


def tiny_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny-llama", dropout=0.0, attn_dropout=0.0)
    return build_model(config).to(device).train()


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1], torch.ones_like(ids[:, :-1]))  # (B, T - 1, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def train(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in batches:
        optimizer.zero_grad()
        loss = loss_of(model, ids)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    args = parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if args.device.startswith("cuda") and gpus == 0:
        print("ddp: SKIP no CUDA GPU here (use --device cpu for the gloo smoke test)")
        return 0
    own_gpu = gpus >= world
    backend = "nccl" if own_gpu and gpus else "gloo"
    device = torch.device("cuda", rank if own_gpu else 0) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    generator = torch.Generator().manual_seed(1)
    vocab = tiny_model(torch.device("cpu")).config.vocab_size
    two = [torch.randint(3, vocab, (args.batch, args.seq + 1), generator=generator) for _ in range(2)]
    batches = [two[step % 2] for step in range(args.steps)]  # seen again and again, so that the loss falls
    share = args.batch // world
    mine = [b[rank * share : (rank + 1) * share].to(device) for b in batches]
    model = DistributedDataParallel(tiny_model(device), device_ids=[device.index] if gpus else None)
    ddp_losses = train(model, mine)
    averaged = torch.tensor(ddp_losses, device=device)
    dist.all_reduce(averaged)  # each rank's loss is its half's mean: the batch's mean is their average
    averaged = (averaged / world).tolist()
    code = 0
    if rank == 0:
        alone = train(tiny_model(device), [b.to(device) for b in batches])
        worst = max(abs(a - b) for a, b in zip(averaged, alone, strict=True))
        code = 0 if worst <= TOLERANCE else 1
        where = ", ".join(sorted({f"cuda:{r if own_gpu else 0}" for r in range(world)})) if gpus else "cpu"
        note = "" if backend == "nccl" or not gpus else f"; NCCL not run: {gpus} GPU(s) for {world} ranks"
        print(
            f"ddp: {'PASS' if code == 0 else 'FAIL'} {world} ranks, {backend} on {where}{note}; {args.steps} steps, "
            f"loss {averaged[0]:.4f} -> {averaged[-1]:.4f}; max |ddp - one process| {worst:.1e} (<= {TOLERANCE:g})"
        )
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
