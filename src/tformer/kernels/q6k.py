"""Q6_K linear layers: llama.cpp's 6-bit K-quant weights, served as the file stores them.

Weights: each row in super-blocks of 256 input columns, w = d * sc * (u - 32) with u in [0, 63], one int8
sub-scale sc per 16 columns and one fp16 d per 256 (llama.cpp's Q6_K: 210 bytes a super-block, 6.5625 bits a
weight). The layer keeps exactly those bits, rearranged for the dot products, so a Q6_K GGUF tensor loads without
requantizing (INT8's one scale a row lost ~0.9% perplexity) and in its own size (INT8 held 8 bits a weight).

Activations: the matmul (`q6k.cpp`) rounds each block of 256 activations of a row to int8 in two steps, as the
INT4 kernel rounds its blocks of 32: x ≈ (254 q_x + r_x) d_x with d_x = max |x| / (127 * 254). A row's super-block
contributes d * d_x Σ_sub sc Σ (u - 32) (254 q_x + r_x); the integer sums run on AVX512-VNNI's `vpdpbusd` with
the unsigned u, the -32 added back from each 16 activations' sum, and are exact in int32 per super-block. Every
output is computed in one fixed order whatever the batch, so a row's result never depends on the other rows
(tested exactly), and the AVX2 (`vpmaddubsw` on u - 32) and portable loops give the very same numbers. With 8 or
more tokens each thread unpacks a tile's 6-bit weights to bytes once and runs every token over them.

Layout: (N / 16, K / 256, 3360) uint8, one chunk per 16 output rows and 256 input columns (`pack`): 8 groups of 32
columns, each 256 bytes of low 4 bits and 128 of high 2 bits; then the 16 x 16 int8 sub-scales (sub-block major),
then the 16 fp16 d. Fused layers join by concatenating chunks. A layer's rows can be read back alone (`rows`),
so a tied Q6_K head serves as the embedding table too. Without a C++ compiler, or off the CPU, the layer
multiplies by its dequantized weight.
"""

from __future__ import annotations

import torch

from tformer.kernels import native
from tformer.kernels.kquant import BLOCK, TILE, KQuantLinear, define_matmul, rounded_activations

SUB = 16  # columns per sub-scale
GROUP = 384  # bytes of 32 columns: 256 of low nibbles, 128 of high bit pairs
SCALES, HALVES = 8 * GROUP, 8 * GROUP + 256  # where a chunk's sub-scales and fp16 d start
CHUNK = HALVES + 2 * TILE  # 3360 bytes
BLOCK_BYTES = 210  # a Q6_K super-block in the file: 128 bytes of low nibbles, 64 of high pairs, 16 scales, fp16 d

# kernel(): the library, which implements `tformer::q6k_matmul` on the CPU once loaded; available(); instructions()
UNAVAILABLE = "the Q6_K kernel is unavailable: Q6_K layers multiply by dequantized weights"
kernel, available, instructions = native.op_library("q6k", UNAVAILABLE)


def split_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u (n, 256) uint8 in [0, 63], sub-scales (n, 16) int8 and d (n,) fp16 of n raw Q6_K blocks (n, 210) uint8,
    read as `gguf.quants` reads them: w = d * sc * (u - 32)."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 32)
    low = torch.stack([ql & 0x0F, ql >> 4], 2)  # (n, half, 2, 64): values 128 h + 64 a + l
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((qh[:, :, None] >> shifts) & 3).reshape(n, 2, 2, 2, 32)  # values 128 h + 32 s + l: (h, s // 2, s % 2, l)
    high = high.reshape(n, 2, 2, 64)  # value 128 h + 64 a + l
    u = low | (high << 4)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    d = blocks[:, 208:210].contiguous().view(torch.float16).reshape(n)
    return u.reshape(n, BLOCK), scales, d


def pack(u: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The (N / 16, K / 256, 3360) chunks of u (N, K) in [0, 63] with int8 sub-scales (N, K / 16) and fp16 d
    (N, K / 256). In group g of a chunk, byte 64 j + 4 r + i holds the low 4 bits of row r's columns 32 g + 4 j + i
    (low nibble) and 32 g + 16 + 4 j + i (high nibble); byte 256 + 64 h + 4 r + i holds the high 2 bits of columns
    32 g + 16 h + 4 j + i at bits 2 j, 2 j + 1, for j = 0 .. 3."""
    n, k = u.shape
    tiles, blocks = n // TILE, k // BLOCK
    values = u.to(torch.uint8).view(tiles, TILE, blocks, 8, 2, 4, 4)  # tile, row, block, group, half, j, i
    values = values.permute(0, 2, 3, 4, 5, 1, 6)  # tile, block, group, half, j, row, i
    nibbles = (values[:, :, :, 0] & 0x0F) | ((values[:, :, :, 1] & 0x0F) << 4)  # (tiles, blocks, 8, 4, 16, 4)
    pairs = values >> 4  # (tiles, blocks, 8, half, j, 16, 4)
    high = pairs[:, :, :, :, 0] | pairs[:, :, :, :, 1] << 2 | pairs[:, :, :, :, 2] << 4 | pairs[:, :, :, :, 3] << 6
    groups = torch.cat([nibbles.reshape(tiles, blocks, 8, 256), high.reshape(tiles, blocks, 8, 128)], -1)
    sub = scales.contiguous().view(torch.uint8).view(tiles, TILE, blocks, BLOCK // SUB).permute(0, 2, 3, 1)
    halves = d.to(torch.float16).view(tiles, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    parts = [groups.reshape(tiles, blocks, 8 * GROUP), sub.reshape(tiles, blocks, 256), halves.view(tiles, blocks, 32)]
    return torch.cat(parts, -1).contiguous()


def unpack(packed: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u (n, K) as int16, int8 sub-scales (n, K / 16) and fp32 d (n, K / 256) that `pack` stored: of every row,
    or with `rows` (n,) of those rows only, read from their tiles alone."""
    if rows is None:
        rows = torch.arange(packed.shape[0] * TILE, device=packed.device)
    chunks, r = packed[rows // TILE], rows % TILE  # (n, blocks, 3360): each row's tile
    n, blocks = rows.shape[0], packed.shape[1]
    pick = torch.arange(n, device=packed.device)
    groups = chunks[:, :, : 8 * GROUP].reshape(n, blocks, 8, GROUP)
    nibbles = groups[..., :256].reshape(n, blocks, 8, 4, TILE, 4)[pick, :, :, :, r]  # (n, blocks, 8, j, i)
    high = groups[..., 256:].reshape(n, blocks, 8, 2, TILE, 4)[pick, :, :, :, r]  # (n, blocks, 8, half, i)
    low = torch.stack([nibbles & 0x0F, nibbles >> 4], 3)  # (n, blocks, 8, half, j, i)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device).view(1, 1, 1, 1, 4, 1)
    pairs = (high[:, :, :, :, None] >> shifts) & 3  # (n, blocks, 8, half, j, i)
    u = (low | pairs << 4).reshape(n, blocks * BLOCK).to(torch.int16)
    scales = chunks[:, :, SCALES:HALVES].reshape(n, blocks, BLOCK // SUB, TILE)[pick, :, :, r]
    d = chunks[:, :, HALVES:].contiguous().view(torch.float16).reshape(n, blocks, TILE)[pick, :, r]
    return u, scales.contiguous().view(torch.int8).reshape(n, -1), d.float()


def dequantize(packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight rows (all, or `rows`) the chunks stand for: (d * sc) * (u - 32), the products in the order
    `gguf.quants` computes them, so the numbers are its own bit for bit."""
    u, scales, d = unpack(packed, rows)
    n = u.shape[0]
    factor = d.repeat_interleave(BLOCK // SUB, 1) * scales.float()  # (n, K / 16)
    return ((u - 32).float().view(n, -1, SUB) * factor[..., None]).view(n, -1)


q6k_matmul = define_matmul("q6k_matmul", "Q6_K", CHUNK, available)


def q6k_formula(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch (float64): each block of 256 activations rounded in two steps as the
    kernel rounds it, times the dequantized weight. Equal to the kernel up to the order of its float sums."""
    return rounded_activations(x) @ dequantize(packed).double().T


def _pack_blocks(blocks: torch.Tensor, n: int, in_features: int) -> torch.Tensor:
    u, scales, d = split_blocks(blocks)
    return pack(u.view(n, in_features), scales.reshape(n, -1), d.view(n, -1))


class Q6KLinear(KQuantLinear):
    """y = x W^T + b with W held as a GGUF file's Q6_K blocks (`pack`), multiplied on the CPU's integer dot
    products (`q6k_matmul`)."""

    TYPE, BLOCK_BYTES = "Q6_K", BLOCK_BYTES
    pack_blocks = staticmethod(_pack_blocks)
    dequantize = staticmethod(dequantize)
    multiply = staticmethod(torch.ops.tformer.q6k_matmul)
    available = staticmethod(available)
