"""How a training step computes: fp32, bf16 autocast (`train.bf16`), a bf16 copy of the model with fp32
master weights (`train.bf16_weights`), or fp16 autocast with dynamic loss scaling (`train.precision: fp16`).

Under autocast every matmul casts its fp32 weight and its fp32 input to bf16 on each use, forward and backward,
and the residual stream stays fp32. With bf16 weights the training forward and backward run on a bf16 copy of
the model, so no cast is left inside the step: activations, the residual stream and gradients are bf16. The fp32
model stays the one the optimizer, checkpoints and evaluation see (the master weights of mixed-precision
training, Micikevicius et al., 2018): after backward its gradients are the bf16 gradients in fp32, and after the
optimizer step the bf16 copy takes the new weights, rounded. Measured on the main recipe's step in
docs/en-de-10min.md (its "Speed levers" section).
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from tformer.config import ConfigError
from tformer.training.config import TrainConfig
from tformer.training.distributed import DistContext


class BF16Weights:
    """A bf16 copy of `master` (parameters and floating buffers) that trains in its place."""

    def __init__(self, master: nn.Module) -> None:
        self.master = master
        self.compute = copy.deepcopy(master).to(torch.bfloat16)  # deepcopy keeps tied weights tied
        pairs = [(m, c) for m, c in zip(master.parameters(), self.compute.parameters(), strict=True) if m.requires_grad]
        self.master_params = [m for m, _ in pairs]
        self.compute_params = [c for _, c in pairs]
        self.master_grads = [torch.empty_like(m) for m in self.master_params]  # reused every step

    def grads_to_master(self) -> None:
        """The bf16 gradients of the last backward, as fp32 gradients of the master weights (None where the
        bf16 copy got none). The bf16 gradients are then dropped."""
        pairs = [
            (m, g, c)
            for m, g, c in zip(self.master_params, self.master_grads, self.compute_params, strict=True)
            if c.grad is not None
        ]
        if pairs:
            torch._foreach_copy_([g for _, g, _ in pairs], [c.grad for _, _, c in pairs])
        for master, grad, _ in pairs:
            master.grad = grad
        for compute in self.compute_params:
            compute.grad = None

    def weights_from_master(self) -> None:
        """The bf16 copy takes the master weights (after an optimizer step, or after loading them)."""
        with torch.no_grad():
            torch._foreach_copy_(self.compute_params, self.master_params)


class TrainingPrecision:
    """The trainer's precision: which module the training forward runs on, under which context, and the two
    hooks of master weights (after backward, after the optimizer step), which do nothing without them.

    `model` is the fp32 model the optimizer steps; `module` is what forward runs on otherwise (DDP's wrapper).
    """

    def __init__(self, config: TrainConfig, model: nn.Module, module: nn.Module, dist: DistContext) -> None:
        bf16_weights = config.bf16_weights
        if bf16_weights and dist.enabled:
            raise ConfigError(
                "train.bf16_weights trains a bf16 copy of the model in one process; with several processes "
                "(torchrun) use train.bf16 (autocast) alone, or FSDP's train.fsdp_param_dtype: bfloat16"
            )
        self.weights = BF16Weights(model) if bf16_weights else None
        self.module = self.weights.compute if self.weights else module  # what the training forward runs on
        self.model = self.weights.compute if self.weights else model  # the unwrapped module, for diagnosis
        self.device_type = dist.device.type
        self.use_autocast = (config.bf16 or config.precision == "bf16") and not bf16_weights
        self.fp16 = config.precision == "fp16"
        # fp16's 5 exponent bits lose gradients below 6e-8 (to zero) and above 65504 (to inf): the loss is
        # multiplied by a scale before backward, the gradients divided by it after; a step whose gradients
        # overflowed is skipped and the scale halved, and after growth_interval clean steps it doubles
        # (Micikevicius et al., 2018)
        enabled = self.fp16 and config.fp16_loss_scaling
        self.scaler = torch.amp.GradScaler(self.device_type, config.fp16_initial_scale) if enabled else None
        self.skipped_steps = 0
        self.last_step_skipped = False

    def autocast(self) -> AbstractContextManager:
        """bf16 autocast under `train.bf16` alone, fp16 autocast under precision fp16; nothing otherwise (fp32,
        or a model already in bf16)."""
        if self.fp16:
            return torch.autocast(self.device_type, torch.float16)
        return torch.autocast(self.device_type, torch.bfloat16) if self.use_autocast else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), of the scaled loss under fp16 loss scaling."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16 loss scaling: the gradients divided by the scale (before clipping), and any inf or NaN noted."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def skips(self, finite: bool) -> bool:
        """Whether this step is skipped: under loss scaling, when its gradients (or loss) are not all finite."""
        return self.scaler is not None and not finite

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(); under loss scaling the scaler's step (which skips an overflowed step) and update."""
        if self.scaler is None:
            optimizer.step()
            return
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self.last_step_skipped = self.scaler.get_scale() < scale
        self.skipped_steps += self.last_step_skipped

    def state_dict(self) -> dict:
        """What a checkpoint keeps so that a resumed run scales as an uninterrupted one: under fp16 loss scaling,
        the scaler's state (the scale and its growth tracker, the clean steps since it last changed) and the
        steps skipped so far; nothing otherwise."""
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict`'s state; an empty one (a run without loss scaling) leaves the initial state."""
        if self.scaler is None or not state:
            return
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state["skipped_steps"]

    def metrics(self) -> dict:
        """The loss scale and the steps skipped so far, under fp16 loss scaling; nothing otherwise."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.get_scale(), "skipped_steps": self.skipped_steps}

    def after_backward(self) -> None:
        if self.weights is not None:
            self.weights.grads_to_master()

    def after_step(self) -> None:
        if self.weights is not None:
            self.weights.weights_from_master()
