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

from tformer.kernels import native
from tformer.kernels.kquant import BLOCK, TILE, KQuantLinear, define_matmul, rounded_activations

SUB = 32  # columns per sub-scale and minimum
SCALES, MINS, HALVES = 2048, 2176, 2304  # where a chunk's sub-scales, minimums and fp16 d (then dmin) start
CHUNK = HALVES + 4 * TILE  # 2368 bytes
BLOCK_BYTES = 144  # a Q4_K super-block in the file: fp16 d and dmin, 12 bytes of 6-bit scales and minimums, nibbles

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


q4k_matmul = define_matmul("q4k_matmul", "Q4_K", CHUNK, available)


def q4k_formula(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch (float64): each block of 256 activations rounded in two steps as the
    kernel rounds it, times the dequantized weight. Equal to the kernel up to the order of its float sums."""
    return rounded_activations(x) @ dequantize(packed).double().T


def _pack_blocks(blocks: torch.Tensor, n: int, in_features: int) -> torch.Tensor:
    q, scales, mins, d, dmin = split_blocks(blocks)
    return pack(q.view(n, in_features), scales.reshape(n, -1), mins.reshape(n, -1), d.view(n, -1), dmin.view(n, -1))


class Q4KLinear(KQuantLinear):
    """y = x W^T + b with W held as a GGUF file's Q4_K blocks (`pack`), multiplied on the CPU's integer dot
    products (`q4k_matmul`)."""

    TYPE, BLOCK_BYTES = "Q4_K", BLOCK_BYTES
    pack_blocks = staticmethod(_pack_blocks)
    dequantize = staticmethod(dequantize)
    multiply = staticmethod(torch.ops.tformer.q4k_matmul)
    available = staticmethod(available)
