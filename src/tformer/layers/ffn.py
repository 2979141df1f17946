"""Position-wise feed-forward networks: the paper's two-layer MLP (ReLU, GELU, SiLU), the gated (GLU) variants, and
a mixture of experts of either kind (Mixtral, Qwen3-MoE)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tformer.config import ModelConfig

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,  # a plain (not gated) Swish MLP, as in Marian
    "swiglu": nn.SiLU,  # Swish with beta = 1
    "geglu": nn.GELU,
    "geglu-tanh": lambda: nn.GELU(approximate="tanh"),  # T5 v1.1's gated-gelu (gelu_new)
}


class MLP(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2; with ReLU this is the paper's max(0, x W1 + b1) W2 + b2."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.ffn_bias)
        self.act = ACTIVATIONS[config.ffn]()
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.ffn_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GatedMLP(nn.Module):
    """GLU family (Shazeer, 2020): (act(x W + b) * (x V + c)) W2; SwiGLU with SiLU, GeGLU with GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.ffn_bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.ffn_bias)
        self.act = ACTIVATIONS[config.ffn]()
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.ffn_bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one layer, for serving: `fuse_projections`
        # For serving: act(gate) * up in one fused kernel, which gives None where it does not apply
        # (`tformer.kernels.elementwise`)
        self.fused_gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.fused_gate is not None and (hidden := self.fused_gate(gate, up)) is not None:
            return self.down_proj(hidden)
        return self.down_proj(self.act(gate) * up)

    def fuse_projections(self, concat: Callable[[list[nn.Module]], nn.Module | None]) -> None:
        """For serving: the gate and up projections become one layer, one matmul on the input instead of two;
        `concat` joins layers by their output rows, or gives None for layers it cannot join (nothing changes).
        gate_proj and up_proj are dropped (no more training, loading or saving them)."""
        fused = None if self.gate_up_proj is not None else concat([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj


FFNS: dict[str, type[nn.Module]] = {
    "relu": MLP,
    "gelu": MLP,
    "gelu-tanh": MLP,
    "silu": MLP,
    "swiglu": GatedMLP,
    "geglu": GatedMLP,
    "geglu-tanh": GatedMLP,
}


def route_topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the k largest logits (Mixtral; Qwen3-MoE with norm_topk_prob): the top-k probabilities of a
    softmax over all experts, renormalized to sum to 1, which is the same number."""
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), experts


def route_softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k probabilities of a softmax over all experts, as they are (Qwen3-MoE without norm_topk_prob)."""
    return F.softmax(logits.float(), dim=-1).topk(k, dim=-1)


# config.moe_router -> (router logits (N, E), k) -> (weights (N, k) in fp32, expert ids (N, k))
ROUTERS: dict[str, Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "topk-softmax": route_topk_softmax,
    "softmax-topk": route_softmax_topk,
}


class Router(nn.Linear):
    """The router's projection to one logit per expert. A subclass of nn.Linear so that quantization (which
    replaces plain nn.Linear layers) keeps it in floating point: its few weights decide every token's experts."""


class MixtureOfExperts(nn.Module):
    """A sparse FFN (Shazeer et al., 2017; Switch, Mixtral): a router scores the n_experts FFNs for each token,
    the token goes through its top n_experts_per_token of them, and their outputs are summed with the router's
    weights. Each expert runs once per forward, over the tokens routed to it: the work is k expert FFNs per
    token, not n_experts.

    The experts are FFN modules of kind `config.ffn` (nn.Linear inside), so quantization and projection fusion
    treat each one as they treat a dense FFN. In training the last forward's router logits stay in
    `router_logits` for the load-balancing loss (`tformer.training.losses.load_balancing_loss`).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.n_experts_per_token
        self.route = ROUTERS[config.moe_router]
        self.router = Router(config.d_model, config.n_experts, bias=False)
        expert = replace(config, d_ff=config.moe_d_ff or config.d_ff, n_experts=0)
        self.experts = nn.ModuleList(FFNS[config.ffn](expert) for _ in range(config.n_experts))
        self.router_logits: torch.Tensor | None = None  # (N, n_experts), set by a forward in training mode
        self._register()

    def _register(self) -> None:
        # the key that `tformer::moe_experts` finds this layer by; a copy (deepcopy, unpickling) gets its own
        self.key = next(_KEYS)
        _LAYERS[self.key] = self

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._register()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, d)
        logits = self.router(x)  # (N, E)
        self.router_logits = logits if self.training else None
        weights, experts = self.route(logits, self.top_k)  # (N, k) fp32, (N, k)
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():
            # Compiled serving: the experts run as one opaque op, since choosing them reads the routing back to
            # Python, which would break the graph. After such a break Dynamo compiles each Block's forward as a
            # frame of its own, shared by all layers, and the compiled decode step keeps no guards on modules
            # (engine/runner.py): one layer's frame would then run for layers of another structure.
            out = torch.ops.tformer.moe_experts(x, weights, experts, self.key)
            return out.to(x.dtype).reshape(shape)
        chosen, out = self.mix(x, weights, experts)
        if self.training and len(set(chosen)) < len(self.experts):
            # an idle expert takes part times zero, so that its gradients are zeros rather than missing
            # (DistributedDataParallel expects a gradient for every parameter in every step)
            idle = [p.sum() for e, expert in enumerate(self.experts) if e not in chosen for p in expert.parameters()]
            out = out + 0.0 * torch.stack(idle).sum()
        return out.to(x.dtype).reshape(shape)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The experts that ran and sum_j weights[:, j] * expert_{experts[:, j]}(x) (N, d), in fp32, for tokens x
        (N, d) and their routing (N, k)."""
        if x.shape[0] != 1:
            return self.grouped(x, weights, experts)
        # batch-1 decode: the token's k (distinct) experts, one row each, nothing to sort or scatter
        chosen = experts[0].tolist()
        outputs = self.run_experts(chosen, x.expand(len(chosen), -1), [1] * len(chosen))  # (k, d)
        return chosen, (weights.T * outputs).sum(0, keepdim=True)  # (1, d), mixed in fp32

    def run_experts(self, ran: list[int], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The first counts[0] rows (of rows (R, d)) through expert ran[0], the next counts[1] through ran[1], ...:
        (R, d). Gated experts whose layers multiply groups of rows in one call (a `grouped` static method, as
        quantized serving layers have) run as two such calls and one activation over all rows, each row's numbers
        those of its expert's forward; any other experts run one by one."""
        experts = [self.experts[e] for e in ran]
        first = experts[0]
        fused = [e.gate_up_proj for e in experts] if isinstance(first, GatedMLP) else [None]
        if None not in fused and all(type(e) is type(first) and e.fused_gate is first.fused_gate for e in experts):
            gate_up = _grouped_linear(fused, rows, counts)
            if gate_up is not None:
                gate, up = gate_up.chunk(2, dim=-1)
                hidden = first.fused_gate(gate, up) if first.fused_gate is not None else None
                if hidden is None:
                    hidden = first.act(gate) * up
                out = _grouped_linear([e.down_proj for e in experts], hidden, counts)
                if out is not None:
                    return out
                return torch.cat([e.down_proj(h) for e, h in zip(experts, hidden.split(counts), strict=True)])
        return torch.cat([expert(r) for expert, r in zip(experts, rows.split(counts), strict=True)])

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Several tokens: the N * k (token, slot) pairs sorted by expert, so that each expert's rows are one
        contiguous slice of a single gather of x; the outputs go back to (token, slot) order with one copy and
        are mixed with the weights in fp32. Gives the experts that ran and the mixture (N, d)."""
        n, d = x.shape
        flat = experts.flatten()  # (N * k,)
        order = flat.argsort(stable=True)  # the pairs grouped by expert: expert e takes the next counts[e]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # the one host sync
        rows = x.index_select(0, order // self.top_k)  # (N * k, d): expert e's counts[e] rows after e - 1's
        ran = [e for e, count in enumerate(counts) if count]
        if not ran:  # no tokens at all
            return ran, torch.zeros_like(x, dtype=weights.dtype)
        outputs = self.run_experts(ran, rows, [counts[e] for e in ran])  # (N * k, d) in expert order
        mixed = torch.empty_like(outputs).index_copy_(0, order, outputs).view(n, self.top_k, d)
        return ran, (mixed * weights[..., None]).sum(1)


def _grouped_linear(layers: list[nn.Module], x: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """counts[i] rows of x after another through layers[i], in one call where the layers' kind offers one (a static
    method `grouped(layers, x, counts)`, which gives None where it does not apply), else None."""
    grouped = getattr(type(layers[0]), "grouped", None)
    return None if grouped is None else grouped(layers, x, counts)


# Each MixtureOfExperts by its key, for the op below; a layer leaves when it is freed
_LAYERS: weakref.WeakValueDictionary[int, MixtureOfExperts] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


# Defined and implemented directly rather than with torch.library.custom_op, whose Python wrappers (autograd and
# checks) cost a decode step tens of microseconds a layer; the op has no gradient and serves inference only.
_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("moe_experts(Tensor x, Tensor weights, Tensor experts, int layer) -> Tensor")


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, layer: int) -> torch.Tensor:
    """`tformer::moe_experts`: the mixture (N, d) in fp32 of the experts of the MixtureOfExperts keyed `layer` for
    tokens x (N, d) routed to `experts` (N, k) with `weights` (N, k) (`MixtureOfExperts.mix`): a compiled graph
    calls it as it is."""
    return _LAYERS[layer].mix(x, weights, experts)[1]


_LIBRARY.impl("moe_experts", moe_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("tformer::moe_experts")
def _(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=weights.dtype)


def make_ffn(config: ModelConfig, layer: int = 0) -> nn.Module:
    """The feed-forward sublayer the config names for layer `layer` (from 0): a mixture of experts when
    n_experts > 0, except in moe_dense_layers."""
    if config.n_experts and layer not in (config.moe_dense_layers or []):
        return MixtureOfExperts(config)
    return FFNS[config.ffn](config)
