"""Weight initialization, following each family's own paper or reference code.

- xavier (the 2017 paper, as in fairseq / tensor2tensor): Xavier-uniform linears, embeddings N(0, d^-0.5).
- normal (BERT, LLaMA): every linear and embedding N(0, init_std).
- gpt2: as normal, with residual output projections scaled by 1/sqrt(2 * n_layers) (GPT-2 paper, sec. 2.3).
DeepNorm models then re-initialise their value, output and FFN projections Xavier-normal with gain beta.
"""

from __future__ import annotations

import math

from torch import nn

from tformer.config import ModelConfig
from tformer.layers import RMSNorm
from tformer.models.stack import TransformerStack


def _reset_norms(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def _init_xavier(model: nn.Module, config: ModelConfig) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    # embeddings last: a tied output projection shares their weight and must not overwrite its init
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=config.d_model**-0.5)


def _init_normal(model: nn.Module, config: ModelConfig) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=config.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def _init_gpt2(model: nn.Module, config: ModelConfig) -> None:
    _init_normal(model, config)
    for stack in _stacks(model):
        residual_std = config.init_std / math.sqrt(2 * len(stack.layers))
        for layer in stack.layers:
            for proj in (layer.self_attn.out_proj, layer.ffn.down_proj):
                nn.init.normal_(proj.weight, std=residual_std)


def _init_deepnorm(model: nn.Module, config: ModelConfig) -> None:
    """DeepNet (Wang et al., 2022): Xavier-normal, gain beta for v/out/FFN projections and 1 for q/k."""
    for stack in _stacks(model):
        beta = config.deepnorm_coefficients("decoder" if stack.causal else "encoder")[1]
        for layer in stack.layers:
            for attn in filter(None, (layer.self_attn, layer.cross_attn)):
                nn.init.xavier_normal_(attn.q_proj.weight, gain=1.0)
                nn.init.xavier_normal_(attn.k_proj.weight, gain=1.0)
                nn.init.xavier_normal_(attn.v_proj.weight, gain=beta)
                nn.init.xavier_normal_(attn.out_proj.weight, gain=beta)
            for proj in layer.ffn.modules():
                if isinstance(proj, nn.Linear):
                    nn.init.xavier_normal_(proj.weight, gain=beta)


def _stacks(model: nn.Module) -> list[TransformerStack]:
    return [m for m in model.modules() if isinstance(m, TransformerStack)]


INITS = {"xavier": _init_xavier, "normal": _init_normal, "gpt2": _init_gpt2}


def init_weights(model: nn.Module, config: ModelConfig) -> None:
    """Initializes `model` in place by the scheme `config.init` names (and DeepNorm's beta when used)."""
    INITS[config.init](model, config)
    _reset_norms(model)
    if config.norm_placement == "deepnorm":
        _init_deepnorm(model, config)
