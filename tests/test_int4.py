"""The INT4 kernel against the plain formula (Q4_1 weights times Q8_1-rounded activations), batch by batch, in its
vectorized and portable versions, inside a compiled graph, and on bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tformer.kernels import int4
from tformer.kernels.int4 import (
    BLOCK,
    Int4Linear,
    dequantize,
    int4_grouped_matmul,
    int4_matmul,
    kernel,
    pack,
    unpack,
)

pytestmark = pytest.mark.skipif(kernel() is None, reason="no C++ compiler to build the kernel with")


def random_chunks(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=generator)
    scales = (torch.rand(n, k // BLOCK, generator=generator) * 0.02 + 1e-3).half().float()
    minimums = (-torch.rand(n, k // BLOCK, generator=generator) * 0.1).half().float()
    return q, scales, minimums


def formula(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """In float64: each block of 32 activations rounded to two int8 steps, coarse = round(s) for s = x * 127 / max|x|
    and fine = round(254 (s - coarse)) (in fp32, as the kernel rounds), so x ≈ (254 coarse + fine) max|x| / (127 *
    254); times the weights q * scale, plus each block's minimum times the block's sum of float activations."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.full_like(largest, 127).div(largest), 0)  # `127 / t` is 127 * (1 / t)
    scaled = blocks * inverse
    coarse = torch.round(scaled)
    q_x = 254 * coarse + torch.round((scaled - coarse) * 254)
    integer_sums = torch.einsum("mbk,nbk->mnb", q_x.double(), q.view(len(q), -1, BLOCK).double())
    d = (largest / (127 * 254)).double()[..., 0]  # (m, blocks)
    weights = integer_sums * scales.double()[None] * d[:, None]
    return (weights + minimums.double()[None] * blocks.double().sum(-1)[:, None]).sum(-1)


@pytest.mark.parametrize("portable", [False, True], ids=["vectorized", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 32, 16), (3, 576, 960), (6, 128, 48), (37, 64, 32)])
def test_kernel_matches_the_formula(m: int, k: int, n: int, dtype: torch.dtype, portable: bool) -> None:
    q, scales, minimums = random_chunks(n, k)
    x = (torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None]).to(dtype)  # rows of very different sizes
    out = int4_matmul(x, pack(q, scales, minimums), portable)
    assert out.dtype == dtype and out.shape == (m, n)
    expected = formula(x, q, scales, minimums)
    rtol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: the fp32 result rounded once (up to 2^-8 of it)
    for row, expected_row in zip(out.double(), expected, strict=True):  # fp32 sums: an error of ~1e-5 of the row's
        atol = 1e-4 * expected_row.abs().max().item()  # largest output where its terms cancel
        torch.testing.assert_close(row, expected_row, rtol=rtol, atol=atol)


def test_a_rows_result_is_its_own_whatever_the_batch() -> None:
    """Rows run through the kernel in sixes, in fewer and one by one, in one fixed order of operations for every row."""
    packed = pack(*random_chunks(64, 256))
    x = torch.randn(11, 256, dtype=torch.bfloat16)
    together = int4_matmul(x, packed)
    for rows in (slice(0, 1), slice(1, 5), slice(3, 10), slice(10, 11)):
        assert torch.equal(int4_matmul(x[rows], packed), together[rows])


@pytest.mark.parametrize("portable", [False, True], ids=["vectorized", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts", [[1], [1, 1], [0, 3, 7, 1], [13, 0, 0, 6], [40, 33, 2, 9]])
def test_grouped_rows_are_each_groups_own_matmul(counts: list[int], dtype: torch.dtype, portable: bool) -> None:
    """A mixture's experts in one call: each group of rows times its own weight, bit for bit what one matmul per
    group gives (which the formula tests check), whatever the groups' sizes, empty ones included."""
    weights = [pack(*random_chunks(48, 96, seed=g)) for g in range(len(counts))]
    x = (torch.randn(sum(counts), 96) * torch.logspace(-2, 1, sum(counts))[:, None]).to(dtype)
    out = int4_grouped_matmul(x, weights, counts, portable)
    each = [int4_matmul(rows, w, portable) for rows, w in zip(x.split(counts), weights, strict=True)]
    assert out.dtype == dtype and torch.equal(out, torch.cat(each))


def test_grouped_layers_refuse_what_they_cannot_group() -> None:
    """`Int4Linear.grouped` runs Int4Linear layers of one shape without biases, else gives None (the caller runs
    each layer); the op refuses counts that do not cover x's rows and weights of other shapes."""
    plain = [Int4Linear(nn.Linear(64, 32, bias=False)) for _ in range(2)]
    x = torch.randn(3, 64)
    out = Int4Linear.grouped(plain, x, [2, 1])
    assert torch.equal(out, torch.cat([plain[0](x[:2]), plain[1](x[2:])]))
    assert Int4Linear.grouped([plain[0], Int4Linear(nn.Linear(64, 32))], x, [2, 1]) is None  # a bias
    assert Int4Linear.grouped([plain[0], Int4Linear(nn.Linear(64, 48, bias=False))], x, [2, 1]) is None
    with pytest.raises(ValueError, match="counts must sum to x's rows"):
        int4_grouped_matmul(x, [p.packed for p in plain], [1, 1])
    with pytest.raises(ValueError, match="each packed weight"):
        int4_grouped_matmul(x, [plain[0].packed, pack(*random_chunks(48, 64))], [2, 1])


def test_pack_and_unpack_are_inverses_and_dequantize_is_the_formula() -> None:
    q, scales, minimums = random_chunks(48, 96)
    packed = pack(q, scales, minimums)
    assert packed.shape == (3, 3, 320) and packed.dtype == torch.uint8
    back = unpack(packed)
    assert torch.equal(back[0], q) and torch.equal(back[1], scales) and torch.equal(back[2], minimums)
    expected = q.float() * scales.repeat_interleave(BLOCK, 1) + minimums.repeat_interleave(BLOCK, 1)
    assert torch.equal(dequantize(packed), expected)


def test_a_layer_from_q4_1_groups_holds_them_as_they_are() -> None:
    q, scales, minimums = random_chunks(32, 64, seed=1)
    bias = torch.randn(32)
    layer = Int4Linear.from_groups(q, scales, minimums, bias)
    assert torch.equal(layer.dequantized(), dequantize(pack(q, scales, minimums)))
    x = torch.randn(2, 3, 64)
    expected = formula(x.view(6, 64), q, scales, minimums).view(2, 3, 32) + bias
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_kernel_is_an_op_a_compiled_graph_calls() -> None:
    x, packed = torch.randn(5, 64), pack(*random_chunks(32, 64))
    torch.library.opcheck(torch.ops.tformer.int4_matmul.default, (x, packed, 32))
    compiled = torch.compile(lambda a, b: int4_matmul(a, b) * 2, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, packed), int4_matmul(x, packed) * 2)


def test_a_nan_reaches_its_own_rows_output_only() -> None:
    x, packed = torch.randn(3, 64), pack(*random_chunks(16, 64))
    x[1, 40] = float("nan")
    for portable in (False, True):
        out = int4_matmul(x, packed, portable)
        assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_no_rows_give_no_rows() -> None:
    layer = Int4Linear(nn.Linear(64, 32))
    assert layer(torch.randn(0, 64)).shape == (0, 32)


def test_bad_shapes_and_dtypes_are_refused() -> None:
    packed = pack(*random_chunks(16, 64))
    with pytest.raises(ValueError, match=r"x \(M, K\) and packed uint8 chunks"):
        int4_matmul(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match="x must be bfloat16 or float32"):
        int4_matmul(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="out_features by 16"):
        Int4Linear(nn.Linear(64, 24))


def test_without_the_kernel_the_layer_multiplies_by_its_dequantized_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = Int4Linear(nn.Linear(64, 32))
    x = torch.randn(4, 64)
    with_kernel = layer(x)
    monkeypatch.setattr(int4, "available", lambda: False)
    without = layer(x)
    torch.testing.assert_close(without, x @ layer.dequantized().T + layer.bias, rtol=0, atol=1e-6)
    # the two differ only by the activations' rounding to two int8 steps, the finer max|x| / (127 * 254) per block
    assert (with_kernel - without).abs().max() < 0.05 * without.abs().max()
