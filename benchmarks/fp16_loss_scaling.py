"""fp16 with and without dynamic loss scaling, against bf16 and fp32 (seed §4.2 / §11.1; docs/fp16.md).

    .venv/bin/python benchmarks/fp16_loss_scaling.py   # 4 runs; benchmarks/results/fp16.json, docs/fp16.png
    .venv/bin/python benchmarks/fp16_loss_scaling.py --overflow   # 2 runs; benchmarks/results/fp16_overflow.json

--overflow provokes real overflows: a loss scale of 2^32 makes the scaled gradients exceed fp16's largest value
(65504) in backward. With dynamic scaling the scaler skips those steps and halves the scale until it fits; with
the same fixed scale and no skipping (what loss scaling without overflow checks does) the inf gradients reach
the optimizer and the weights become NaN.

A small decoder LM (d_model 64, 2 layers, vocabulary 2048, no dropout) on the World English Bible's training
books packed into lines of 64 positions, BATCH lines a step, AdamW at a constant LR, the same seed and batches in
every mode; the loss is the mean over the step's tokens, as the trainer's. Modes go through tformer's
TrainingPrecision (train.precision). Each step records the loss, the share of the logits' gradient entries that
are exactly zero (a token-mean loss puts about p / n_tokens there: fp16's smallest subnormal is 6e-8), and the
share of parameter-gradient entries that are exactly zero, where fp32 has none.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tformer import ModelConfig, build_model
from tformer.data import Tokenizer, bible_text
from tformer.training.config import TrainConfig
from tformer.training.extrapolation import pack_lines
from tformer.training.precision import TrainingPrecision

VOCAB, LENGTH, BATCH, STEPS, LR = 2048, 64, 64, 60, 3e-3
MODES = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16, no loss scaling": {"precision": "fp16", "fp16_loss_scaling": False},
    "fp16, loss scaling": {"precision": "fp16"},
}
OVERFLOW_SCALE = 2.0**32
OVERFLOW_MODES = {
    "fp16, dynamic scaling from 2^32": {"precision": "fp16", "fp16_initial_scale": OVERFLOW_SCALE},
    "fp16, fixed scale 2^32, no skipping": {"precision": "fp16", "fp16_loss_scaling": False},
}


class FixedScale:
    """Loss scaling without overflow checks: the loss times a fixed scale, the gradients divided by it, and every
    step taken, inf or not."""

    def __init__(self, precision: TrainingPrecision, scale: float) -> None:
        self.precision, self.scale, self.skipped_steps = precision, scale, 0

    def autocast(self):  # noqa: ANN201
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scale).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.scale)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def metrics(self) -> dict:
        return {"loss_scale": self.scale}


def run(mode: dict, lines: torch.Tensor, fixed_scale: float | None = None) -> dict:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny-llama", vocab_size=VOCAB, dropout=0.0, attn_dropout=0.0, max_seq_len=LENGTH)
    model = build_model(config).train()
    precision = TrainingPrecision(
        TrainConfig(**mode), model, model, SimpleNamespace(enabled=False, device=torch.device("cpu"))
    )
    if fixed_scale is not None:
        precision = FixedScale(precision, fixed_scale)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    record = {"loss": [], "zero_logit_grads": [], "zero_param_grads": [], "loss_scale": [], "inf_grads": []}
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = lines[torch.randint(len(lines), (BATCH,), generator=generator)]
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            logits = model(ids[:, :-1])
        logits.retain_grad()
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        precision.backward(loss)
        precision.unscale(optimizer)
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        record["zero_logit_grads"].append(float((logits.grad == 0).float().mean()))
        record["zero_param_grads"].append(float((grads == 0).float().mean()))
        record["inf_grads"].append(float((~torch.isfinite(grads)).float().mean()))
        precision.step(optimizer)
        record["loss"].append(loss.item())
        record["loss_scale"].append(precision.metrics().get("loss_scale"))
    record["skipped_steps"] = precision.skipped_steps
    return record


def main() -> None:
    overflow = "--overflow" in sys.argv[1:]
    torch.set_num_threads(1)
    train = bible_text("train")
    tokenizer = Tokenizer.train(train[:8000], VOCAB)
    ids = tokenizer.encode_batch(pack_lines(tokenizer, train[:8000], LENGTH - 1), add_bos=True)
    lines = torch.stack([torch.tensor(x) for x in ids if len(x) == LENGTH])
    results = {}
    for name, mode in (OVERFLOW_MODES if overflow else MODES).items():
        started = time.perf_counter()
        results[name] = run(mode, lines, OVERFLOW_SCALE if "fixed scale" in name else None)
        r = results[name]
        print(
            f"{name}: loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}, zero logit grads "
            f"{max(r['zero_logit_grads']):.2%} max, zero param grads {max(r['zero_param_grads']):.2%} max, "
            f"skipped {r['skipped_steps']}, {time.perf_counter() - started:.0f} s"
        )
        if overflow:
            firsts = ", ".join(
                f"({loss:.3f}, {scale:g}, {inf:.1%})"
                for loss, scale, inf in list(zip(r["loss"], r["loss_scale"], r["inf_grads"], strict=True))[:20]
            )
            print(f"  first 20 steps (loss, scale, share of gradient entries inf or NaN): {firsts}")
    if overflow:
        Path("benchmarks/results/fp16_overflow.json").write_text(json.dumps(results))
        return
    Path("benchmarks/results/fp16.json").write_text(json.dumps(results))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, r in results.items():
        left.plot(r["loss"], label=name)
        right.plot([100 * x for x in r["zero_logit_grads"]], label=name)
    left.set(xlabel="step", ylabel="training loss", title="loss")
    right.set(xlabel="step", ylabel="% of logit gradients exactly 0", title="underflow")
    left.legend()
    figure.tight_layout()
    figure.savefig("docs/fp16.png", dpi=100)


if __name__ == "__main__":
    main()
