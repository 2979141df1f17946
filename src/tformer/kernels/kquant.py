"""What the layers that serve a GGUF file's K-quant blocks as stored share (Q4_K in `q4k.py`, Q6_K in `q6k.py`):
chunks of 16 output rows by one 256-column super-block, activations rounded in two int8 steps per 256 (the
kernels' `FINE`), the same checks, the same float fallback and the same layer around a type's own layout."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tformer.errors import ConfigError
from tformer.kernels import dispatch
from tformer.kernels.fusion import concat_bias

TILE, BLOCK = 16, 256  # output rows a chunk holds, input columns (a super-block)
FINE = 254  # the activations' second rounding: steps per step of the first
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape can be held in chunks (whole tiles of 16 rows, whole super-blocks)."""
    return out_features > 0 and in_features > 0 and out_features % TILE == 0 and in_features % BLOCK == 0


def check_operands(op: str, x: torch.Tensor, packed: torch.Tensor, chunk: int) -> None:
    """A ConfigError unless x is (M, K) and packed (N / 16, K / 256, chunk) bytes."""
    if x.dim() != 2 or packed.dim() != 3 or x.shape[1] != packed.shape[1] * BLOCK or packed.shape[2] != chunk:
        raise ConfigError(
            f"{op} needs x (M, K) and chunks (N / {TILE}, K / {BLOCK}, {chunk}); got x {list(x.shape)} and "
            f"chunks {list(packed.shape)}"
        )


_LIBRARY = torch.library.Library("tformer", "FRAGMENT")


def _output_like(x: torch.Tensor, packed: torch.Tensor, out_features: int, portable: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)  # the op's output, for compiled graphs


def define_matmul(
    name: str, kind: str, chunk: int, available: Callable[[], bool]
) -> Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]:
    """Defines the op `tformer::<name>(x, packed, out_features, portable)`, whose CPU code the type's C++ kernel
    registers, and gives its checked entry `<name>(x, packed, portable=False)`: x (M, K) in bf16 or fp32 times the
    weight the chunks stand for, transposed, (M, N) in x's dtype; `portable` runs the portable loop where a
    vectorized one was built (for tests): the same numbers."""
    _LIBRARY.define(f"{name}(Tensor x, Tensor packed, int out_features, bool portable=False) -> Tensor")
    torch.library.register_fake(f"tformer::{name}")(_output_like)
    op = getattr(torch.ops.tformer, name)

    def matmul(x: torch.Tensor, packed: torch.Tensor, portable: bool = False) -> torch.Tensor:
        if not available():
            raise RuntimeError(f"{name}: the {kind} kernel could not be built here (see the log)")
        check_operands(name, x, packed, chunk)
        return op(x, packed, packed.shape[0] * TILE, portable)

    matmul.__name__ = matmul.__qualname__ = name
    matmul.__doc__ = define_matmul.__doc__
    return matmul


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the kernels round it, in float64: each block of 256 scaled to 127 / max |x| in float32, rounded,
    and the remainder rounded again in steps FINE times finer."""
    flat = x.double().view(x.shape[0], -1, BLOCK)
    largest = flat.abs().amax(-1, keepdim=True).float()
    inverse = torch.where(largest > 0, torch.full_like(largest, 127).div(largest), 0)
    scaled = flat.float() * inverse  # in float32, as the kernels scale
    coarse = torch.round(scaled).clamp(-127, 127)
    fine = torch.round((scaled - coarse) * FINE).clamp(-127, 127)
    d = largest / (127 * FINE)
    return ((coarse * FINE + fine).double() * d.double()).view(x.shape[0], -1)


class KQuantLinear(nn.Module):
    """y = x W^T + b with W held as a GGUF file's blocks of one K-quant type, rearranged into chunks. A subclass
    names its type and block size and gives its layout's pack, dequantize and kernel."""

    TYPE: str  # the GGUF type, for messages: "Q4_K"
    BLOCK_BYTES: int  # one super-block's bytes in the file

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.bias = bias
        self.out_features, self.in_features = packed.shape[0] * TILE, packed.shape[1] * BLOCK

    @staticmethod
    def pack_blocks(blocks: torch.Tensor, n: int, in_features: int) -> torch.Tensor:
        """The chunks of n rows' raw blocks (n * in_features / 256, BLOCK_BYTES)."""
        raise NotImplementedError

    @staticmethod
    def dequantize(packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight rows (all, or `rows`) the chunks stand for."""
        raise NotImplementedError

    multiply: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # the op, as (x, packed, out_features)
    available: Callable[[], bool]  # whether the op's library was built here

    @classmethod
    def from_blocks(
        cls, blocks: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None = None, name: str = "weight"
    ) -> KQuantLinear:
        """A layer from a weight's raw blocks, one row of K / 256 blocks per output row: (N, K / 256 * BLOCK_BYTES)
        uint8 for shape (N, K) = (out, in). N must be a multiple of 16 and K of 256 (`fits`); `name` is the
        weight's, for the error."""
        out_f, in_f = shape
        if not fits(out_f, in_f) or tuple(blocks.shape) != (out_f, in_f // BLOCK * cls.BLOCK_BYTES):
            raise ConfigError(
                f"{name}: a {cls.TYPE} layer needs out_features a multiple of {TILE}, in_features of {BLOCK} and "
                f"(out, in / {BLOCK} * {cls.BLOCK_BYTES}) uint8 bytes of blocks; got shape {list(shape)} and blocks "
                f"{list(blocks.shape)}"
            )
        packed = []
        step = max(TILE, (1 << 22) // max(in_f, 1) // TILE * TILE)  # about 4M weights at a time: small temporaries
        for start in range(0, out_f, step):
            rows = blocks[start : start + step]
            packed.append(cls.pack_blocks(rows.reshape(-1, cls.BLOCK_BYTES), rows.shape[0], in_f))
        return cls(torch.cat(packed) if len(packed) > 1 else packed[0], bias)

    @classmethod
    def concatenated(cls, parts: list[KQuantLinear]) -> KQuantLinear:
        """One layer with the output rows of `parts` in order: their chunks joined as they are."""
        return cls(torch.cat([part.packed for part in parts]), concat_bias(parts))

    def dequantized(self) -> torch.Tensor:
        return self.dequantize(self.packed)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows `ids` (any shape; the result is ids.shape + (in_features,)), read from their
        tiles alone: exactly `dequantized()[ids]` (a tied embedding's lookup)."""
        flat = ids.reshape(-1).to(self.packed.device)
        return self.dequantize(self.packed, flat).reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ConfigError(
                f"a {self.TYPE} layer of {self.in_features} input features got an input of shape {list(x.shape)}; "
                f"its last dimension must be {self.in_features}"
            )
        flat = x.reshape(-1, self.in_features)
        if dispatch.native(flat.device) and flat.dtype in KERNEL_DTYPES and self.available():
            out = self.multiply(flat, self.packed, self.out_features)
        else:
            out = F.linear(flat, self.dequantized().to(device=flat.device, dtype=flat.dtype))
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias
