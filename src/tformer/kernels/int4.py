"""INT4 linear layers, multiplied on the CPU's integer dot-product units as llama.cpp multiplies its Q4_1 files.

Weights: each row in blocks of 32 input columns, w ≈ q * scale + minimum with q in [0, 15] and one fp16 scale and
minimum per block (llama.cpp's Q4_1 exactly, so a Q4_1 GGUF file loads as it is). Groups of 64 or more columns keep
one scale and minimum per group, repeated in each of its blocks.

Activations: the matmul (`int4.cpp`) rounds each block of 32 activations of a row to int8 in two steps,
x ≈ (254 q_x + r_x) d with d = max |x| / (127 * 254): q_x as llama.cpp's Q8_1 rounds, r_x the remainder in steps
254 times finer. A row's block contributes scale * d * Σ q (254 q_x + r_x) + minimum * Σ x, the last sum over the
float activations. The integer sums run on AVX512-VNNI's `vpdpbusd`: one instruction multiplies 64 4-bit weights
by 64 int8 activations. Every output is computed in the same order whatever the batch, so a row's result never
depends on the other rows (tested exactly). Two steps keep SmolLM2-135M's perplexity at float activations', which
one step alone raises (docs/design-notes.md, "kernels/int4.py").

Layout: (N / 16, K / 32, 320) uint8, one 320-byte chunk per 16 output rows and 32 input columns: 256 bytes of
weights arranged for the dot products (`pack`), then the 16 scales and the 16 minimums in fp16. Fused layers
join by concatenating chunks. It is faster than torch's own packed INT4 kernel (`_weight_int4pack_mm_for_cpu`,
bf16 activations), most of all at many rows, and took the engine's batch-1 INT4 decoding from behind llama.cpp to
ahead of it (docs/design-notes.md, "kernels/int4.py"). Without
AVX512-VNNI, on AVX2 (AMD's Zen 3), the same format runs on `vpmaddubsw` (32 products an instruction), else on a
portable loop; without a C++ compiler, or off the CPU, the layer multiplies by its dequantized weight.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tformer.config import ConfigError
from tformer.kernels import dispatch, native
from tformer.kernels.fusion import concat_bias

TILE, BLOCK, CHUNK = 16, 32, 320  # output rows and input columns a chunk holds, and its bytes
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


# kernel(): the library, which implements `tformer::int4_matmul` on the CPU once loaded; available(); instructions()
UNAVAILABLE = "the INT4 kernel is unavailable: INT4 layers multiply by dequantized weights"
kernel, available, instructions = native.op_library("int4", UNAVAILABLE)


def pack(q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """The (N / 16, K / 32, 320) chunks of q (N, K) in [0, 15] with scales and minimums (N, K / 32).

    Byte 64 j + 4 r + i of a chunk's weights holds row r's columns 4 j + i (low 4 bits) and 16 + 4 j + i (high 4
    bits): a 64-byte load gives each of 16 lanes one row's 4 consecutive weights, which `vpdpbusd` multiplies by
    4 activations."""
    n, k = q.shape
    tiles, blocks = n // TILE, k // BLOCK
    nibbles = q.to(torch.uint8).view(tiles, TILE, blocks, 2, 4, 4)  # tile, row, block, half, j, i
    weights = (nibbles[:, :, :, 0] | nibbles[:, :, :, 1] << 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)

    def halves(values: torch.Tensor) -> torch.Tensor:
        per_chunk = values.to(torch.float16).view(tiles, TILE, blocks).transpose(1, 2).contiguous()
        return per_chunk.view(torch.uint8).view(tiles, blocks, 2 * TILE)

    return torch.cat([weights, halves(scales), halves(minimums)], -1).contiguous()


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, K) as int64, and the fp32 scales and minimums (N, K / 32) that `pack` stored."""
    tiles, blocks, _ = packed.shape
    weights = packed[..., :256].reshape(tiles, blocks, 4, TILE, 4).permute(0, 3, 1, 2, 4).long()
    q = torch.stack([weights & 15, weights >> 4], 3).reshape(tiles * TILE, blocks * BLOCK)

    def floats(start: int) -> torch.Tensor:
        halves = packed[..., start : start + 2 * TILE].contiguous().view(torch.float16).float()
        return halves.transpose(1, 2).reshape(tiles * TILE, blocks)

    return q, floats(256), floats(256 + 2 * TILE)


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 weight (N, K) the chunks stand for: q * scale + minimum."""
    q, scales, minimums = unpack(packed)
    return (q.float().unflatten(1, (-1, BLOCK)) * scales[..., None] + minimums[..., None]).flatten(1)


_LIBRARY = torch.library.Library("tformer", "FRAGMENT")
_LIBRARY.define("int4_matmul(Tensor x, Tensor packed, int out_features, bool portable=False) -> Tensor")
_LIBRARY.define(
    "int4_grouped_matmul(Tensor x, Tensor[] packed, int[] counts, int out_features, bool portable=False) -> Tensor"
)


@torch.library.register_fake("tformer::int4_matmul")
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int, portable: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("tformer::int4_grouped_matmul")
def _(
    x: torch.Tensor, packed: list[torch.Tensor], counts: list[int], out_features: int, portable: bool = False
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """x (M, K) in bf16 or fp32 times the weight the chunks stand for, transposed: (M, N), in x's dtype. `portable`
    runs the portable loop where the AVX512-VNNI version was built (for tests); both round activations alike.
    N goes to the op as a number: a compiled graph with dynamic shapes then knows it, where the chunks' count
    would be a symbol (and a fused layer's output could not be split in halves)."""
    if not available():
        raise RuntimeError("int4_matmul: the INT4 kernel could not be built here (see the log)")
    return torch.ops.tformer.int4_matmul(x, packed, packed.shape[0] * TILE, portable)


def int4_grouped_matmul(
    x: torch.Tensor, packed: list[torch.Tensor], counts: list[int], portable: bool = False
) -> torch.Tensor:
    """Groups of rows of x (M, K), each times its own weight: the first counts[0] rows times the weight packed[0]
    stands for (transposed), the next counts[1] times packed[1], and so on; (M, N) in x's dtype. Every row's numbers
    are those of `int4_matmul` on its group alone, but the activations are rounded in one pass and all groups run in
    one parallel region: a mixture's experts over the tokens routed to each, in one call."""
    if not available():
        raise RuntimeError("int4_grouped_matmul: the INT4 kernel could not be built here (see the log)")
    return torch.ops.tformer.int4_grouped_matmul(x, packed, counts, packed[0].shape[0] * TILE, portable)


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4-bit blocks (`pack`), quantized from a float layer in groups of `group_size`."""

    def __init__(self, linear: nn.Linear, group_size: int = 32) -> None:
        super().__init__()
        _check_shape(*linear.weight.shape, group_size)
        self._hold(_pack_floats(linear.weight.detach().float().cpu(), group_size), linear.bias, group_size)
        self.to(linear.weight.device)

    @classmethod
    def from_groups(
        cls, q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int4Linear:
        """A layer from weights already quantized to w = q * scale + minimum, q in [0, 15], in groups along the
        input dimension: q (out, in), scales and minimums (out, in / group_size). llama.cpp's Q4_1 blocks are
        exactly this with groups of 32, so a Q4_1 GGUF file becomes INT4 without a round trip through float."""
        out_f, in_f = q.shape
        group_size = in_f // max(scales.shape[1], 1)
        if scales.shape != minimums.shape or scales.shape[0] != out_f or group_size * scales.shape[1] != in_f:
            raise ConfigError(
                f"int4 groups do not fit: q is {list(q.shape)}, scales {list(scales.shape)} and minimums "
                f"{list(minimums.shape)}; both need (out, in / group_size)"
            )
        _check_shape(out_f, in_f, group_size)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(pack(q, *_per_block(scales.float(), minimums.float(), group_size)), bias, group_size)
        return layer

    @classmethod
    def from_chunks(
        cls, chunks: Iterable[torch.Tensor], group_size: int = 32, bias: torch.Tensor | None = None
    ) -> Int4Linear:
        """A layer quantized from a float weight handed over as chunks of whole rows, each a multiple of 16 rows,
        so that no float copy of the whole weight need exist (a GGUF file's Q3_K blocks, say, dequantized a few rows
        at a time). Each chunk is quantized and packed exactly as the constructor does a whole weight."""
        packed = []
        for chunk in chunks:
            _check_shape(chunk.shape[0], chunk.shape[1], group_size)
            packed.append(_pack_floats(chunk.float(), group_size))
        if not packed:
            raise ConfigError("Int4Linear.from_chunks got no rows; pass the weight's rows in chunks of 16 or more")
        if len({p.shape[1] for p in packed}) != 1:
            raise ConfigError("Int4Linear.from_chunks got chunks of different widths; every row has in_features")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(torch.cat(packed), bias, group_size)
        return layer

    def _hold(self, packed: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> None:
        self.register_buffer("packed", packed)
        self.bias = bias
        self.out_features, self.in_features = packed.shape[0] * TILE, packed.shape[1] * BLOCK
        self.group_size = group_size

    @classmethod
    def concatenated(cls, parts: list[Int4Linear]) -> Int4Linear:
        """One layer with the output rows of `parts` in order: their chunks joined as they are."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        packed = torch.cat([part.packed for part in parts])
        layer._hold(packed, concat_bias(parts), min(part.group_size for part in parts))
        return layer

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.packed)

    @staticmethod
    def grouped(layers: list[nn.Module], x: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """The first counts[0] rows of x (M, K) through layers[0], the next counts[1] through layers[1], ...: (M, N)
        in one kernel call (`int4_grouped_matmul`), each row as its layer's forward gives it; None where that call
        does not apply (another kind of layer, other shapes, biases, or no kernel), for the caller to run each."""
        if not (dispatch.native(x.device) and x.dtype in KERNEL_DTYPES and x.dim() == 2 and available()):
            return None
        packed = []
        for layer in layers:
            if type(layer) is not Int4Linear or layer.bias is not None:
                return None
            weight = layer.packed
            if weight.shape != (packed or [weight])[0].shape or not weight.is_contiguous():
                return None
            packed.append(weight)
        return torch.ops.tformer.int4_grouped_matmul(x, packed, counts, layers[0].out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if dispatch.native(flat.device) and flat.dtype in KERNEL_DTYPES and available():
            out = torch.ops.tformer.int4_matmul(flat, self.packed, self.out_features)
        else:
            out = F.linear(flat, self.dequantized().to(device=flat.device, dtype=flat.dtype))
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, K) uint8 in [0, 15], scales and minimums (N, K / group_size) of a float weight (N, K): each group's
    range from its smallest to its largest value in 15 equal steps."""
    out_f, in_f = weight.shape
    groups = weight.view(out_f, in_f // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-6)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    return q.view(out_f, in_f).to(torch.uint8), scales, low


def _pack_floats(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    q, scales, minimums = quantize_groups(weight, group_size)
    return pack(q, *_per_block(scales, minimums, group_size))


def _check_shape(out_f: int, in_f: int, group_size: int) -> None:
    if in_f % group_size or group_size % BLOCK or out_f % TILE or not out_f or not in_f:
        raise ConfigError(
            f"int4 needs in_features divisible by group_size (a multiple of {BLOCK}) and out_features by "
            f"{TILE}; got a {out_f}x{in_f} weight with group_size {group_size}"
        )


def _per_block(scales: torch.Tensor, minimums: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and minimums per group, repeated for each block of 32 columns the group spans."""
    repeats = group_size // BLOCK
    return scales.repeat_interleave(repeats, 1), minimums.repeat_interleave(repeats, 1)
