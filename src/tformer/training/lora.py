"""LoRA (Hu et al., 2021): fine-tune a frozen model through low-rank adapters on chosen linear layers.

A targeted `nn.Linear` computing `W x + b` becomes `W x + b + (alpha / rank) * B(A(dropout(x)))`, with A (rank x in)
initialised as PEFT does (Kaiming-uniform, a = sqrt(5)) and B (out x rank) zero, so that training starts from the
base model's outputs. Only A and B train, and only they are saved (safetensors, with the config in JSON beside them).
`merge_lora` folds B A into W, leaving an ordinary model that `save`, the engine and `to_hf` take as it is.

    apply_lora(model, LoRAConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj")))
    ...train...
    save_adapters(model, "out/adapters")           # adapters.safetensors + lora.json
    load_adapters(base_model, "out/adapters")      # applies the saved config when the model has no adapters yet
    merge_lora(base_model).save("out/merged")
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file
from torch import nn

from tformer.errors import CheckpointError, ConfigError
from tformer.models import WEIGHTS_FILE

ADAPTERS_FILE = "adapters.safetensors"
CONFIG_FILE = "lora.json"


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA's options. A target is a module name (q_proj, k_proj, v_proj, out_proj, gate_proj, up_proj, down_proj)
    or a dotted suffix of one (self_attn.q_proj, to leave cross-attention alone); it matches every nn.Linear whose
    full name equals it or ends with '.' + it, as PEFT's target_modules do."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")  # the LoRA paper's choice

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))  # a list from YAML or JSON
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora rank must be a positive integer, got {self.rank!r}; 8 or 16 are usual")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ConfigError(f"lora alpha must be a positive number, got {self.alpha!r}; twice the rank is usual")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora dropout must be in [0, 1), got {self.dropout!r}; 0.0 or 0.05 are usual")
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ConfigError(
                f"lora target_modules must be a non-empty list of module names, got {self.target_modules!r}; "
                "for example [q_proj, v_proj]"
            )

    @property
    def scale(self) -> float:
        """The factor alpha / rank on the adapter's output."""
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, data: dict) -> LoRAConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown lora keys {unknown}; the keys are {sorted(known)}")
        return cls(**data)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update. It keeps the base layer's `weight` and `bias`
    parameters themselves (not copies) under the same names, so the base tensors' state-dict keys do not change."""

    def __init__(self, base: nn.Linear, config: LoRAConfig) -> None:
        super().__init__()
        self.config = config
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, config.rank, bias=False, **factory)
        self.lora_B = nn.Linear(config.rank, base.out_features, bias=False, **factory)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init of A
        nn.init.zeros_(self.lora_B.weight)  # B A = 0: the adapted model starts equal to the base model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.config.scale * self.lora_B(self.lora_A(self.dropout(x)))

    def merged(self) -> nn.Linear:
        """A plain nn.Linear holding W + scale * B A (computed in fp32, or in W's dtype if wider; stored in W's)."""
        with torch.no_grad():
            wide = torch.promote_types(self.weight.dtype, torch.float32)
            delta = self.lora_B.weight.to(wide) @ self.lora_A.weight.to(wide)  # (out, rank) @ (rank, in)
            weight = (self.weight.to(wide) + self.config.scale * delta).to(self.weight.dtype)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=self.weight.requires_grad)
        linear.bias = self.bias
        return linear


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRA layers by full module name (empty for a model without adapters)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Wraps every nn.Linear that `config.target_modules` names in a LoRALinear and freezes every other parameter,
    so that only the adapters train. Changes `model` in place and returns it.

    Raises ConfigError for a target that matches no linear layer (listing those that exist), for a layer whose
    weight is tied to another module (merging would change both), and for a model that already has adapters.
    """
    if lora_layers(model):
        raise ConfigError("this model already has LoRA adapters; merge_lora it first, or load a fresh base model")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unused = [t for t in config.target_modules if not any(_matches(name, (t,)) for name in linears)]
    if unused:
        names = sorted({name.rpartition(".")[2] for name in linears})
        raise ConfigError(f"lora target_modules {unused} match no linear layer; this model's are {names}")
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    targets = {name: m for name, m in linears.items() if _matches(name, config.target_modules)}
    tied = [name for name, m in targets.items() if counts[id(m.weight)] > 1]
    if tied:
        raise ConfigError(f"cannot put LoRA on {tied}: their weight is tied to another module; remove them")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in targets.items():
        _replace(model, name, LoRALinear(linear, config))
    return model


def lora_config(model: nn.Module) -> LoRAConfig:
    """The LoRAConfig that `apply_lora` put on `model`; ConfigError for a model without adapters."""
    layers = lora_layers(model)
    if not layers:
        raise ConfigError("this model has no LoRA adapters; call apply_lora(model, LoRAConfig(...)) first")
    return next(iter(layers.values())).config


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (`<module>.lora_A.weight`, `<module>.lora_B.weight`), by their names in `model`."""
    return {
        f"{name}.{part}.weight": getattr(layer, part).weight.detach()
        for name, layer in lora_layers(model).items()
        for part in ("lora_A", "lora_B")
    }


def save_adapters(model: nn.Module, path: str | Path) -> None:
    """Writes the adapters into directory `path`: adapters.safetensors (only A and B) and lora.json (the config and
    the adapted modules' names). Each file appears atomically."""
    config, path = lora_config(model), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in lora_state_dict(model).items()}
    meta = {**config.to_dict(), "modules": sorted(lora_layers(model))}
    for name, write in (
        (ADAPTERS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"})),
        (CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n")),
    ):
        tmp = path / (name + ".tmp")
        write(tmp)
        os.replace(tmp, path / name)


def read_adapters_config(path: str | Path) -> tuple[LoRAConfig, list[str]]:
    """The LoRAConfig and adapted module names saved in `path`/lora.json; CheckpointError if it is not readable."""
    file = Path(path) / CONFIG_FILE
    try:
        meta = json.loads(file.read_text())
        modules = meta.pop("modules")
        return LoRAConfig.from_dict(meta), modules
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{file}: not a LoRA adapters config written by save_adapters ({err})") from None


def load_adapters(model: nn.Module, path: str | Path) -> nn.Module:
    """Loads adapters saved by `save_adapters` into `model` and returns it. A model without adapters gets the
    saved config applied first; one with adapters must have the same rank, alpha and targets.

    Raises CheckpointError when the saved adapters do not fit this model (other modules or shapes).
    """
    path = Path(path)
    saved, modules = read_adapters_config(path)
    if not lora_layers(model):
        apply_lora(model, saved)
    current = lora_config(model)
    if (current.rank, current.alpha, current.target_modules) != (saved.rank, saved.alpha, saved.target_modules):
        raise CheckpointError(
            f"{path} holds adapters of rank {saved.rank}, alpha {saved.alpha} on {list(saved.target_modules)}, "
            f"but the model's have rank {current.rank}, alpha {current.alpha} on {list(current.target_modules)}; "
            "load them into a model without adapters and the saved config is applied"
        )
    if sorted(lora_layers(model)) != sorted(modules):
        raise CheckpointError(f"{path} adapts modules {modules[:3]}..., which this model does not have all of")
    try:
        state = load_file(str(path / ADAPTERS_FILE))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"{path / ADAPTERS_FILE}: cannot load adapters: {err}") from None
    ours = lora_state_dict(model)
    wrong = sorted(set(ours) ^ set(state)) + [k for k in ours if k in state and state[k].shape != ours[k].shape]
    if wrong:
        raise CheckpointError(f"{path / ADAPTERS_FILE} does not fit this model: missing, unexpected or wrong {wrong}")
    with torch.no_grad():
        for name, tensor in ours.items():
            tensor.copy_(state[name])
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Folds each adapter into its layer (W <- W + scale * B A) and puts a plain nn.Linear back in its place, so the
    model is again the one its config builds (for `save`, the engine and `to_hf`). Returns `model`, changed in place.
    Parameters stay frozen as apply_lora left them; call `requires_grad_(True)` to train the merged model fully."""
    for name, layer in lora_layers(model).items():
        _replace(model, name, layer.merged())
    return model


# ---- in a training run ----------------------------------------------------------------------------------------
# A LoRA run loads its base model as a full fine-tune does (`train.init_from`), wraps the targeted linear layers in
# adapters and freezes everything else, so that the optimizer holds the adapters alone. Its checkpoints hold only
# what changes: adapters.safetensors and lora.json (as `save_adapters` writes them), the tokenizer, and
# trainer_state.pt with the adapters' optimizer state beside the step, cursor and scheduler. No model.safetensors and
# no sharded/ state: the base weights are the `init_from` file, unchanged. To serve, merge a checkpoint into them:
#
#     tformer convert <init_from> --merge-lora runs/x/checkpoints/step-00000100 --out merged/
#
# LoRA trains in one process: under torchrun the trainer consolidates and shards the full model, which a model with
# adapters does not fit, so several processes are refused with a ConfigError rather than left half working.


def with_lora(model: nn.Module, lora: LoRAConfig | None, distributed: bool) -> nn.Module:
    """`model` with a training run's adapters applied (everything else frozen), or `model` as it is without LoRA
    (`lora` None)."""
    if lora is None:
        return model
    if distributed:
        raise ConfigError(
            "LoRA trains in one process only; several processes (torchrun: ddp, FSDP or tensor parallel) are not "
            "supported with a lora: section. Run `tformer train` without torchrun"
        )
    apply_lora(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"LoRA rank {lora.rank} on {len(lora_layers(model))} layers: {trainable:,} trainable of {total:,} parameters")
    return model


def save_weights(model: nn.Module, directory: Path) -> None:
    """The checkpoint's weights: the adapters alone for a model with LoRA layers, else the whole model."""
    if lora_layers(model):
        save_adapters(model, directory)
    else:
        model.save(directory)


def load_weights(model: nn.Module, checkpoint: Path, device: str) -> None:
    """Loads what `save_weights` wrote into `model`: the adapters of a LoRA checkpoint, else the whole weights."""
    if (checkpoint / ADAPTERS_FILE).is_file():
        load_adapters(model, checkpoint)
    else:
        load_model(model, str(checkpoint / WEIGHTS_FILE), device=device)
