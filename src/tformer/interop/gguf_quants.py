"""ggml's block quantizations dequantized with vectorized torch ops, bit for bit as `gguf.quants` does.

Each function takes the raw blocks of one type as a (n_blocks, block_bytes) uint8 tensor and returns
(n_blocks, block_values) float32. The float operations run in the order `gguf.quants` runs them (d * scale
first, then times the quant, then minus the minimum), so that the results are equal bit for bit; the tests
compare the two on random blocks.

Layouts (ggml-common.h). Blocks of 32 values: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: an f16 scale d (and an f16 minimum
m for the _1 types), the 5th bits (Q5) as 32 bits, then the quants (4-bit ones two to a byte: low nibbles are
elements 0-15, high nibbles 16-31). Super-blocks of 256 values (the K-quants):

- Q2_K (84 bytes): 16 bytes of 4-bit scale and 4-bit minimum per 16 values, 64 bytes of 2-bit quants, f16 d, dmin;
- Q3_K (110 bytes): 32 bytes of high bits, 64 bytes of low 2 bits, 12 bytes packing 16 6-bit scales, f16 d;
- Q4_K (144 bytes): f16 d, dmin, 12 bytes packing 8 6-bit scales and 8 6-bit minimums, 128 bytes of nibbles;
- Q5_K (176 bytes): Q4_K's, with 32 bytes of 5th bits before the nibbles;
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high 2 bits, 16 int8 scales, f16 d.

Q4_0, Q4_1 and Q4_K blocks are also taken apart without any float arithmetic on the weights (`INT4_GROUPS`):
w = q * scale + minimum with q in [0, 15] per group of 32, the form of tformer's INT4 layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as Q

QK_K = 256


def f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Each block's float16 at byte `start`, as float32 of shape (n_blocks, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifted(packed: torch.Tensor, shifts: list[int], width: int, mask: int) -> torch.Tensor:
    """(n, groups * width) bytes -> (n, groups, len(shifts), width): each group of `width` bytes shifted right
    by each of `shifts`, then masked."""
    n = packed.shape[0]
    by = torch.tensor(shifts, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return (packed.reshape(n, -1, 1, width) >> by).bitwise_and_(mask)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 8 k) bits, least significant first (a little-endian bit field)."""
    by = torch.arange(8, dtype=torch.uint8)
    return (packed[:, :, None] >> by).bitwise_and_(1).reshape(packed.shape[0], -1)


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) values: the low nibbles are elements 0-15, the high nibbles 16-31."""
    return _shifted(packed, [0, 4], packed.shape[1], 0x0F).reshape(packed.shape[0], -1)


# Each float result is made once and then scaled in place: a fresh 64 MiB float tensor costs as much in page
# faults as the arithmetic on it, and in-place products round exactly as gguf.quants' d * q - m does.


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(f16_field(blocks, 0))


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return nibbles(blocks[:, 2:]).view(torch.int8).sub_(8).float().mul_(f16_field(blocks, 0))


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return nibbles(blocks[:, 4:]).float().mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 6:]).bitwise_or_(_bits(blocks[:, 2:6]).bitwise_left_shift_(4))
    return q.view(torch.int8).sub_(16).float().mul_(f16_field(blocks, 0))


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 8:]).bitwise_or_(_bits(blocks[:, 4:8]).bitwise_left_shift_(4))
    return q.float().mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _shifted(blocks[:, 16:80], [0, 2, 4, 6], 32, 3).reshape(n, 16, 16).float()
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = _shifted(packed[:, :8], [0, 4], 8, 0x0F).reshape(n, 16)  # scale i's low 4 bits: byte i % 8, nibble i // 8
    high = _shifted(packed[:, 8:], [0, 2, 4, 6], 4, 0x03).reshape(n, 16)  # high 2 bits: byte 8 + i % 4, pair i // 4
    scales = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    dl = (f16_field(blocks, 108) * scales.float()).reshape(n, 16, 1)
    ql = _shifted(qs, [0, 2, 4, 6], 32, 3).reshape(n, 16, 16)
    qh = _shifted(hmask, list(range(8)), 32, 1).reshape(n, 16, 16).bitwise_xor_(1)  # a clear high bit subtracts 4
    q = ql.view(torch.int8).sub_(qh.bitwise_left_shift_(2).view(torch.int8))
    return q.float().mul_(dl).reshape(n, QK_K)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 6-bit scales and 8 6-bit minimums. Bytes 0-3 hold scales 0-3 (and the top
    bits of scales 4-7), bytes 4-7 minimums 0-3 (and the top bits of minimums 4-7), bytes 8-11 the low nibbles
    of scales 4-7 and minimums 4-7."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    minimum = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scale, minimum


def _k_factors(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: each sub-block's d * scale and dmin * minimum, as (n, 8, 1) float32."""
    n = blocks.shape[0]
    scale, minimum = _k_scales(blocks[:, 4:16])
    d = (f16_field(blocks, 0) * scale.float()).reshape(n, 8, 1)
    return d, (f16_field(blocks, 2) * minimum.float()).reshape(n, 8, 1)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dm = _k_factors(blocks)
    q = _shifted(blocks[:, 16:], [0, 4], 32, 0x0F).reshape(n, 8, 32).float()
    return q.mul_(d).sub_(dm).reshape(n, QK_K)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dm = _k_factors(blocks)
    low = _shifted(blocks[:, 48:], [0, 4], 32, 0x0F).reshape(n, 8, 32)
    high = _shifted(blocks[:, 16:48], list(range(8)), 32, 1).reshape(n, 8, 32)
    q = low.bitwise_or_(high.bitwise_left_shift_(4)).float()
    return q.mul_(d).sub_(dm).reshape(n, QK_K)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = (f16_field(blocks, 208) * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _shifted(ql, [0, 4], 64, 0x0F).reshape(n, 8, 32)
    high = _shifted(qh, [0, 2, 4, 6], 32, 0x03).reshape(n, 8, 32)
    q = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    return q.reshape(n, 16, 16).float().mul_(d).reshape(n, QK_K)


# ggml type -> (n_blocks, block_bytes) uint8 -> (n_blocks, block_values) float32
DEQUANTIZERS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: lambda raw: raw.contiguous().view(torch.float32).clone(),
    Q.F16: lambda raw: raw.contiguous().view(torch.float16).float(),
    Q.BF16: lambda raw: raw.contiguous().view(torch.bfloat16).float(),
    Q.Q8_0: q8_0,
    Q.Q4_0: q4_0,
    Q.Q4_1: q4_1,
    Q.Q5_0: q5_0,
    Q.Q5_1: q5_1,
    Q.Q2_K: q2_k,
    Q.Q3_K: q3_k,
    Q.Q4_K: q4_k,
    Q.Q5_K: q5_k,
    Q.Q6_K: q6_k,
}


# INT4 groups: (n_blocks, block_bytes) uint8 -> q (n_blocks, block_values) uint8 in [0, 15], and the scale and
# minimum of each group of 32 values as float32 (n_blocks, block_values / 32), with w = q * scale + minimum, the
# very products `gguf.quants` computes (Q4_0's d (q - 8) is d q + (-8 d), exact in float32).


def q4_0_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = f16_field(blocks, 0)
    return nibbles(blocks[:, 2:]), d, d * -8


def q4_1_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return nibbles(blocks[:, 4:]), f16_field(blocks, 0), f16_field(blocks, 2)


def q4_k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = blocks.shape[0]
    d, dm = _k_factors(blocks)
    q = _shifted(blocks[:, 16:], [0, 4], 32, 0x0F).reshape(n, QK_K)
    return q, d.reshape(n, 8), dm.reshape(n, 8).neg_()


INT4_GROUPS: dict[Q, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    Q.Q4_0: q4_0_groups,
    Q.Q4_1: q4_1_groups,
    Q.Q4_K: q4_k_groups,
}
