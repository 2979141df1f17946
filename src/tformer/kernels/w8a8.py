"""W8A8 linear layers: int8 weights per output channel times int8 activations per token, on the CPU's integer dot
products.

y = s_x s_w (q_x q_w^T) + b. Weights: q_w = round(w / s_w) in [-127, 127] with s_w = max |w_row| / 127, as INT8.
Activations: each row (token) x of a call becomes q_x = round(x / s_x) with s_x = max |x| / 127, so a token's
result never depends on the other rows of its batch (tested exactly). The matmul (`w8a8.cpp`) multiplies bytes
with AVX512-VNNI's `vpdpbusd` (64 products an instruction), reading the weights as unsigned bytes q_w + 128 and
taking 128 Σ q_x back off each sum. Every output is computed in one fixed order whatever the batch.

Layout: (ceil(N / 16), ceil(K / 4), 64) uint8: each 64 bytes hold 4 consecutive columns of 16 output rows (zeros
past the layer's edge), so one load feeds a 16-lane dot product. The scales stay float32 whatever dtype the model
is cast to: they are held as int32 bits.

It is faster than fbgemm's dynamic int8 matmul with the same per-token rounding (tformer's W8A8 before it), most
of all at 1 row, where fbgemm spends a fixed cost a call before any arithmetic (`benchmarks/w8a8_vs_int_mm.py`;
docs/design-notes.md, "kernels/w8a8.py"). Without AVX512-VNNI, on AVX2 (AMD's Zen 3), the
same format runs on `vpmaddubsw` (32 products an instruction, on the weights' magnitudes and the activations with
the weights' signs), else on a portable loop, all with exactly the same results; without a C++ compiler, or off the
CPU, the layer computes the formula in torch.
"""

from __future__ import annotations

import torch
from torch import nn

from tformer.kernels import dispatch, native

TILE = 16  # output rows a 64-byte group holds
FINE = 254  # with `fine`, the second rounding's steps per step of the first
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


# kernel(): the library, which implements `tformer::w8a8_matmul` on the CPU once loaded; available(); instructions()
UNAVAILABLE = "the W8A8 kernel is unavailable: W8A8 layers compute their formula in torch"
kernel, available, instructions = native.op_library("w8a8", UNAVAILABLE)


def per_channel_scales(weight: torch.Tensor) -> torch.Tensor:
    """The scale of each output row: max |w_row| / 127 (never 0)."""
    return (weight.abs().amax(1) / 127).clamp(min=1e-12)


def quantize_rows(weight: torch.Tensor, values: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 q (N, K) and the float scale of each row (N,) of a float weight (N, K): w ≈ q * s. A few rows at a
    time (about `values` values), so that a large weight (a tied output head) needs no float temporaries its size."""
    step = max(1, values // max(weight.shape[1], 1))
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], step):
        rows = weight[start : start + step]
        scales[start : start + step] = per_channel_scales(rows)
        q[start : start + step] = torch.round(rows / scales[start : start + step, None]).clamp(-127, 127)
    return q, scales


def pack(q: torch.Tensor) -> torch.Tensor:
    """The (ceil(N / 16), ceil(K / 4), 64) bytes q + 128 of int8 weights q (N, K), zeros past the edges."""
    n, k = q.shape
    rows, columns = -(-n // TILE) * TILE, -(-k // 4) * 4
    padded = torch.zeros(rows, columns, dtype=torch.int16)
    padded[:n, :k] = q
    as_bytes = (padded + 128).to(torch.uint8).view(rows // TILE, TILE, columns // 4, 4)
    return as_bytes.transpose(1, 2).reshape(rows // TILE, columns // 4, 4 * TILE).contiguous()


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int8 weights (N, K) that `pack` stored."""
    tiles, quads, _ = packed.shape
    q = packed.view(tiles, quads, TILE, 4).transpose(1, 2).reshape(tiles * TILE, quads * 4).to(torch.int16) - 128
    return q[:out_features, :in_features].to(torch.int8)


_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define(
    "w8a8_matmul(Tensor x, Tensor packed, Tensor scales, int out_features, bool portable=False, bool fine=False) "
    "-> Tensor"
)


@torch.library.register_fake("tformer::w8a8_matmul")
def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int, portable=False, fine=False):
    return x.new_empty(x.shape[0], out_features)


def w8a8_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    out_features: int,
    portable: bool = False,
    fine: bool = False,
) -> torch.Tensor:
    """x (M, K) in bf16 or fp32 times the int8 weights `packed` scaled by `scales` (16 ceil(N / 16), float32),
    transposed: (M, N) in x's dtype. `portable` runs the portable loop where the AVX512-VNNI version was built
    (for tests): both give the same numbers. `fine` rounds each row in two steps (`w8a8_formula`)."""
    if not available():
        raise RuntimeError("w8a8_matmul: the W8A8 kernel could not be built here (see the log)")
    return torch.ops.tformer.w8a8_matmul(x, packed, scales, out_features, portable, fine)


def w8a8_formula(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fine: bool = False) -> torch.Tensor:
    """s_x s_w (q_x q_w^T) in torch (fp32), for x (M, K), q (N, K) int8 and scales (N,): the kernel's result where
    it cannot run, up to the order of the float products. With `fine` each row is rounded in two steps, the
    remainder in steps FINE times smaller: x ≈ s_x (q_x + r_x / FINE), r_x = round(FINE (x / s_x - q_x))."""
    flat = x.float()
    largest = flat.abs().amax(1, keepdim=True)
    inverse = torch.where(largest > 0, torch.full_like(largest, 127).div(largest), 0)  # `127 / t` is 127 * (1 / t)
    scaled = flat * inverse
    rounded = torch.round(scaled)
    q_x = rounded.clamp(-127, 127)
    if fine:
        q_x = q_x + torch.round((scaled - rounded) * FINE).clamp(-127, 127) / FINE
    return (q_x @ q.float().T) * (largest / 127 * scales[:, None].T)


class W8A8Linear(nn.Module):
    """y = s_x s_w (q_x q_w^T) + b from a float layer: int8 weights per output channel, int8 activations per token.

    With `fine`, each token is rounded in two steps (`w8a8_formula`): twice the integer work, for activations held
    to 1/(127 * 254) of their largest. SmolLM2-135M's John 1 perplexity: see docs/engine.md. Activations enter and
    leave in the model's dtype."""

    def __init__(self, linear: nn.Linear, fine: bool = False) -> None:
        super().__init__()
        self.fine = fine
        self._hold(*quantize_rows(linear.weight.detach().float().cpu()), linear.bias)
        self.to(linear.weight.device)

    def _hold(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Keeps int8 weights q (N, K) with their float scales (N,), packed."""
        self._hold_packed(pack(q), scales, q.shape[1], bias)

    def _hold_packed(self, packed: torch.Tensor, scales: torch.Tensor, in_features: int, bias: torch.Tensor | None):
        """Keeps weights already packed (`pack`) with the float scales (N,) of their N rows."""
        self.out_features, self.in_features = scales.shape[0], in_features
        padded_scales = torch.zeros(-(-self.out_features // TILE) * TILE)
        padded_scales[: self.out_features] = scales
        self.register_buffer("packed", packed)
        self.register_buffer("scale_bits", padded_scales.view(torch.int32))  # bits: `.to(bfloat16)` leaves them
        self.bias = bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows `ids` (any shape; the result is ids.shape + (in_features,)), read from the
        packed bytes: exactly `dequantized()[ids]` without dequantizing the rest (a tied embedding's lookup)."""
        tiles, quads, _ = self.packed.shape
        flat = ids.reshape(-1)
        grouped = self.packed.view(tiles, quads, TILE, 4)[flat // TILE, :, flat % TILE]  # (n, quads, 4)
        q = grouped.reshape(flat.shape[0], quads * 4)[:, : self.in_features].to(torch.int16) - 128
        return (q.float() * self.scales[flat, None]).reshape(*ids.shape, self.in_features)

    @property
    def scales(self) -> torch.Tensor:
        """The float32 scale of each output row (zeros past the last, up to a multiple of 16)."""
        return self.scale_bits.view(torch.float32)

    def quantized_weight(self) -> torch.Tensor:
        return unpack(self.packed, self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        return self.quantized_weight().float() * self.scales[: self.out_features, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if dispatch.native(flat.device) and flat.dtype in KERNEL_DTYPES and available():
            out = torch.ops.tformer.w8a8_matmul(flat, self.packed, self.scales, self.out_features, False, self.fine)
        else:
            scales = self.scales[: self.out_features]
            out = w8a8_formula(flat, self.quantized_weight().to(flat.device), scales, self.fine).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias
