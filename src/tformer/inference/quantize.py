"""Quantization of a model's linear layers: weight-only INT8 per output channel and INT4 in groups, and W8A8
(INT8 weights and INT8 activations).

INT8: w ≈ q * s with q in [-128, 127] and one scale s per output row (s = max|w_row| / 127). Activations stay in
floating point, in the model's dtype. On the CPU the matmul is torch's packed kernel (`_weight_int8pack_mm`),
which reads the int8 weights directly and is fast with bfloat16 activations only: for SmolLM2-135M's linear
layers at batch 1 on the 2-core development machine, 12.8 ms a token with bf16 activations and 68 ms with fp32,
against 24 ms for plain bf16 and 48 ms for fp32 weights. So `set_precision` serves quantized models in bfloat16
unless told otherwise. Elsewhere INT8 runs as a matmul with the int8 weight cast to the activation dtype, then
scaled.
INT4: each group of `group_size` input weights of a row keeps a scale and a minimum, w ≈ q * s + m with q in
[0, 15] (llama.cpp's Q4_1), multiplied on the CPU's integer dot-product units (`int4.Int4Linear`).
W8A8 also quantizes each token's activations to int8 as it enters a layer (`W8A8Linear`), so the matmul runs
on integers (fbgemm, x86 CPUs): 2x bf16's speed for 8 to 32 rows, the engine's decode batches under load.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from tformer.config import ConfigError
from tformer.inference.fp8 import Fp8Linear
from tformer.inference.fusion import fuse_projections
from tformer.inference.int4 import Int4Linear

QUANT_MODES = ("int8", "int4", "w8a8", "fp8")


def per_channel_scales(weight: torch.Tensor) -> torch.Tensor:
    """INT8's scale of each output row: max |w_row| / 127 (never 0)."""
    return (weight.abs().amax(1) / 127).clamp(min=1e-12)


class Int8Linear(nn.Module):
    """y = x (q * s)^T + b with int8 q (out, in) and float scales s (out,)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = per_channel_scales(weight)
        self.register_buffer("qweight", torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu":
            out = torch._weight_int8pack_mm(flat, self.qweight, self.scales.to(flat.dtype))
        else:
            out = F.linear(flat, self.qweight.to(flat.dtype)) * self.scales.to(flat.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


# fbgemm's packed int8 weights by handle: torch.compile cannot trace the packed-weight object, so the op below
# takes an int handle instead; each W8A8Linear registers its weight and drops the entry when it is collected.
_PACKED_WEIGHTS: dict[int, torch.ScriptObject] = {}
_handles = itertools.count()


# The op is registered with the dispatcher directly rather than through torch.library.custom_op, whose Python
# wrapper cost 10-14 us a call over the bare kernel (about 4 here): 121 calls a token (2026-12-02, 2 rows, 576 x 960).
# It serves inference only, so it has no autograd formula.
_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("int8_dynamic_matmul(Tensor x, int handle, int out_features, bool reduce_range) -> Tensor")


def _int8_dynamic_matmul_cpu(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, _PACKED_WEIGHTS[handle], reduce_range)


_LIBRARY.impl("int8_dynamic_matmul", _int8_dynamic_matmul_cpu, "CPU")


@torch.library.register_fake("tformer::int8_dynamic_matmul")
def _(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def int8_dynamic_matmul(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool) -> torch.Tensor:
    """x (N, in) fp32 -> (N, out): fbgemm quantizes x to uint8 over x's range and multiplies by the int8 weight
    registered under `handle`; one op in a compiled graph."""
    return torch.ops.tformer.int8_dynamic_matmul(x, handle, out_features, reduce_range)


@functools.cache
def full_range_is_exact() -> bool:
    """Whether fbgemm's int8 kernels on this CPU take 8-bit activations without overflow (AVX512-VNNI does).

    Without VNNI, fbgemm sums pairs of uint8 x int8 products in 16 bits, which 255 * 127 * 2 overflows; a
    probe at that extreme tells, and W8A8 then quantizes activations to 7 bits (`reduce_range`).
    """
    weight = torch.full((16, 64), 127.0)
    packed = torch.ops.quantized.linear_prepack(_per_channel_int8(weight, torch.ones(16)), None)
    x = torch.tensor([[255.0] * 64, [0.0] * 64])  # the range [0, 255]: scale 1, zero point 0, so x as it is
    return torch.equal(torch.ops.quantized.linear_dynamic(x, packed, False), x @ weight.T)


def _per_channel_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # quantize_per_channel warns about a future dtype change of its scales
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(
            weight, scales.double(), torch.zeros(len(scales), dtype=torch.long), 0, torch.qint8
        )


class W8A8Linear(nn.Module):
    """y = s_x (q_x q_w^T) s_w + b: int8 weights per output channel (as Int8Linear) and int8 activations per token.

    Each row (token) of x is scaled by its own largest magnitude s_x, so a token's result does not depend on the
    other rows in the batch. fbgemm's dynamic-quantized matmul quantizes its whole input over one range; a row
    holding +1 and -1 appended to the scaled rows pins that range to [-1, 1] in every call, which makes the
    quantization per token. SmolLM2-135M's John 1 perplexity: 12.94 against 12.54 in fp32 (per-tensor
    activation scales, as `torch.ao`'s dynamic quantization does: 32.2; 7-bit activations: 14.16).
    Activations enter and leave in the model's dtype; the matmul reads fp32. CPU only (fbgemm).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.device.type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ConfigError("w8a8 runs on fbgemm's x86 CPU kernels; on other devices use int8 or int4")
        weight = linear.weight.detach().float()
        scales = per_channel_scales(weight)
        self.packed = torch.ops.quantized.linear_prepack(_per_channel_int8(weight, scales), None)
        self._register()
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.reduce_range = not full_range_is_exact()
        self.range_row = torch.zeros(1, self.in_features)  # a constant, not a buffer: it stays fp32 under .to()
        self.range_row[0, :2] = torch.tensor([1.0, -1.0])

    def _register(self) -> None:
        """A handle of its own for the packed weight (also for a copy or an unpickled module)."""
        self.handle = next(_handles)
        _PACKED_WEIGHTS[self.handle] = self.packed
        weakref.finalize(self, _PACKED_WEIGHTS.pop, self.handle, None)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._register()

    @property
    def nbytes(self) -> int:
        """The int8 weight and its fp32 scales, as packed by fbgemm (not a parameter or buffer)."""
        return self.out_features * (self.in_features + 4)

    def dequantized(self) -> torch.Tensor:
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        scale = flat.abs().amax(1, keepdim=True).clamp(min=1e-12)  # (N, 1)
        scaled = torch.cat([flat / scale, self.range_row])
        out = int8_dynamic_matmul(scaled, self.handle, self.out_features, self.reduce_range)[:-1] * scale
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def _check_mode(mode: str) -> None:
    if mode not in QUANT_MODES:
        raise ConfigError(f"unknown quantization mode {mode!r}; choose one of: {', '.join(QUANT_MODES)}")


def quantize(model: nn.Module, mode: str = "int8", group_size: int = 32) -> nn.Module:
    """Replaces every nn.Linear of `model` in place (the output head too); returns the model.

    Embedding tables stay in floating point. A layer whose shape INT4's kernel cannot take stays as it is.
    With INT4 the output head (`lm_head`) gets INT8, as llama.cpp's 4-bit files keep their output matrix at
    8 bits or more. SmolLM2-135M's John 1 perplexity (12.54 in fp32; these with bf16 activations): 12.50 as
    done here, 13.28 with an INT4 head, 16.62 with groups of 64 (the GGUF's Q4_1 blocks hold 32 weights).
    """
    _check_mode(mode)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            if mode == "w8a8":
                setattr(module, child_name, W8A8Linear(child))
            elif mode == "fp8":
                setattr(module, child_name, Fp8Linear(child))
            elif mode == "int8" or (module is model and child_name == "lm_head"):
                setattr(module, child_name, Int8Linear(child))
            elif child.in_features % group_size == 0 and child.out_features % 16 == 0:
                setattr(module, child_name, Int4Linear(child, group_size))
    return model


WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_precision(dtype: str = "auto", quantize_mode: str | None = None) -> None:
    """Raises ConfigError for a dtype or quantization `set_precision` cannot apply (call it before a slow load)."""
    if dtype != "auto" and dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(WEIGHT_DTYPES)}")
    if quantize_mode is not None:
        _check_mode(quantize_mode)


def resolve_dtype(dtype: str, quantize_mode: str | None) -> str:
    """'auto' is float32 for float weights and bfloat16 for quantized ones (the packed kernels' fast case)."""
    if dtype != "auto":
        return dtype
    return "float32" if quantize_mode is None else "bfloat16"


def set_precision(
    model: nn.Module, dtype: str = "auto", quantize_mode: str | None = None, fuse: bool = True
) -> nn.Module:
    """The serving precision of `model`: projections that read one input fused (`fusion.fuse_projections`,
    unless `fuse` is False), the linear layers quantized (optionally), then every float tensor cast. The model
    then serves only: fused, it no longer trains, loads or saves a checkpoint.

    Decoding reads every weight once a token, so bf16 halves the bytes (on a CPU with AVX512-BF16 that made
    SmolLM2's batch-1 decoding about 1.4x faster); INT8 / INT4 quarter / eighth the linear layers' bytes.
    Quantization reads the weights before the cast, so a bf16 INT4 model rounds its fp32 weights only once.
    """
    check_precision(dtype, quantize_mode)
    if fuse:
        fuse_projections(model)
    if quantize_mode is not None:
        quantize(model, quantize_mode)
    return model.to(WEIGHT_DTYPES[resolve_dtype(dtype, quantize_mode)])


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, counting tied tensors once, and of W8A8's packed weights."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, W8A8Linear))
    return sum(t.numel() * t.element_size() for t in tensors.values()) + packed


def dequantize_linear(module: nn.Module) -> torch.Tensor:
    """The floating-point weight a quantized linear layer stands for (for tests and error reports)."""
    if isinstance(module, (Int8Linear, Int4Linear, W8A8Linear, Fp8Linear)):
        return module.dequantized()
    if isinstance(module, nn.Linear):
        return module.weight.detach().float()
    raise TypeError(f"{type(module).__name__} is not a linear layer")
