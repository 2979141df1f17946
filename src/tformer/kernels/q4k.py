"""Q4_K linear layers: llama.cpp's 4-bit K-quant weights, served as the file stores them.

Weights: each row in super-blocks of 256 input columns, w = d * sc * q - dmin * m with q in [0, 15], one 6-bit
sub-scale sc and one 6-bit minimum m per 32 columns and one fp16 d and dmin per 256 (llama.cpp's Q4_K: 144 bytes
a super-block, 4.5 bits a weight). The layer keeps exactly those numbers, rearranged for the dot products, with
each 6-bit sc and m in a byte of its own: 4.625 bits a weight. The INT4 layer took them as groups of 32 with an fp16
scale and minimum each (5 bits a weight, d * sc rounded to fp16): this one reads 7.5% fewer bytes and is exact.

Activations: the matmul (`q4k.cpp`) rounds each block of 256 activations of a row to int8 in two steps, as the
Q6_K kernel does: x ≈ (254 q_x + r_x) d_x with d_x = max |x| / (127 * 254), and keeps each 32's integer sum.
A row's super-block contributes d d_x Σ_sub sc Σ q q_x - dmin d_x Σ_sub m Σ q_x for each of the two rounded
rows; both integer sums are exact in int32 (`vpdpbusd` on AVX512-VNNI, `vpmaddubsw` on AVX2, a portable loop)
and become floats in one fixed order, so all builds give the same numbers and a row's result never depends on
the other rows (tested exactly).

Layout: (N / 16, K / 256, 2368) uint8, one chunk per 16 output rows and 256 input columns (`pack`): 8 groups of 32
columns, 256 bytes of nibbles each; then the 8 x 16 sub-scales and the 8 x 16 minimums (sub-block major), then the
16 fp16 d and the 16 fp16 dmin. Fused layers join by concatenating chunks. Without a C++ compiler, or off the CPU,
the layer multiplies by its dequantized weight. MoE experts keep the INT4 layer, which multiplies groups of
experts in one call (`Int4Linear.grouped`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tformer.errors import ConfigError
from tformer.kernels import dispatch, native
from tformer.kernels.fusion import concat_bias

TILE, BLOCK, SUB = 16, 256, 32  # output rows a chunk holds, input columns (a super-block), columns per sub-scale
SCALES, MINS, HALVES = 2048, 2176, 2304  # where a chunk's sub-scales, minimums and fp16 d (then dmin) start
CHUNK = HALVES + 4 * TILE  # 2368 bytes
BLOCK_BYTES = 144  # a Q4_K super-block in the file: fp16 d and dmin, 12 bytes of 6-bit scales and minimums, nibbles
FINE = 254  # the activations' second rounding: steps per step of the first
KERNEL_DTYPES = (torch.bfloat16, torch.float32)

# kernel(): the library, which implements `tformer::q4k_matmul` on the CPU once loaded; available(); instructions()
UNAVAILABLE = "the Q4_K kernel is unavailable: Q4_K layers multiply by dequantized weights"
kernel, available, instructions = native.op_library("q4k", UNAVAILABLE)


def split_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (n, 256) uint8 in [0, 15], sub-scales and minimums (n, 8) uint8 in [0, 63], d and dmin (n,) fp16 of n raw
    Q4_K blocks (n, 144) uint8, read as `gguf.quants` reads them: w = d * sc * q - dmin * m."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].contiguous().view(torch.float16).reshape(n)
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).reshape(n)
    low, high, both = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    scales = torch.cat([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], -1)
    mins = torch.cat([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], -1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], 2).reshape(n, BLOCK)  # 32 bytes give sub-blocks 2i (low) and 2i + 1 (high)
    return q, scales, mins, d, dmin


def pack(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """The (N / 16, K / 256, 2368) chunks of q (N, K) in [0, 15] with sub-scales and minimums (N, K / 32) and fp16
    d and dmin (N, K / 256). In group g of a chunk, byte 64 j + 4 r + i holds row r's columns 32 g + 4 j + i (low
    nibble) and 32 g + 16 + 4 j + i (high nibble)."""
    n, k = q.shape
    tiles, blocks = n // TILE, k // BLOCK
    values = q.to(torch.uint8).view(tiles, TILE, blocks, 8, 2, 4, 4)  # tile, row, block, group, half, j, i
    values = values.permute(0, 2, 3, 4, 5, 1, 6)  # tile, block, group, half, j, row, i
    nibbles = (values[:, :, :, 0] & 0x0F) | ((values[:, :, :, 1] & 0x0F) << 4)  # (tiles, blocks, 8, 4, 16, 4)

    def per_sub(v: torch.Tensor) -> torch.Tensor:  # (N, K / 32) -> (tiles, blocks, 128) as [sub][row]
        return v.to(torch.uint8).view(tiles, TILE, blocks, 8).permute(0, 2, 3, 1).reshape(tiles, blocks, 128)

    def halves(v: torch.Tensor) -> torch.Tensor:
        return v.to(torch.float16).view(tiles, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)

    parts = [nibbles.reshape(tiles, blocks, 2048), per_sub(scales), per_sub(mins), halves(d), halves(dmin)]
    return torch.cat(parts, -1).contiguous()


def unpack(
    packed: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (n, K) uint8, sub-scales and minimums (n, K / 32) uint8, fp32 d and dmin (n, K / 256) that `pack` stored:
    of every row, or with `rows` (n,) of those rows only, read from their tiles alone."""
    if rows is None:
        rows = torch.arange(packed.shape[0] * TILE, device=packed.device)
    chunks, r = packed[rows // TILE], rows % TILE  # (n, blocks, 2368): each row's tile
    n, blocks = rows.shape[0], packed.shape[1]
    pick = torch.arange(n, device=packed.device)
    nibbles = chunks[:, :, :SCALES].reshape(n, blocks, 8, 4, TILE, 4)[pick, :, :, :, r]  # (n, blocks, 8, j, i)
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], 3).reshape(n, blocks * BLOCK)
    scales = chunks[:, :, SCALES:MINS].reshape(n, blocks, 8, TILE)[pick, :, :, r].reshape(n, -1)
    mins = chunks[:, :, MINS:HALVES].reshape(n, blocks, 8, TILE)[pick, :, :, r].reshape(n, -1)
    halves = chunks[:, :, HALVES:].contiguous().view(torch.float16).reshape(n, blocks, 2, TILE)[pick, :, :, r]
    return q, scales, mins, halves[:, :, 0].float(), halves[:, :, 1].float()


def dequantize(packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight rows (all, or `rows`) the chunks stand for: (d * sc) * q - dmin * m, in the order
    `gguf.quants` computes them, so the numbers are its own bit for bit."""
    q, scales, mins, d, dmin = unpack(packed, rows)
    n = q.shape[0]
    factor = d.repeat_interleave(BLOCK // SUB, 1) * scales.float()  # (n, K / 32)
    offset = dmin.repeat_interleave(BLOCK // SUB, 1) * mins.float()
    return (q.float().view(n, -1, SUB) * factor[..., None] - offset[..., None]).view(n, -1)


_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("q4k_matmul(Tensor x, Tensor packed, int out_features, bool portable=False) -> Tensor")


@torch.library.register_fake("tformer::q4k_matmul")
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int, portable: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def q4k_matmul(x: torch.Tensor, packed: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """x (M, K) in bf16 or fp32 times the weight the chunks stand for, transposed: (M, N), in x's dtype.
    `portable` runs the portable loop where a vectorized one was built (for tests): the same numbers."""
    if not available():
        raise RuntimeError("q4k_matmul: the Q4_K kernel could not be built here (see the log)")
    if x.dim() != 2 or packed.dim() != 3 or x.shape[1] != packed.shape[1] * BLOCK or packed.shape[2] != CHUNK:
        raise ConfigError(
            f"q4k_matmul needs x (M, K) and chunks (N / {TILE}, K / {BLOCK}, {CHUNK}); got x {list(x.shape)} and "
            f"chunks {list(packed.shape)}"
        )
    return torch.ops.tformer.q4k_matmul(x, packed, packed.shape[0] * TILE, portable)


def q4k_formula(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch (float64): each block of 256 activations rounded in two steps as the
    kernel rounds it, times the dequantized weight. Equal to the kernel up to the order of its float sums."""
    flat = x.double().view(x.shape[0], -1, BLOCK)
    largest = flat.abs().amax(-1, keepdim=True).float()
    inverse = torch.where(largest > 0, torch.full_like(largest, 127).div(largest), 0)
    scaled = flat.float() * inverse  # in float32, as the kernel scales
    coarse = torch.round(scaled).clamp(-127, 127)
    fine = torch.round((scaled - coarse) * FINE).clamp(-127, 127)
    d = largest / (127 * FINE)
    rounded = ((coarse * FINE + fine).double() * d.double()).view(x.shape[0], -1)
    return rounded @ dequantize(packed).double().T


class Q4KLinear(nn.Module):
    """y = x W^T + b with W held as a GGUF file's Q4_K blocks (`pack`), multiplied on the CPU's integer dot
    products (`q4k_matmul`)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.bias = bias
        self.out_features, self.in_features = packed.shape[0] * TILE, packed.shape[1] * BLOCK

    @classmethod
    def from_blocks(
        cls, blocks: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None = None, name: str = "weight"
    ) -> Q4KLinear:
        """A layer from a weight's raw Q4_K blocks, one row of K / 256 blocks per output row: (N, K / 256 * 144)
        uint8 for shape (N, K) = (out, in). N must be a multiple of 16 and K of 256 (`fits`); `name` is the
        weight's, for the error."""
        out_f, in_f = shape
        if not fits(out_f, in_f) or tuple(blocks.shape) != (out_f, in_f // BLOCK * BLOCK_BYTES):
            raise ConfigError(
                f"{name}: a Q4_K layer needs out_features a multiple of {TILE}, in_features of {BLOCK} and "
                f"(out, in / {BLOCK} * {BLOCK_BYTES}) uint8 bytes of blocks; got shape {list(shape)} and blocks "
                f"{list(blocks.shape)}"
            )
        packed = []
        step = max(TILE, (1 << 22) // max(in_f, 1) // TILE * TILE)  # about 4M weights at a time: small temporaries
        for start in range(0, out_f, step):
            rows = blocks[start : start + step]
            n = rows.shape[0]
            q, scales, mins, d, dmin = split_blocks(rows.reshape(-1, BLOCK_BYTES))
            parts = (scales.reshape(n, -1), mins.reshape(n, -1), d.view(n, -1), dmin.view(n, -1))
            packed.append(pack(q.view(n, in_f), *parts))
        return cls(torch.cat(packed) if len(packed) > 1 else packed[0], bias)

    @classmethod
    def concatenated(cls, parts: list[Q4KLinear]) -> Q4KLinear:
        """One layer with the output rows of `parts` in order: their chunks joined as they are."""
        return cls(torch.cat([part.packed for part in parts]), concat_bias(parts))

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.packed)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows `ids` (any shape; the result is ids.shape + (in_features,)), read from their
        tiles alone: exactly `dequantized()[ids]`."""
        flat = ids.reshape(-1).to(self.packed.device)
        return dequantize(self.packed, flat).reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ConfigError(
                f"a Q4_K layer of {self.in_features} input features got an input of shape {list(x.shape)}; its "
                f"last dimension must be {self.in_features}"
            )
        flat = x.reshape(-1, self.in_features)
        if dispatch.native(flat.device) and flat.dtype in KERNEL_DTYPES and available():
            out = torch.ops.tformer.q4k_matmul(flat, self.packed, self.out_features)
        else:
            out = F.linear(flat, self.dequantized().to(device=flat.device, dtype=flat.dtype))
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape can be a Q4KLinear (whole tiles of 16 rows, whole super-blocks)."""
    return out_features > 0 and in_features > 0 and out_features % TILE == 0 and in_features % BLOCK == 0
