"""The W8A8 kernel against the plain formula (int8 weights per channel, int8 activations per token), in its
vectorized and portable versions, at edges that are not multiples of its tiles, inside a compiled graph, and on
bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tformer.kernels import w8a8
from tformer.kernels.w8a8 import W8A8Linear, kernel, pack, unpack, w8a8_formula, w8a8_matmul

pytestmark = pytest.mark.skipif(kernel() is None, reason="no C++ compiler to build the kernel with")


def formula(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fine: bool = False) -> torch.Tensor:
    """In float64: q_x = round(x * 127 / max|x|) per row (rounded in fp32, as the kernel does), then
    s_x s_w (q_x q_w^T) with s_x = max|x| / 127. With `fine`, q_x + r_x / 254 in place of q_x, where
    r_x = round(254 (x * 127 / max|x| - q_x)) in fp32."""
    flat = x.float()
    largest = flat.abs().amax(1, keepdim=True)
    scaled = flat * torch.full_like(largest, 127).div(largest)
    q_x = torch.round(scaled).double()
    if fine:
        q_x += torch.round((scaled - torch.round(scaled)) * 254).double() / 254
    return (q_x @ q.double().T) * (largest.double() / 127) * scales.double()


@pytest.mark.parametrize("fine", [False, True], ids=["one-step", "two-step"])
@pytest.mark.parametrize("portable", [False, True], ids=["vectorized", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 37, 40), (9, 576, 960), (6, 128, 48), (2, 16, 16)])
def test_kernel_matches_the_formula(m: int, k: int, n: int, dtype: torch.dtype, portable: bool, fine: bool) -> None:
    """Shapes with one tile, an odd count of tiles (48 rows), a last tile cut short (40) and columns that are not
    a multiple of 4 (37)."""
    layer = W8A8Linear(nn.Linear(k, n, bias=False))
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    out = w8a8_matmul(x, layer.packed, layer.scales, n, portable, fine)
    assert out.dtype == dtype and out.shape == (m, n)
    expected = formula(x, layer.quantized_weight(), layer.scales[:n], fine)
    if dtype == torch.float32:  # exact integer sums times fp32 scales (two-step: two such products, added in fp32)
        atol = 1e-6 * expected.abs().amax(1, keepdim=True) if fine else 0
        assert ((out.double() - expected).abs() <= 1e-6 * expected.abs() + atol).all()
    else:  # and bf16 rounds the result once
        torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=0)


def test_two_step_calls_of_many_rows_run_in_chunks_and_give_each_rows_own_result() -> None:
    """Over 64 rows the two-step products are computed 64 rows at a time (a bounded scratch)."""
    layer = W8A8Linear(nn.Linear(64, 40, bias=False), fine=True)
    x = torch.randn(150, 64)
    out = layer(x)
    expected = formula(x, layer.quantized_weight(), layer.scales[:40], fine=True)
    atol = 1e-6 * expected.abs().amax(1, keepdim=True)
    assert ((out.double() - expected).abs() <= 1e-6 * expected.abs() + atol).all()
    for row in (0, 63, 64, 127, 128, 149):
        assert torch.equal(layer(x[row : row + 1]), out[row : row + 1])


def test_two_step_rounding_comes_close_to_the_float_product() -> None:
    """The second step holds each activation to 1/(127 * 254) of the row's largest: the error against the product
    with float activations shrinks by two orders of magnitude."""
    layer = W8A8Linear(nn.Linear(576, 960, bias=False))
    x = torch.randn(8, 576)
    exact = x.double() @ layer.dequantized().double().T
    errors = [(w8a8_matmul(x, layer.packed, layer.scales, 960, fine=f).double() - exact).abs().max() for f in (0, 1)]
    assert errors[1] < errors[0] / 100


@pytest.mark.parametrize("fine", [False, True], ids=["one-step", "two-step"])
def test_the_vectorized_and_portable_versions_give_the_same_numbers(fine: bool) -> None:
    layer = W8A8Linear(nn.Linear(200, 80))
    x = torch.randn(7, 200, dtype=torch.bfloat16)
    assert torch.equal(
        w8a8_matmul(x, layer.packed, layer.scales, 80, fine=fine),
        w8a8_matmul(x, layer.packed, layer.scales, 80, True, fine),
    )


@pytest.mark.parametrize("fine", [False, True], ids=["one-step", "two-step"])
def test_a_rows_result_is_its_own_whatever_the_batch(fine: bool) -> None:
    layer = W8A8Linear(nn.Linear(96, 64), fine=fine)
    x = torch.randn(11, 96, dtype=torch.bfloat16)
    together = layer(x)
    for rows in (slice(0, 1), slice(1, 5), slice(3, 10), slice(10, 11)):
        assert torch.equal(layer(x[rows]), together[rows])


def test_pack_and_unpack_are_inverses() -> None:
    q = torch.randint(-127, 128, (40, 37), dtype=torch.int8)
    packed = pack(q)
    assert packed.shape == (3, 10, 64) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, 40, 37), q)


@pytest.mark.parametrize("fine", [False, True], ids=["one-step", "two-step"])
def test_kernel_is_an_op_a_compiled_graph_calls(fine: bool) -> None:
    layer = W8A8Linear(nn.Linear(64, 48), fine=fine)
    x = torch.randn(5, 64)
    torch.library.opcheck(torch.ops.tformer.w8a8_matmul.default, (x, layer.packed, layer.scales, 48, False, fine))
    compiled = torch.compile(lambda a: layer(a) * 2, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x), layer(x) * 2)


@pytest.mark.parametrize("fine", [False, True], ids=["one-step", "two-step"])
def test_a_nan_reaches_its_own_rows_output_only(fine: bool) -> None:
    layer = W8A8Linear(nn.Linear(64, 32))
    x = torch.randn(3, 64)
    x[1, 40] = float("nan")
    for portable in (False, True):
        out = w8a8_matmul(x, layer.packed, layer.scales, 32, portable, fine)
        assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_no_rows_give_no_rows() -> None:
    layer = W8A8Linear(nn.Linear(64, 32))
    assert layer(torch.randn(0, 64)).shape == (0, 32)


def test_bad_shapes_and_dtypes_are_refused() -> None:
    layer = W8A8Linear(nn.Linear(64, 32))
    with pytest.raises(ValueError, match=r"x \(M, K\), packed uint8"):
        w8a8_matmul(torch.randn(2, 32), layer.packed, layer.scales, 32)
    with pytest.raises(ValueError, match=r"x \(M, K\), packed uint8"):
        w8a8_matmul(torch.randn(2, 64), layer.packed, layer.scales, 48)
    with pytest.raises(ValueError, match="x must be bfloat16 or float32"):
        w8a8_matmul(torch.randn(2, 64, dtype=torch.float64), layer.packed, layer.scales, 32)


@pytest.mark.parametrize("fine", [False, True], ids=["one-step", "two-step"])
def test_without_the_kernel_the_layer_computes_the_formula_in_torch(monkeypatch: pytest.MonkeyPatch, fine) -> None:
    layer = W8A8Linear(nn.Linear(64, 32), fine=fine)
    x = torch.randn(4, 64)
    with_kernel = layer(x)
    monkeypatch.setattr(w8a8, "available", lambda: False)
    without = layer(x)
    expected = w8a8_formula(x, layer.quantized_weight(), layer.scales[:32], fine) + layer.bias
    torch.testing.assert_close(without, expected)
    torch.testing.assert_close(without, with_kernel, rtol=1e-6, atol=1e-6)  # the same numbers, in another order
