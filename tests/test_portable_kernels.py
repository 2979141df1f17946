"""The portable kernel paths (what a GPU or an ARM CPU runs, `kernels/dispatch.py`) against tformer's C++ kernels,
on this x86 CPU: the same greedy tokens in fp32, and within stated margins in bf16 and with INT8 / INT4 / W8A8.

`portable_kernels()` switches every kernel call to torch's ops in-process; TFORMER_PORTABLE_KERNELS=1 does it for a
whole process (tested in a subprocess)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, tiny_config
from helpers import greedy_within_rounding, prompts_of_mixed_lengths, reference_greedy
from torch import nn

from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.kernels import dispatch, elementwise, int4, kv_int8, paged_attention, w8a8
from tformer.kernels.causal_attention import causal_attention
from tformer.kernels.dispatch import portable_kernels
from tformer.kernels.int4 import Int4Linear
from tformer.kernels.paged_attention import gathered_decode_attention, paged_decode_attention
from tformer.kernels.quantize import Int8Linear, set_precision
from tformer.kernels.w8a8 import W8A8Linear

pytestmark = pytest.mark.skipif(
    not (dispatch.X86 and paged_attention.available() and int4.available() and w8a8.available()),
    reason="the native kernels are x86 code built with the machine's C++ compiler; without them only the "
    "portable path runs, which every other test covers",
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
# head_dim 32: a multiple of the attention kernels' lanes; d_ff 96: every linear layer quantizes to INT4
LLAMA = dict(head_dim=32, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=96)


def bf16_steps(value: float, steps: int) -> float:
    """`steps` bf16 rounding steps (8 significant bits) at the size of `value`."""
    return steps * 2.0 ** (math.floor(math.log2(value)) - 7)


def test_dispatch_sends_every_kernel_to_torch_when_forced() -> None:
    q, k, v = (torch.randn(1, 4, 8, 32).bfloat16() for _ in range(3))
    x, weight = torch.randn(3, 32).bfloat16(), torch.ones(32).bfloat16()
    numbers, scales = torch.zeros(16, 4, 32, dtype=torch.int8), torch.zeros(16, 4)
    slots = torch.arange(8)

    def answers() -> list[bool]:
        return [
            causal_attention(q, k, v) is not None,
            elementwise.rms_norm(x, weight, 1e-6) is not None,
            kv_int8.store_rounded(k, slots, numbers, scales) is not None,
            paged_attention.supports(torch.bfloat16, torch.device("cpu")),
            dispatch.native(torch.device("cpu")),
        ]

    assert answers() == [True] * 5
    with portable_kernels():
        assert answers() == [False] * 5
        assert dispatch.portable_forced()
    assert answers() == [True] * 5
    for other in ("cuda", "meta", "mps"):
        assert not dispatch.native(torch.device(other))


def test_the_environment_switch_forces_the_portable_path_for_a_process() -> None:
    code = "import torch; from tformer.kernels import dispatch; print(dispatch.native(torch.device('cpu')))"
    env = {**os.environ, dispatch.PORTABLE_SWITCH: "1"}  # without it, this process: native (the test above)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", ["float", "int8"])
def test_gathered_decode_attention_equals_the_kernel(dtype: torch.dtype, cache: str) -> None:
    generator = torch.Generator().manual_seed(4)
    slots_total, n_kv, head = 64, 2, 32
    q = torch.randn(3, 4, 1, head, generator=generator).to(dtype)
    k, v = (torch.randn(slots_total, n_kv, head, generator=generator).to(dtype) for _ in range(2))
    scales: tuple[torch.Tensor, ...] = ()
    if cache == "int8":
        (k, k_scale), (v, v_scale) = kv_int8.quantize_int8(k), kv_int8.quantize_int8(v)
        scales = (k_scale, v_scale)
    slots = torch.randperm(slots_total, generator=generator)[:30].view(3, 10)
    lengths = torch.tensor([10, 3, 7])
    native = paged_decode_attention(q, k, v, slots, lengths, *scales)
    portable = gathered_decode_attention(q, k, v, slots, lengths, *scales)
    with portable_kernels():  # the wrapper itself takes the gathered path
        assert torch.equal(paged_decode_attention(q, k, v, slots, lengths, *scales), portable)
    # fp32: the same sums in another order; bf16: both round the fp32 result once, up to one step apart
    margin = 1e-5 if dtype == torch.float32 else bf16_steps(float(native.abs().max()), 1)
    assert (native.float() - portable.float()).abs().max() <= margin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int4", "int8", "w8a8"])
def test_quantized_linears_portable_against_the_kernels(dtype: torch.dtype, kind: str) -> None:
    torch.manual_seed(5)
    linear = nn.Linear(128, 64)
    layer = {"int4": lambda: Int4Linear(linear), "int8": lambda: Int8Linear(linear), "w8a8": lambda: W8A8Linear(linear)}
    quantized = layer[kind]().to(dtype)
    x = torch.randn(5, 128).to(dtype)
    with torch.no_grad():
        native = quantized(x).float()
        with portable_kernels():
            portable = quantized(x).float()
        weight = quantized.dequantized()
    largest = float(native.abs().max())
    if kind == "int4":
        # portable: the dequantized weight times the float activations; the kernel rounds activations to 1/(127 *
        # 254) of each block's largest first, a difference far below the weight's own 4-bit rounding
        expected = F.linear(x.float(), weight).to(dtype).float() + quantized.bias.float()
        assert (portable - expected).abs().max() <= bf16_steps(largest, 2 if dtype == torch.bfloat16 else 0) + 1e-5
        margin = 1e-3 * largest if dtype == torch.float32 else bf16_steps(largest, 2)
    else:  # the same integer formula (`w8a8_formula`), summed in another order
        margin = 1e-5 * largest if dtype == torch.float32 else bf16_steps(largest, 1)
    assert (native - portable).abs().max() <= margin


def test_causal_attention_portable_is_sdpa_within_bf16_rounding() -> None:
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 12, 32, generator=generator).bfloat16()
    k, v = (torch.randn(2, 2, 20, 32, generator=generator).bfloat16() for _ in range(2))
    native = causal_attention(q, k, v)
    with portable_kernels():
        assert causal_attention(q, k, v) is None  # the caller keeps SDPA
    mask = torch.ones(12, 20, dtype=torch.bool).tril(20 - 12)  # queries at the last 12 of 20 positions
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (native.float() - sdpa.float()).abs().max() <= bf16_steps(float(sdpa.abs().max()), 2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "sliding-window"])
def test_engine_fp32_greedy_tokens_equal_on_both_paths(preset: str, kv_cache_dtype: str) -> None:
    overrides = {"tiny-llama": LLAMA, "tiny-gpt2": {}, "sliding-window": {**LLAMA, "sliding_window": 5}}[preset]
    model = make_model(tiny_config("tiny-llama" if preset == "sliding-window" else preset, **overrides))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    config = EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    native = [r.token_ids for r in Engine(model, config=config).generate(prompts, GREEDY)]
    with portable_kernels():
        portable = [r.token_ids for r in Engine(model, config=config).generate(prompts, GREEDY)]
    assert portable == native
    if kv_cache_dtype == "auto":
        assert native == [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "w8a8"])
def test_engine_bf16_and_quantized_within_margin_on_both_paths(quantize: str | None) -> None:
    model = set_precision(make_model(tiny_config("tiny-llama", **LLAMA)), "bfloat16", quantize)
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    config = EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=16, kv_cache_dtype="int8")
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1)
    native = Engine(model, config=config).generate(prompts, params)
    with portable_kernels():
        portable = Engine(model, config=config).generate(prompts, params)
        with torch.no_grad():
            largest = max(float(model(torch.tensor([p])).abs().max()) for p in prompts)
        # the reference: the uncached forward in torch's ops; an int8 KV cache and the kernels' rounding move a
        # logit by a few bf16 steps at the largest logit
        margin = bf16_steps(largest, 4)
        for prompt, ours, theirs in zip(prompts, native, portable, strict=True):
            assert len(ours.token_ids) == len(theirs.token_ids) == 8
            assert greedy_within_rounding(model, prompt, ours.token_ids, margin)
            assert greedy_within_rounding(model, prompt, theirs.token_ids, margin)
    # the prefill's log-probabilities, token for token (a prompt's first token has none)
    pairs = [
        pair
        for ours, theirs in zip(native, portable, strict=True)
        for pair in zip(ours.prompt_logprobs, theirs.prompt_logprobs, strict=True)
    ]
    differences = [abs(a.logprob - b.logprob) for a, b in pairs if a is not None]
    assert len(differences) == sum(len(p) - 1 for p in prompts) and max(differences) <= 2 * margin
