"""The activation terms of the memory estimate: bytes per token that tformer's layers save for backward.

Each term names the tensor autograd keeps and the layer that keeps it (layers/*.py, models/stack.py,
training/losses.py). c is the compute dtype's size (bf16 under autocast), r the residual stream's (fp32 under
autocast: the sum of an fp32 residual and a bf16 sublayer output is fp32). Under autocast each linear layer saves
its own bf16 copy of an fp32 input, so q, k and v projections of one input save three copies.
"""

from __future__ import annotations

from dataclasses import dataclass

from tformer.config import ModelConfig

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


def _linear_inputs(config: ModelConfig, p: Precision, n_linears: int, in_bytes: int) -> float:
    """A linear layer saves its input; under autocast each of `n_linears` saves its own bf16 copy of fp32."""
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


def _attention(config: ModelConfig, keys: int, p: Precision, device: str, cross: bool) -> float:
    """Bytes per query token inside attention: q, k, v, the output and, off the fused path, the weights."""
    c, heads = p.compute, config.n_heads
    q_dim, kv_dim = heads * config.head_dim, config.n_kv_heads * config.head_dim
    kv = 2 * kv_dim  # elements of k and v per key token; cross-attention reads a source of the same length
    copies = _linear_inputs(config, p, 2, p.residual) if cross and p.autocast else 0  # k_proj, v_proj of memory
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
    return (2 * q_dim + kv) * c + weights + copies  # q, k, v, weights, output (a contiguous copy)


def _sublayer(config: ModelConfig, p: Precision, n_linears: int, internals: float) -> float:
    """A residual sublayer: its norm(s), the inputs of its first linear layers, its internals, a dropout mask."""
    r, placement = p.residual, config.norm_placement
    saved = _norm(config, r) + _linear_inputs(config, p, n_linears, r) + internals
    if placement == "sandwich":
        saved += _norm(config, p.compute)  # norm_out on the sublayer's output
    return saved + (config.d_model if config.dropout > 0 else 0)


def layer_per_token(config: ModelConfig, seq_len: int, p: Precision, device: str, cross: bool) -> float:
    """Bytes per token one block saves: self-attention, cross-attention when `cross`, FFN."""
    saved = _sublayer(config, p, 3, _attention(config, seq_len, p, device, cross=False))
    if cross:
        saved += _sublayer(config, p, 1, _attention(config, seq_len, p, device, cross=True))
    gated = FFN_SAVED[config.ffn] == 4
    return saved + _sublayer(config, p, 2 if gated else 1, FFN_SAVED[config.ffn] * config.d_ff * p.compute)


def _stack_terms(config: ModelConfig, seq_len: int, p: Precision, device: str, masks: int) -> float:
    """Bytes per token a stack holds once for all its layers: masks, RoPE tables, embedding dropout and norms."""
    heads = config.n_heads if config.position == "alibi" else 1
    fused = attention_path(config, seq_len, p, device) == "fused"
    kept = fused or config.activation_checkpointing  # the fused kernel saves the mask; so does checkpoint()
    saved = masks * heads * seq_len * p.compute if kept else 0.0  # the additive mask (B, 1|H, T, T)
    if config.position == "rope":
        saved += 2 * 4 * config.head_dim  # cos and sin, fp32
    if config.dropout > 0:
        saved += config.d_model
    if config.embedding_norm:
        saved += _norm(config, p.residual)
    if config.final_norm:
        saved += _norm(config, p.residual)
    return saved


def activations_per_token(config: ModelConfig, seq_len: int, p: Precision, device: str) -> tuple[float, float]:
    """(bytes per token saved for backward by the stacks, bytes per token of the largest block).

    With activation checkpointing a block saves only its input; the largest block is recomputed in backward.
    """
    stacks = []
    if config.has_encoder:
        stacks.append((config.n_encoder_layers, False))
    if config.has_decoder:
        stacks.append((config.n_decoder_layers, config.has_encoder))
    total, largest = 0.0, 0.0
    for n_layers, cross in stacks:
        layer = layer_per_token(config, seq_len, p, device, cross)
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


def head_terms(config: ModelConfig, p: Precision) -> HeadTerms:
    """The output head's and the label-smoothed loss's bytes per token (none for an encoder without a head)."""
    if config.family == "encoder" and config.encoder_head == "none":
        return HeadTerms(0.0, 0.0, 0.0, 0.0)
    vocab = config.tgt_vocab_size if config.family == "encoder-decoder" else config.vocab_size
    saved = _linear_inputs(config, p, 1, p.residual)  # the output projection's input
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
