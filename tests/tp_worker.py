"""Run by tests/test_distributed.py under torchrun (2 ranks): tensor-parallel logits and gradients against the
unsharded model, for each family and the attention and FFN variants that TP touches.

Every rank builds the same model from the same seed, keeps an unsharded copy as the reference, shards the
other with `shard_tensor_parallel` and runs the same batch through both in fp32. Rank 0 writes the largest
differences to the JSON file named on the command line.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tformer.config import ModelConfig
from tformer.data import Seq2SeqBatch
from tformer.models import build_model
from tformer.training.distributed import shard_tensor_parallel
from tformer.training.losses import label_smoothed_cross_entropy

NO_DROPOUT = {"dropout": 0.0, "attn_dropout": 0.0}
CASES = {  # name -> (preset, overrides)
    "encoder-decoder (post-norm, sinusoidal, ReLU, cross-attention)": ("tiny-transformer", {}),
    "gpt2 (pre-norm, learned positions, GELU)": ("tiny-gpt2", {}),
    "llama (GQA 4/2, RoPE, SwiGLU, RMSNorm)": ("tiny-llama", {}),
    "decoder with ALiBi (per-head bias)": ("tiny-gpt2", {"position": "alibi"}),
    "bert (encoder, MLM head)": ("tiny-bert", {}),
}


def batch_for(config: ModelConfig, generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    """Model inputs with right padding in the second row, and the labels the loss reads."""
    ids = torch.randint(5, config.vocab_size, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    if config.family == "encoder-decoder":
        batch = Seq2SeqBatch(ids, mask, ids[:, :10], ids[:, 1:11], mask[:, :10])
        return {
            "src": batch.src,
            "tgt": batch.tgt_in,
            "src_mask": batch.src_mask,
            "tgt_mask": batch.tgt_mask,
        }, batch.labels
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def compare(preset: str, overrides: dict, mesh) -> dict[str, float]:
    config = ModelConfig.from_dict({"preset": preset, **overrides, **NO_DROPOUT})
    torch.manual_seed(0)
    reference = build_model(config).train()
    sharded = copy.deepcopy(reference)
    shard_tensor_parallel(sharded, mesh)
    inputs, labels = batch_for(config, torch.Generator().manual_seed(1))
    results = {}
    logits = {}
    for name, model in (("reference", reference), ("sharded", sharded)):
        out = model(*inputs.values())
        loss, _ = label_smoothed_cross_entropy(out, labels, 0.1)
        loss.backward()
        logits[name] = out.detach()
    results["logits"] = (logits["reference"] - logits["sharded"]).abs().max().item()
    grads = dict(reference.named_parameters())
    results["gradients"] = max(
        (grads[name].grad - full(param.grad)).abs().max().item() for name, param in sharded.named_parameters()
    )
    results["sharded_parameters"] = sum(isinstance(p, DTensor) for p in sharded.parameters())
    return results


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    report = {name: compare(preset, overrides, mesh) for name, (preset, overrides) in CASES.items()}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # As `tformer` does for a multi-process run (cli.main): leave without interpreter teardown, where gloo's
    # threads sometimes abort a finished rank ("terminate called without an active exception", exit -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
