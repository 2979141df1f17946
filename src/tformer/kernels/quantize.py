"""Quantization of a model's linear layers: INT8 per output channel and INT4 in groups (their activations held
close to the float ones), and W8A8 (INT8 weights and INT8 activations).

INT8: w ≈ q * s with q in [-127, 127] and one scale s per output row (s = max|w_row| / 127). On the CPU the matmul
is tformer's W8A8 kernel with each token's activations rounded in two int8 steps (`W8A8Linear(fine=True)`): to
1/(127 * 254) of the token's largest, 3e-5 of the largest output where bf16 activations give 4e-3. Torch's
weight-only kernel (`_weight_int8pack_mm`) was slower with bf16 activations, and far slower with fp32
(docs/design-notes.md, "kernels/quantize.py"). Elsewhere the same formula runs in torch (`w8a8.w8a8_formula`).
INT4: each group of `group_size` input weights of a row keeps a scale and a minimum, w ≈ q * s + m with q in
[0, 15] (llama.cpp's Q4_1), multiplied on the CPU's integer dot-product units (`int4.Int4Linear`).
W8A8 quantizes each token's activations to int8 in one step as it enters a layer (`w8a8.W8A8Linear`): half the
integer work of INT8's two steps, and activations held to 1/127 of their largest.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tformer.config import ConfigError
from tformer.kernels.elementwise import use_fused_elementwise
from tformer.kernels.fp8 import Fp8Linear
from tformer.kernels.fusion import concat_bias, fuse_projections
from tformer.kernels.int4 import Int4Linear
from tformer.kernels.q4k import Q4KLinear
from tformer.kernels.q6k import Q6KLinear
from tformer.kernels.w8a8 import TILE, W8A8Linear, pack, quantize_rows

QUANT_MODES = ("int8", "int4", "w8a8", "fp8")


class Int8Linear(W8A8Linear):
    """y = x (q * s)^T + b with int8 q (out, in) and float scales s (out,); each token's activations are rounded
    in two int8 steps on their way into the integer matmul (see the module's docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, fine=True)

    @classmethod
    def from_chunks(cls, chunks: Iterable[torch.Tensor], bias: torch.Tensor | None = None) -> Int8Linear:
        """A layer quantized from a float weight handed over as chunks of whole rows, so that no float copy of the
        whole weight need exist (a GGUF file's blocks, dequantized a few rows at a time); the scales are per row,
        so the numbers are those of the constructor on the whole weight. Chunks of a multiple of 16 rows (but the
        last) are packed as they come, so that not even an int8 copy of the whole weight is made on the way (a
        tied head of 128,256 rows: 0.26 GB each)."""
        packed, scales, width = [], [], None
        for chunk in chunks:
            if width not in (None, chunk.shape[1]) or (packed and packed[-1].shape[0] * TILE != len(scales[-1])):
                raise ConfigError(
                    "Int8Linear.from_chunks needs chunks of whole rows, all in_features wide, each but the last "
                    f"a multiple of {TILE} rows"
                )
            width = chunk.shape[1]
            q, s = quantize_rows(chunk.float())
            packed.append(pack(q))
            scales.append(s)
        if not packed:
            raise ConfigError("Int8Linear.from_chunks needs one or more chunks of rows, all in_features wide")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.fine = True
        layer._hold_packed(torch.cat(packed) if len(packed) > 1 else packed[0], torch.cat(scales), width, bias)
        return layer

    @classmethod
    def concatenated(cls, parts: list[Int8Linear]) -> Int8Linear:
        """One layer with the output rows of `parts` in order (fusion's q/k/v and gate/up): each row keeps its
        int8 weights and scale, so it computes what it did in its own layer."""
        q = torch.cat([part.quantized_weight() for part in parts])
        scales = torch.cat([part.scales[: part.out_features] for part in parts])
        return cls._held(q, scales, concat_bias(parts))

    @classmethod
    def _held(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.fine = True
        layer._hold(q, scales.float(), bias)
        return layer


class RowsEmbedding(nn.Module):
    """A token embedding that looks its rows up in a quantized layer's weights (the output head it is tied to:
    INT8, or a GGUF file's Q6_K blocks), so one copy of the table serves both: each gathered row dequantized
    (`W8A8Linear.rows`, `Q6KLinear.rows`), in the model's dtype.

    The layer is held by reference, not as a submodule, so that it is moved, cast and counted once, as the head.
    `weight` is an empty (0, d) tensor in the model's float dtype: what the stack and the engine read a table's
    dtype and device from."""

    def __init__(self, head: W8A8Linear | Q6KLinear) -> None:
        super().__init__()
        self.__dict__["head"] = head
        self.register_buffer("weight", torch.empty(0, head.in_features))
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids).to(self.weight.dtype)


def tie_quantized_embeddings(model: nn.Module, heads: dict[int, W8A8Linear | Q6KLinear]) -> None:
    """Replaces each nn.Embedding whose weight is a key of `heads` (the id of a tied head's float weight) by a
    `RowsEmbedding` over that head's quantized rows, and drops the float table with it."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Embedding) and id(child.weight) in heads:
                setattr(module, name, RowsEmbedding(heads[id(child.weight)]))


def _check_mode(mode: str) -> None:
    if mode not in QUANT_MODES:
        raise ConfigError(f"unknown quantization mode {mode!r}; choose one of: {', '.join(QUANT_MODES)}")


def quantize(model: nn.Module, mode: str = "int8", group_size: int = 32) -> nn.Module:
    """Replaces every nn.Linear of `model` in place (the output head too); returns the model.

    Embedding tables stay in floating point, but for one tied to an output head that becomes INT8: it then looks
    its rows up in the head's INT8 weights (`RowsEmbedding`), which drops the float copy (a third of a
    Llama-3.2-1B Q4_K_M model's bytes). A layer whose shape INT4's kernel cannot take stays as it is.
    With INT4 the output head (`lm_head`) gets INT8 weights (`Int8Linear`), as llama.cpp's 4-bit files keep their
    output matrix at 8 bits or more: faster than torch's weight-only INT8 kernel at the same perplexity, which an
    INT4 head or groups of 64 raise; the GGUF's Q4_1 blocks hold 32 weights (docs/design-notes.md,
    "kernels/quantize.py").
    """
    _check_mode(mode)
    int8_heads: dict[int, W8A8Linear] = {}  # id of a float weight -> the INT8 layer made of it
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            if mode == "w8a8":
                layer = W8A8Linear(child)
            elif mode == "fp8":
                layer = Fp8Linear(child)
            elif mode == "int8" or (module is model and child_name == "lm_head"):
                layer = Int8Linear(child)
            elif child.in_features % group_size == 0 and child.out_features % 16 == 0:
                layer = Int4Linear(child, group_size)
            else:
                continue
            setattr(module, child_name, layer)
            if isinstance(layer, Int8Linear):
                int8_heads[id(child.weight)] = layer
    tie_quantized_embeddings(model, int8_heads)
    return model


WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_precision(dtype: str = "auto", quantize_mode: str | None = None) -> None:
    """Raises ConfigError for a dtype or quantization `set_precision` cannot apply (call it before a slow load)."""
    if dtype != "auto" and dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(WEIGHT_DTYPES)}")
    if quantize_mode is not None:
        _check_mode(quantize_mode)


def resolve_dtype(dtype: str, quantize_mode: str | None) -> str:
    """'auto' is float32 for float weights and bfloat16 for quantized ones (half the activation bytes)."""
    if dtype != "auto":
        return dtype
    return "float32" if quantize_mode is None else "bfloat16"


def set_precision(
    model: nn.Module, dtype: str = "auto", quantize_mode: str | None = None, fuse: bool = True
) -> nn.Module:
    """The serving precision of `model`: projections that read one input fused (`fusion.fuse_projections`) and
    the fused elementwise kernels handed to its layers (`elementwise.use_fused_elementwise`), unless `fuse` is
    False; the linear layers quantized (optionally), then every float tensor cast. The model then serves only:
    fused, it no longer trains, loads or saves a checkpoint.

    Decoding reads every weight once a token, so bf16 halves the bytes and decodes faster on a CPU with
    AVX512-BF16 (docs/design-notes.md, "kernels/quantize.py"); INT8 / INT4 quarter / eighth the linear layers' bytes.
    Quantization reads the weights before the cast, so a bf16 INT4 model rounds its fp32 weights only once.
    """
    check_precision(dtype, quantize_mode)
    if fuse:
        fuse_projections(model)
        use_fused_elementwise(model)
    if quantize_mode is not None:
        quantize(model, quantize_mode)
    return model.to(WEIGHT_DTYPES[resolve_dtype(dtype, quantize_mode)])


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, counting tied tensors once."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


# every linear layer that holds its weight quantized, each with `dequantized()`
QUANTIZED_LINEARS = (Int8Linear, Int4Linear, W8A8Linear, Fp8Linear, Q4KLinear, Q6KLinear)


def dequantize_linear(module: nn.Module) -> torch.Tensor:
    """The floating-point weight a quantized linear layer stands for (for tests and error reports)."""
    if isinstance(module, QUANTIZED_LINEARS):
        return module.dequantized()
    if isinstance(module, nn.Linear):
        return module.weight.detach().float()
    raise TypeError(f"{type(module).__name__} is not a linear layer")
