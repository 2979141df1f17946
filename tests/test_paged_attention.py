"""The paged decode attention kernel (bf16, fp32 and int8 caches) against the plain softmax formula, inside a compiled
graph, and in the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import DECODERS, prompts_of_mixed_lengths, reference_greedy

from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.paged import PagedLayerKV
from tformer.engine.sampling import SamplingParams
from tformer.kernels import paged_attention
from tformer.kernels.paged_attention import kernel, paged_decode_attention

pytestmark = pytest.mark.skipif(kernel() is None, reason="no C++ compiler to build the kernel with")

BF16_MARGIN = 2e-2  # bf16 output rounding (8 bits of mantissa) on values of magnitude ~1, and bf16 inputs


def paged_case(
    rows: int, n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, block: int = 4, longest: int = 37
):
    """Queries, a cache of shuffled blocks, each row's slot table and key count (1 to `longest`, the longest padded;
    the first row has 1 key and the last `longest`)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest + 1, (rows,), generator=generator)
    lengths[0], lengths[-1] = 1, longest
    width = int(lengths.max())
    n_blocks = -(-width // block)
    cache_blocks = rows * n_blocks + 3
    k = torch.randn(cache_blocks * block, n_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(cache_blocks * block, n_kv_heads, head_dim, generator=generator).to(dtype)
    tables = torch.randperm(cache_blocks, generator=generator)[: rows * n_blocks].reshape(rows, n_blocks)
    position = torch.arange(width)
    slots = tables[:, position // block] * block + position % block
    q = torch.randn(rows, n_heads, 1, head_dim, generator=generator).to(dtype)
    return q, k, v, slots, lengths


def softmax_formula(q, k, v, slots, lengths) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V row by row in float64, query head h reading KV head h // (H / Hkv)."""
    rows, n_heads, _, head_dim = q.shape
    rep = n_heads // k.shape[1]
    out = torch.empty(rows, n_heads, 1, head_dim, dtype=torch.float64)
    for b in range(rows):
        keys = k[slots[b, : lengths[b]]].double().repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, n, D)
        values = v[slots[b, : lengths[b]]].double().repeat_interleave(rep, dim=1).transpose(0, 1)
        weights = torch.softmax(q[b].double() @ keys.transpose(1, 2) / head_dim**0.5, dim=-1)  # (H, 1, n)
        out[b] = weights @ values
    return out


def int8_case(*args, **kwargs):
    """paged_case's queries, slots and lengths over an int8 cache instead: random integers in [-127, 127] and a
    positive float32 scale per (slot, KV head), 0.002 to 0.02, for values of magnitude ~1 like paged_case's.
    Gives (q, k, v, slots, lengths, k_scale, v_scale)."""
    q, k, _, slots, lengths = paged_case(*args, **kwargs)
    generator = torch.Generator().manual_seed(1)
    k, v = (torch.randint(-127, 128, k.shape, generator=generator).to(torch.int8) for _ in range(2))
    k_scale, v_scale = (torch.rand(k.shape[:2], generator=generator) * 0.018 + 0.002 for _ in range(2))
    return q, k, v, slots, lengths, k_scale, v_scale


def dequantized(case, dtype: torch.dtype = torch.float64):
    """An int8 case as paged_decode_attention's arguments over the cache it stands for, its values in `dtype`."""
    q, k, v, slots, lengths, k_scale, v_scale = case
    return q, (k.to(dtype) * k_scale[..., None]), (v.to(dtype) * v_scale[..., None]), slots, lengths


# vectorized: D % 16 (AVX2: 8) == 0, its loops unrolled for 64 and 128; generic: the portable loop
@pytest.mark.parametrize(
    "head_dim", [64, 128, 48, 20], ids=["vectorized", "vectorized-128", "vectorized-48", "generic"]
)
@pytest.mark.parametrize("n_heads, n_kv_heads", [(9, 3), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# the kernel's tasks: one (row, KV head) each under 4 rows a thread, else one row's KV heads together
@pytest.mark.parametrize("many_rows", [False, True], ids=["few-rows", "many-rows"])
# a float cache of q's dtype, or an int8 one (dequantized where the kernel converts keys and values to fp32) against
# the formula over the values it stands for, with the same margins
@pytest.mark.parametrize("int8", [False, True], ids=["float-cache", "int8-cache"])
def test_kernel_equals_the_softmax_formula(
    head_dim: int, n_heads: int, n_kv_heads: int, dtype: torch.dtype, many_rows: bool, int8: bool
) -> None:
    rows = 4 * torch.get_num_threads() + 2 if many_rows else 3
    case = (int8_case if int8 else paged_case)(rows, n_heads, n_kv_heads, head_dim, dtype)
    out = paged_decode_attention(*case)
    assert out.dtype == dtype and out.shape == case[0].shape
    tolerance = 1e-5 if dtype == torch.float32 else BF16_MARGIN
    expected = softmax_formula(*dequantized(case)) if int8 else softmax_formula(*case)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


# Fewer (row, KV head) tasks than twice the threads, and 256 keys or more (the kernel's MIN_SPLIT_KEYS): each row's
# keys split into one range a thread, whose results merge. 1 row of 3 KV heads, or 3 rows of 1 (the first with a
# single key, which leaves a range without keys); 2 threads and 3 for ranges of unequal length. A float cache of q's
# dtype, or an int8 one against the formula over the values it stands for.
@pytest.mark.parametrize("rows, n_heads, n_kv_heads", [(1, 9, 3), (3, 4, 1)], ids=["one-row-gqa", "three-rows-mqa"])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("int8", [False, True], ids=["float-cache", "int8-cache"])
def test_long_rows_split_across_threads_equal_the_softmax_formula(
    rows: int, n_heads: int, n_kv_heads: int, threads: int, dtype: torch.dtype, int8: bool
) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = (int8_case if int8 else paged_case)(rows, n_heads, n_kv_heads, 64, dtype, block=16, longest=601)
        out = paged_decode_attention(*case)
    finally:
        torch.set_num_threads(previous)
    tolerance = 1e-5 if dtype == torch.float32 else BF16_MARGIN
    expected = softmax_formula(*dequantized(case)) if int8 else softmax_formula(*case)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


# The vectorized paths multiply each value by its scale as the fp32 cache would hold it, then run the same code
# (equal to the bit); the portable loop multiplies each score and weight by the scale instead (an fp32 rounding or
# two apart): within 1e-6 either way.
@pytest.mark.parametrize("head_dim", [64, 20], ids=["vectorized", "generic"])
@pytest.mark.parametrize("tasks", ["few-rows", "many-rows", "split"])
def test_int8_kernel_equals_the_fp32_kernel_on_the_dequantized_cache(head_dim: int, tasks: str) -> None:
    rows = {"few-rows": 3, "many-rows": 4 * torch.get_num_threads() + 2, "split": 1}[tasks]
    longest = 601 if tasks == "split" else 37
    case = int8_case(rows, 9, 3, head_dim, torch.float32, block=16, longest=longest)
    out = paged_decode_attention(*case)
    reference = paged_decode_attention(*dequantized(case, torch.float32))
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)


def test_kernel_is_an_op_a_compiled_graph_calls() -> None:
    case = paged_case(5, 9, 3, 64, torch.bfloat16)
    torch.library.opcheck(torch.ops.tformer.paged_decode_attention.default, case)
    compiled = torch.compile(lambda *args: paged_decode_attention(*args) * 2, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*case), paged_decode_attention(*case) * 2, atol=0, rtol=0)


def test_int8_kernel_is_an_op_a_compiled_graph_calls() -> None:
    q, k, v, slots, lengths, k_scale, v_scale = int8_case(5, 9, 3, 64, torch.bfloat16)
    schema_order = (q, k, v, k_scale, v_scale, slots, lengths)
    torch.library.opcheck(torch.ops.tformer.paged_decode_attention_int8.default, schema_order)
    compiled = torch.compile(lambda *args: paged_decode_attention(*args) * 2, fullgraph=True, dynamic=True)
    case = (q, k, v, slots, lengths, k_scale, v_scale)
    torch.testing.assert_close(compiled(*case), paged_decode_attention(*case) * 2, atol=0, rtol=0)


def test_without_a_compiler_there_is_no_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel.cache_clear()
    try:
        assert kernel() is None
        assert not paged_attention.supports(torch.bfloat16, torch.device("cpu"))
        assert "paged decode attention unavailable" in caplog.text
        monkeypatch.setenv("CXX", "g++")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "tformer").write_text("a file where the cache directory would go")
        kernel.cache_clear()
        assert kernel() is None  # an unwritable cache directory: the engine keeps its gather path
    finally:
        kernel.cache_clear()  # the next call, after the monkeypatch is undone, loads the real kernel again


@pytest.fixture
def in_place_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the layers that attended in place, batch size each."""
    calls: list[int] = []
    attend = PagedLayerKV.attend_in_place

    def counted(self, positions, q, k, v):
        calls.append(q.shape[0])
        return attend(self, positions, q, k, v)

    monkeypatch.setattr(PagedLayerKV, "attend_in_place", counted)
    return calls


@pytest.mark.parametrize(
    "overrides",
    [dict(preset="tiny-llama"), dict(preset="tiny-llama", d_model=128, n_heads=4, n_kv_heads=2)],
    ids=["head-dim-8-generic-loop", "head-dim-32-avx512"],
)
def test_engine_decode_attends_in_place_and_gives_the_uncached_tokens(overrides: dict, in_place_calls) -> None:
    overrides = dict(overrides)
    model = make_model(tiny_config(overrides.pop("preset"), **overrides))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    results = Engine(model, config=EngineConfig(block_size=4, num_blocks=64)).generate(prompts, params)
    assert in_place_calls and max(in_place_calls) == len(prompts)  # decode steps of all rows together
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(model, prompt, params.max_tokens)


@pytest.mark.parametrize("name", ["alibi", "sliding window"])
def test_layers_with_other_rules_keep_the_gather_path(name: str, in_place_calls) -> None:
    overrides = dict(DECODERS[name])
    model = make_model(tiny_config(overrides.pop("preset"), **overrides))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    Engine(model, config=EngineConfig(block_size=4, num_blocks=64)).generate(prompts, SamplingParams(max_tokens=4))
    assert in_place_calls == []


def test_bf16_decode_in_place_stays_within_a_margin_of_the_gather_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first decode step (after the same prefill, so on the same tokens) gives logits within a bf16 margin."""
    model = make_model(tiny_config("tiny-llama", d_model=128, n_heads=4, n_kv_heads=2)).to(torch.bfloat16)
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    params = SamplingParams(max_tokens=2, temperature=0.0)  # prefill's token, then one decode step

    def logits_of_every_step() -> list[torch.Tensor]:
        engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=64))
        seen: list[torch.Tensor] = []
        logits = engine.runner.logits
        engine.runner.logits = lambda *args, **kwargs: seen.append(logits(*args, **kwargs)) or seen[-1]
        engine.generate(prompts, params)
        return seen

    in_place = logits_of_every_step()
    monkeypatch.setattr("tformer.engine.paged.supports", lambda dtype, device: False)
    gathered = logits_of_every_step()
    assert len(in_place) == len(gathered)
    for ours, reference in zip(in_place, gathered, strict=True):
        torch.testing.assert_close(ours.float(), reference.float(), atol=5e-2, rtol=5e-2)


def test_bad_inputs_are_refused_before_anything_is_read() -> None:
    q, k, v, slots, lengths = paged_case(3, 4, 2, 16, torch.float32)
    outside = slots.clone()
    outside[1, 0] = k.shape[0]  # one past the last slot
    with pytest.raises(IndexError, match="outside the cache"):
        paged_decode_attention(q, k, v, outside, lengths)
    outside[1, 0] = -1
    with pytest.raises(IndexError, match="outside the cache"):
        paged_decode_attention(q, k, v, outside, lengths)
    with pytest.raises(ValueError, match="one query per row"):
        paged_decode_attention(q.expand(3, 4, 2, 16), k, v, slots, lengths)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_decode_attention(q[:, :3], k, v, slots, lengths)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_decode_attention(q, k.double(), v.double(), slots, lengths)
    with pytest.raises(ValueError, match="int64"):
        paged_decode_attention(q, k, v, slots.int(), lengths)


def test_bad_int8_inputs_are_refused_before_anything_is_read() -> None:
    q, k, v, slots, lengths, k_scale, v_scale = int8_case(3, 4, 2, 16, torch.float32)
    outside = slots.clone()
    outside[1, 0] = k.shape[0]
    with pytest.raises(IndexError, match="outside the cache"):
        paged_decode_attention(q, k, v, outside, lengths, k_scale, v_scale)
    outside[1, 0] = -1
    with pytest.raises(IndexError, match="outside the cache"):
        paged_decode_attention(q, k, v, outside, lengths, k_scale, v_scale)
    with pytest.raises(ValueError, match="int8 cache takes its k_scale and v_scale"):
        paged_decode_attention(q, k, v, slots, lengths)
    with pytest.raises(ValueError, match=r"both k_scale and v_scale.*k_scale \(\d+, 2\) torch.float32, v_scale None"):
        paged_decode_attention(q, k, v, slots, lengths, k_scale)
    # too few slots, (Hkv, slots), one scale a slot, not contiguous, float64, bfloat16
    wrong_scales = [k_scale[:-1], k_scale.t().contiguous(), k_scale[:, 0], k_scale.t().contiguous().t()]
    for wrong in [*wrong_scales, k_scale.double(), k_scale.bfloat16()]:
        with pytest.raises(ValueError, match="k_scale and v_scale must be contiguous float32 \\(slots, Hkv\\)"):
            paged_decode_attention(q, k, v, slots, lengths, k_scale, wrong)
        with pytest.raises(ValueError, match="k_scale and v_scale must be contiguous float32 \\(slots, Hkv\\)"):
            paged_decode_attention(q, k, v, slots, lengths, wrong, v_scale)
    with pytest.raises(ValueError, match="k and v int8"):
        paged_decode_attention(q, k.float(), v.float(), slots, lengths, k_scale, v_scale)
    with pytest.raises(ValueError, match="q must be bfloat16 or float32"):
        paged_decode_attention(q.double(), k, v, slots, lengths, k_scale, v_scale)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_decode_attention(q[:, :3], k, v, slots, lengths, k_scale, v_scale)
