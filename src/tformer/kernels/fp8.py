"""FP8 weights: e4m3 values with one fp32 scale per output channel (`--quantize fp8`, seed 001 §10.2).

w ≈ q * s with q a `torch.float8_e4m3fn` value (4 exponent bits, 3 mantissa bits, largest 448) and
s = max |w_row| / 448 per output row. A decode step reads one byte per weight, as INT8 does.

This CPU (AVX512-BF16, no AMX-FP8 or AVX10.2) has no instruction that multiplies or even converts fp8, so the
weight is turned into a 16-bit float on every call and multiplied there. torch's own float8 conversions (and
`torch._scaled_mm`) cost many times the whole bf16 matmul, so the conversion works on bits instead:
- every e4m3 value is exactly an fp16 value times 2^8, and a bf16 value times 2^120, whose bits are the byte's
  bits shifted (`e4m3_bits_as`): three vectorized integer passes;
- fp16 matmuls are faster than bf16 for one row but far slower for many, so batch-1 decoding multiplies in fp16
  and everything else in bf16 (fp16 to bf16 is as slow as fp8 to bf16).
So FP8 costs a bf16 matmul plus a pass over the weight bytes: it loses to INT8, whose packed kernel reads int8
straight into its dot products (`docs/engine.md` has the engine's figures; the conversions' measurements:
docs/design-notes.md, "kernels/fp8.py").
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E4M3_SMALLEST_NORMAL = 2.0**-6
FP16_FROM_E4M3 = 2.0**8  # the fp16 built from an e4m3 byte's bits is the e4m3 value / 2^8
BF16_FROM_E4M3 = 2.0**120  # the bf16 built from an e4m3 byte's bits is the e4m3 value / 2^120

_scratch = threading.local()  # one int16 buffer per thread, reused by every layer's conversion


def e4m3_scales(weight: torch.Tensor) -> torch.Tensor:
    """FP8's scale of each output row: max |w_row| / 448 (never 0), in fp32."""
    return (weight.float().abs().amax(1) / E4M3_MAX).clamp(min=1e-12)


def to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """The nearest float8_e4m3fn of each value in [-448, 448], among 0 and the normal numbers.

    e4m3's subnormals (below 2^-6, under 1/28,672 of a row's largest weight) round to 0 or +-2^-6: bf16 matmuls
    on AVX512-BF16 read subnormal inputs as 0, so a stored subnormal would be a weight the layer does not use."""
    values = values.float().clamp(-E4M3_MAX, E4M3_MAX)
    small = values.abs() < E4M3_SMALLEST_NORMAL
    values = torch.where(small, torch.round(values / E4M3_SMALLEST_NORMAL) * E4M3_SMALLEST_NORMAL, values)
    return values.to(torch.float8_e4m3fn)


def _int16_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """A reused int16 buffer of at least `numel` elements: a fresh 56 MB tensor per call (the head's) costs page
    faults that take longer than the conversion itself (docs/design-notes.md, "kernels/fp8.py")."""
    buffers = _scratch.__dict__.setdefault("by_device", {})
    buffer = buffers.get(device)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # an inference tensor could not be written outside inference mode
            buffer = buffers[device] = torch.empty(numel, dtype=torch.int16, device=device)
    return buffer[:numel]


def e4m3_bits_as(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q / 2^8 as fp16, or q / 2^120 as bf16, exactly, for a float8_e4m3fn tensor q, built from q's bytes.

    The byte's exponent and mantissa bits (e4m3: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits) shifted
    left land in the low exponent and high mantissa bits of the 16-bit float (fp16: 5 and 10, bias 15; bf16: 8
    and 7, bias 127): that is the value times 2^(7 - bias); subnormals stay subnormals. Copying the byte into
    int16 sign-extends it; the mask keeps one sign bit. The result lives in a buffer the next call reuses."""
    shift, mask = (7, ~(1 << 14)) if dtype == torch.float16 else (4, ~0x7800)  # 0x87F0: sign, exponent, mantissa
    bits = _int16_buffer(q.numel(), q.device).view(q.shape)
    bits.copy_(q.view(torch.int8)).bitwise_left_shift_(shift).bitwise_and_(mask)
    return bits.view(dtype)


@torch.library.custom_op("tformer::fp8_matmul", mutates_args=())
def fp8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (N, in) times the e4m3 weight (out, in) with fp32 scales (out,) -> (N, out) in x's dtype.

    Each row of x is scaled to max |x| = 1, so neither fp16's range (65504) nor bf16's with the 2^120 factor
    can overflow. One row (batch-1 decoding) multiplies in fp16, faster than bf16 there; more rows in bf16, as fp16
    matmuls of many rows are far slower. A custom op, so that torch.compile calls it as it is: inductor's own fused
    conversion was slower than these three integer passes (docs/design-notes.md, "kernels/fp8.py")."""
    rows = x.float()
    row_max = rows.abs().amax(1, keepdim=True).clamp(min=1e-30)  # (N, 1)
    if x.shape[0] == 1:
        out = F.linear((rows / row_max).half(), e4m3_bits_as(qweight, torch.float16)).float() * FP16_FROM_E4M3
    else:
        out = F.linear((rows / row_max * BF16_FROM_E4M3).bfloat16(), e4m3_bits_as(qweight, torch.bfloat16))
    return (out.float() * row_max * scales).to(x.dtype)


@fp8_matmul.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


class Fp8Linear(nn.Module):
    """y = (x q^T) s + b with float8_e4m3fn q (out, in) and fp32 scales s (out,).

    The weight and the scales keep their dtypes when the model is cast (`model.to(torch.bfloat16)` casts every
    floating tensor, float8 included); activations enter and leave in the model's dtype.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = e4m3_scales(weight)
        self.register_buffer("qweight", to_e4m3(weight / scales[:, None]))
        self.register_buffer("scales", scales)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        qweight, scales = self.qweight, self.scales
        super()._apply(fn, recurse)
        self.qweight, self.scales = qweight.to(self.qweight.device), scales.to(self.scales.device)  # moves only
        return self

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias
