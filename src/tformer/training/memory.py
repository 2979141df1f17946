"""Training memory term by term, and measured: the estimator's formulas and the reference they are checked against.

The terms (used by training/estimate.py) are bytes per token that tformer's layers save for backward. Each names
the tensor autograd keeps and the layer that keeps it (layers/*.py, models/stack.py, training/losses.py). c is the
compute dtype's size (bf16 under autocast), r the residual stream's (fp32 under autocast: an fp32 residual plus a
bf16 sublayer output is fp32). Under autocast each linear layer saves its own bf16 copy of an fp32 input, so the
q, k and v projections of one input save three copies.

The measurement: `LiveTensorTracker` is a TorchDispatchMode that sees every tensor an operator returns (forward,
backward and optimizer alike), counts the bytes of each new storage until the storage is freed, and keeps the peak.
Tensors alive before it starts are counted only when passed to `track` (weights, optimizer state, the batch).
Memory a kernel allocates and frees inside one call (oneDNN scratch, a flash-attention workspace) is not a tensor
an operator returns, so it is not seen; process RSS (`rss_bytes`, `peak_rss_bytes`) sees it.
`measure_training_step` runs one step of tformer's training loop (zero_grad, autocast forward, the label-smoothed
loss, backward, gradient clipping, a fused Adam step) on a synthetic batch of full-length sequences, after one
step that creates the optimizer state, and reports the live-tensor peak and the RSS growth of that step.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tformer.config import CLASSIFICATION_HEADS, ModelConfig
from tformer.data import LMBatch, Seq2SeqBatch
from tformer.errors import ConfigError
from tformer.layers.masks import DENSE_BIAS_MAX_ENTRIES
from tformer.models import build_model
from tformer.training.evaluate import forward_logits
from tformer.training.lora import LoRAConfig, apply_lora
from tformer.training.losses import label_smoothed_cross_entropy
from tformer.training.optim import adamw_cosine, paper_adam

CPU_MATH_MAX_KEYS = 256  # layers/attention.py: bf16 training on the CPU takes the math path up to this many keys


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor in one precision setup."""

    weight: int  # weights and gradients
    master: int  # fp32 master weights kept by the optimizer (mixed precision), 0 without
    state: int  # each optimizer state (Adam's m and v)
    compute: int  # matmul outputs
    residual: int  # the residual stream and norm inputs
    autocast: bool = False


PRECISIONS = {
    "fp32": Precision(4, 0, 4, 4, 4),
    "bf16-autocast": Precision(4, 0, 4, 2, 4, autocast=True),  # train.bf16: fp32 weights, bf16 matmuls
    "fp16-mixed": Precision(2, 4, 4, 2, 2),  # ZeRO's mixed precision: half weights, fp32 master + Adam state
    "bf16-mixed": Precision(2, 4, 4, 2, 2),
    "bf16-pure": Precision(2, 0, 2, 2, 2),  # everything in bf16, Adam state too
}

FFN_SAVED = {  # (d_ff)-sized tensors an FFN saves: activation input and output, gate and up projections
    "relu": 1,  # ReLU saves its output, which the down projection saves too
    "gelu": 2,
    "gelu-tanh": 2,
    "silu": 2,
    "swiglu": 4,  # gate, act(gate), up, act(gate) * up
    "geglu": 4,
}


def _norm(config: ModelConfig, in_bytes: int) -> float:
    """Bytes per token a norm saves for an input of `in_bytes` per element (RMSNorm computes in fp32)."""
    d = config.d_model
    if config.norm == "layernorm":
        return in_bytes * d + 8  # input, mean and 1/std
    if in_bytes == 4:
        return 8 * d + 4  # input (its own fp32 view), the normalised fp32 tensor, 1/rms
    return 4 * d + in_bytes * d + 4  # an fp32 copy of the input, the normalised tensor cast back, 1/rms


def _trained(adapted: frozenset[str] | None, *names: str) -> int:
    """How many of the linear layers `names` train: all of them, or under LoRA those with an adapter."""
    return len(names) if adapted is None else sum(name in adapted for name in names)


def _linear_inputs(config: ModelConfig, p: Precision, n_linears: int, in_bytes: int) -> float:
    """Linear layers that train save their input; under autocast each of `n_linears` saves its own bf16 copy of
    fp32. A frozen layer (LoRA's base layers without an adapter) needs only its weight for backward."""
    if n_linears == 0:
        return 0.0
    if p.autocast and in_bytes == 4:
        return n_linears * 2 * config.d_model
    return in_bytes * config.d_model


def attention_path(config: ModelConfig, keys: int, p: Precision, device: str) -> str:
    """Which attention code runs in training, which decides what it saves (layers/attention.py):
    "math": tformer's math_attention (the math backend, or sdpa's detour for bf16 on the CPU up to 256 keys);
    "fallback": torch's own math fallback, taken by sdpa on the CPU when attention dropout is on;
    "fused": torch's fused kernel (flash or memory-efficient), which saves only q, k, v, the output and the mask.
    """
    if config.attention_backend == "math" or (device == "cpu" and p.compute == 2 and keys <= CPU_MATH_MAX_KEYS):
        return "math"
    return "fallback" if device == "cpu" and config.attn_dropout > 0 else "fused"


def _attention(
    config: ModelConfig, keys: int, p: Precision, device: str, cross: bool, adapted: frozenset[str] | None = None
) -> float:
    """Bytes per query token inside attention: q, k, v, the output and, off the fused path, the weights."""
    c, heads = p.compute, config.n_heads
    q_dim, kv_dim = heads * config.head_dim, config.n_kv_heads * config.head_dim
    kv = 2 * kv_dim  # elements of k and v per key token; cross-attention reads a source of the same length
    memory_projections = _trained(adapted, "k_proj", "v_proj")  # of the memory, under autocast
    copies = _linear_inputs(config, p, memory_projections, p.residual) if cross and p.autocast else 0
    path = attention_path(config, keys, p, device)
    if path == "fused":
        return (2 * q_dim + kv) * c + 4 * heads + copies  # q, k, v, output, fp32 log-sum-exp
    if path == "fallback":  # computes in fp32: q, k, v and the weights, its dropout mask and the dropped weights
        return 4 * (q_dim + kv) + q_dim * c + 3 * 4 * heads * keys + copies
    if config.n_kv_heads != heads:
        kv = 2 * q_dim  # repeat_kv: the repeated copies are saved, not k and v
    weights = 4 * heads * keys  # the fp32 softmax
    if config.attn_dropout > 0:
        weights += (1 + c) * heads * keys  # keep-mask and the dropped weights
    elif c != 4:
        weights += c * heads * keys  # the softmax cast back to the compute dtype
    output = q_dim * c if _trained(adapted, "out_proj") else 0  # saved for out_proj's weight gradient alone
    return (q_dim + kv) * c + output + weights + copies  # q, k, v, weights, output (a contiguous copy)


def _sublayer(config: ModelConfig, p: Precision, n_linears: int, internals: float) -> float:
    """A residual sublayer: its norm(s), the inputs of its first linear layers, its internals, a dropout mask."""
    r, placement = p.residual, config.norm_placement
    saved = _norm(config, r) + _linear_inputs(config, p, n_linears, r) + internals
    if placement == "sandwich":
        saved += _norm(config, p.compute)  # norm_out on the sublayer's output
    return saved + (config.d_model if config.dropout > 0 else 0)


def layer_per_token(
    config: ModelConfig, seq_len: int, p: Precision, device: str, cross: bool, adapted: frozenset[str] | None = None
) -> float:
    """Bytes per token one block saves: self-attention, cross-attention when `cross`, FFN. `adapted`: under LoRA,
    the names of the linear layers with adapters (the others are frozen); None when every layer trains."""
    attention = _attention(config, seq_len, p, device, False, adapted)
    saved = _sublayer(config, p, _trained(adapted, "q_proj", "k_proj", "v_proj"), attention)
    if cross:
        attention = _attention(config, seq_len, p, device, True, adapted)
        saved += _sublayer(config, p, _trained(adapted, "q_proj"), attention)
    gated = FFN_SAVED[config.ffn] == 4
    ffn_inputs = _trained(adapted, "gate_proj", "up_proj") if gated else _trained(adapted, "up_proj")
    internals = FFN_SAVED[config.ffn]
    if config.ffn != "relu" and not _trained(adapted, "down_proj"):
        internals -= 1  # the down projection's input, saved only for its own weight's gradient
    return saved + _sublayer(config, p, ffn_inputs, internals * config.d_ff * p.compute)


def _stack_terms(config: ModelConfig, seq_len: int, p: Precision, device: str, masks: int) -> float:
    """Bytes per token a stack holds once for all its layers: masks, RoPE tables, embedding dropout and norms."""
    heads = config.n_heads if config.position in ("alibi", "t5") else 1  # a bias per head, not one mask
    fused = attention_path(config, seq_len, p, device) == "fused"
    kept = fused or config.activation_checkpointing  # the fused kernel saves the mask; so does checkpoint()
    dense = seq_len * seq_len <= DENSE_BIAS_MAX_ENTRIES  # longer inputs build the mask by blocks, never kept whole
    saved = masks * heads * seq_len * p.compute if kept and dense else 0.0  # the additive mask (B, 1|H, T, T)
    if config.position == "rope":
        saved += 2 * 4 * config.head_dim  # cos and sin, fp32
    if config.dropout > 0:
        saved += config.d_model
    if config.embedding_norm:
        saved += _norm(config, p.residual)
    if config.final_norm:
        saved += _norm(config, p.residual)
    return saved


def activations_per_token(
    config: ModelConfig, seq_len: int, p: Precision, device: str, adapted: frozenset[str] | None = None
) -> tuple[float, float]:
    """(bytes per token saved for backward by the stacks, bytes per token of the largest block).

    With activation checkpointing a block saves only its input; the largest block is recomputed in backward.
    `adapted`: see `layer_per_token`.
    """
    stacks = []
    if config.has_encoder:
        stacks.append((config.n_encoder_layers, False))
    if config.has_decoder:
        stacks.append((config.n_decoder_layers, config.has_encoder))
    total, largest = 0.0, 0.0
    for n_layers, cross in stacks:
        layer = layer_per_token(config, seq_len, p, device, cross, adapted)
        largest = max(largest, layer)
        kept = p.residual * config.d_model if config.activation_checkpointing else layer
        total += n_layers * kept + _stack_terms(config, seq_len, p, device, 2 if cross else 1)
    if config.has_encoder and config.has_decoder and (config.activation_checkpointing or not p.autocast):
        total += p.residual * config.d_model  # the encoder's output, read by every cross-attention
    return total, largest


@dataclass
class HeadTerms:
    """Bytes per token of the output head and the loss (training/losses.py)."""

    saved: float  # the head's saved inputs, the logits and the loss's fp32 log-probabilities
    logits: float  # (B, T, V) in the compute dtype: the trainer holds them until the step ends
    log_probs: float  # freed once the loss's backward is done
    loss_buffers: float  # the loss's backward: the gathered gradient and its sum with the smoothing term


QA_LOGITS = 2  # the extractive QA head (models/heads.py): a start and an end logit per token


def head_terms(config: ModelConfig, p: Precision, head_trains: bool = True, seq_len: int | None = None) -> HeadTerms:
    """The output head's and the label-smoothed loss's bytes per token (none for an encoder without a head); a frozen
    head (LoRA) saves no input. Classifiers: num_labels logits per token, or per sequence of `seq_len` (None: 1)."""
    if config.family == "encoder" and config.encoder_head == "none":
        return HeadTerms(0.0, 0.0, 0.0, 0.0)
    saved = _linear_inputs(config, p, int(head_trains), p.residual)  # the output projection's (or pooler's) input
    if config.family == "encoder" and config.encoder_head in CLASSIFICATION_HEADS:
        mask = config.d_model if config.dropout > 0 else 0  # dropout's keep-mask
        if config.encoder_head == "token-classification":
            per, saved = 1.0, saved + mask
        else:  # the pooler's input: a bf16 copy of [CLS]'s state, or a view that keeps the whole final state alive;
            per = 1.0 / (seq_len or 1)  # per sequence: tanh's output, dropout's mask and output
            copied = p.autocast and p.residual == 4
            saved = saved * (per if copied else 1.0) + (p.compute * config.d_model * (2 if mask else 1) + mask) * per
        n = config.num_labels * per
        return HeadTerms(saved + n * (p.compute + 4), n * p.compute, n * 4, 2 * 4 * n)
    if config.family == "encoder" and config.encoder_head == "question-answering":
        # Linear(d_model, 2) on every token, without dropout: a start and an end logit, and their log-probabilities
        return HeadTerms(saved + QA_LOGITS * (p.compute + 4), QA_LOGITS * p.compute, QA_LOGITS * 4, 2 * 4 * QA_LOGITS)
    vocab = config.tgt_vocab_size if config.family == "encoder-decoder" else config.vocab_size
    if config.family == "encoder":  # MLM head: dense and activation outputs, the norm's output and statistics
        saved += 2 * p.compute * config.d_model + _norm(config, p.compute)
    logits, log_probs = vocab * p.compute, vocab * 4
    return HeadTerms(saved + logits + log_probs, logits, log_probs, 2 * 4 * vocab)


def backward_temporaries(config: ModelConfig, seq_len: int, p: Precision, device: str) -> float:
    """Bytes per token a block's backward holds beyond its saved tensors, net of those it frees as it goes.

    Measured (benchmarks/estimate_validation.py): about one (d_ff)-sized gradient per FFN projection that reads
    the input, or one fp32 (heads x keys) gradient of the attention weights on the math path; an encoder-decoder
    also accumulates the gradient of the encoder's output over the decoder's layers.
    """
    gated = FFN_SAVED[config.ffn] == 4
    ffn = (2 if gated else 1) * config.d_ff * p.compute
    unfused = attention_path(config, seq_len, p, device) != "fused"
    attention = 4 * config.n_heads * seq_len if unfused else 0
    memory_gradient = 4 * config.d_model if config.has_encoder and config.has_decoder else 0
    return max(ffn, attention) + memory_gradient


# ---- measurement -------------------------------------------------------------------------------------------


class LiveTensorTracker(TorchDispatchMode):
    """The current and peak bytes of live tensor storages while the mode is active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage id -> bytes
        self.current = 0
        self.peak = 0

    def track(self, tensors: list[torch.Tensor]) -> None:
        """Counts tensors that already exist (weights, optimizer state, inputs) from now until they are freed."""
        for tensor in tensors:
            self._count(tensor)

    def _free(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            weakref.finalize(storage, self._free, key)
            old = 0
        self.sizes[key] = size
        self.current += size - old
        self.peak = max(self.peak, self.current)


def rss_bytes() -> int:
    """This process's resident set size now (/proc/self/statm)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Resets the kernel's high-water mark of this process's RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """The RSS high-water mark (VmHWM) since the process started or `reset_peak_rss` was last called."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@dataclass
class MeasuredStep:
    """What one measured training step held: bytes of live tensors at the start and at the peak, and RSS."""

    start_bytes: int  # weights, optimizer state and the batch, before the step
    peak_bytes: int  # live-tensor peak during the step
    rss_start: int
    rss_peak: int

    @property
    def rss_growth(self) -> int:
        return self.rss_peak - self.rss_start


def synthetic_batch(config: ModelConfig, batch_size: int, seq_len: int, seed: int = 0) -> Seq2SeqBatch | LMBatch:
    """A batch of `batch_size` random sequences of exactly `seq_len` tokens, as the family's objective makes it."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, seq_len)
    ids = torch.randint(4, config.vocab_size, shape, generator=generator)
    ones = torch.ones(shape, dtype=torch.long)
    if config.is_seq2seq:
        target = torch.randint(4, config.tgt_vocab_size, shape, generator=generator)
        return Seq2SeqBatch(ids, ones, target, target.roll(-1, dims=1), ones.clone())
    return LMBatch(ids, ones, ids.roll(-1, dims=1))


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return adamw_cosine(model, 1e-4, 10, 100)[0]
    return paper_adam(model, model.config.d_model)[0]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Seq2SeqBatch | LMBatch, autocast: bool) -> None:
    """One step of Trainer.train_step without accumulation: the same calls in the same order."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16) if autocast else nullcontext():
        logits = forward_logits(model, batch)
    loss_sum, n_tokens = label_smoothed_cross_entropy(logits, batch.labels, 0.1)
    (loss_sum / n_tokens).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], float("inf"))
    optimizer.step()


MEASURED_DTYPES = ("fp32", "bf16-autocast", "bf16-pure")  # mixed precision's master weights are arithmetic


def measure_training_step(
    config: ModelConfig,
    batch_size: int,
    seq_len: int,
    dtype: str = "fp32",
    optimizer: str = "adam",
    seed: int = 0,
    lora: LoRAConfig | None = None,
) -> MeasuredStep:
    """Builds `config` on the CPU and measures one training step (see the module docstring).

    dtype: "fp32", "bf16-autocast" (fp32 weights, bf16 autocast, as `train.bf16`) or "bf16-pure" (the model in
    bf16, Adam state in bf16); optimizer: "adam" (the paper's) or "adamw"; lora: train only these adapters.
    """
    for name, value, known in (("dtype", dtype, MEASURED_DTYPES), ("optimizer", optimizer, ("adam", "adamw"))):
        if value not in known:
            raise ConfigError(f"cannot measure {name} '{value}' on the CPU; choose one of: {', '.join(known)}")
    torch.manual_seed(seed)
    model = build_model(config)
    if lora is not None:
        apply_lora(model, lora)
    if dtype == "bf16-pure":
        model = model.to(torch.bfloat16)
    model.train()
    opt = _optimizer(model, optimizer)
    batch = synthetic_batch(config, batch_size, seq_len, seed)
    autocast = dtype == "bf16-autocast"
    _step(model, opt, batch, autocast)  # creates the optimizer state
    opt.zero_grad(set_to_none=True)
    gc.collect()
    existing = [*model.parameters(), *model.buffers(), *vars(batch).values()]
    existing += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    tracker = LiveTensorTracker()
    tracker.track([t for t in existing if isinstance(t, torch.Tensor)])
    start = tracker.current
    rss_start = rss_bytes()
    reset_peak_rss()
    with tracker:
        _step(model, opt, batch, autocast)
    return MeasuredStep(start, tracker.peak, rss_start, peak_rss_bytes())
