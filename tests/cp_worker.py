"""Run by tests/test_context_parallel.py under torchrun (4 ranks): ring attention against full attention.

Each case runs on a ring of 2 ranks (a subgroup of ranks 0 and 1) and on the ring of all 4. Every rank draws the
same full-length inputs from one seed, computes the reference on the whole sequence in one process's way (torch's
SDPA, or the unsharded model), then runs ring attention on its zigzag shard. The shards of the output and of the
gradients are gathered and put back in order; rank 0 writes the largest differences to the JSON file named on the
command line.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tformer.config import ModelConfig
from tformer.models import build_model
from tformer.training.context_parallel import ring_attention, ring_attention_on, zigzag_shard, zigzag_unshard

SEQ_LEN = 24  # 3 tokens a chunk on 4 ranks (8 chunks), 6 on 2
KERNEL_CASES = {  # name -> (query heads, KV heads, causal)
    "causal": (4, 4, True),
    "full": (4, 4, False),
    "causal GQA 4/2": (4, 2, True),
    "full MQA 4/1": (4, 1, False),
}
MODEL_CASES = {  # name -> (preset, overrides)
    "llama (RoPE, GQA 4/2)": ("tiny-llama", {}),
    "gpt2 (learned positions)": ("tiny-gpt2", {}),
    "sinusoidal decoder": ("tiny-gpt2", {"position": "sinusoidal"}),
}


def gather(shard: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence from every rank's zigzag shard along `dim`."""
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return zigzag_unshard(shards, dim)


def largest(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def compare_kernel(heads: int, kv_heads: int, causal: bool, kernel: str, group: dist.ProcessGroup) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, SEQ_LEN, 8, generator=generator, requires_grad=True)
    k = torch.randn(2, kv_heads, SEQ_LEN, 8, generator=generator, requires_grad=True)
    v = torch.randn(2, kv_heads, SEQ_LEN, 8, generator=generator, requires_grad=True)
    grad_out = torch.randn(2, heads, SEQ_LEN, 8, generator=generator)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    expected.backward(grad_out)
    shards = [zigzag_shard(t.detach(), rank, world, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*shards, causal=causal, group=group, kernel=kernel)
    out.backward(zigzag_shard(grad_out, rank, world, dim=2))
    result = {"out": largest(gather(out.detach(), 2, group), expected)}
    for name, full, shard in zip("qkv", (q, k, v), shards, strict=True):
        result[f"grad_{name}"] = largest(gather(shard.grad, 2, group), full.grad)
    return result


def compare_model(preset: str, overrides: dict, group: dist.ProcessGroup) -> dict[str, float]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    config = ModelConfig.from_dict({"preset": preset, "dropout": 0.0, "attn_dropout": 0.0, **overrides})
    torch.manual_seed(0)
    model = build_model(config)
    ids = torch.randint(5, config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    expected = model(ids)
    expected.square().sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    positions = zigzag_shard(torch.arange(SEQ_LEN)[None].expand(2, -1), rank, world)
    with ring_attention_on(model, group):
        logits = model(zigzag_shard(ids, rank, world), positions=positions)
    logits.square().sum().backward()
    gradient_error = 0.0
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)  # each rank holds its tokens' share of the gradient
        gradient_error = max(gradient_error, largest(p.grad, expected_grads[name]))
    scale = max(g.abs().max().item() for g in expected_grads.values())
    return {
        "logits": largest(gather(logits.detach(), 1, group), expected.detach()),
        "gradients (relative to the largest)": gradient_error / scale,
    }


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rings = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    report = {}
    for size, group in rings.items():
        if dist.get_rank() >= size:
            continue
        for name, case in KERNEL_CASES.items():
            for kernel in ("flash", "math"):
                report[f"{size} ranks, {name}, {kernel} kernel"] = compare_kernel(*case, kernel, group)
        for name, case in MODEL_CASES.items():
            report[f"{size} ranks, {name}"] = compare_model(*case, group)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()  # leave without interpreter teardown, as tp_worker.py does (gloo's threads)
    sys.stderr.flush()
    os._exit(0)
