"""The int8 KV cache (`EngineConfig(kv_cache_dtype="int8")`): each key and value vector of a KV head stored as int8
numbers and one scale. The reference is the full uncached forward whose attention sees its keys and values rounded
the same way (`StoredAsInt8`): in fp32 the engine's tokens equal it on every path (decode steps in place or through
the gather, packed or padded prompt chunks, prefix hits, a sliding window, compiled steps)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import prompts_of_mixed_lengths, reference_greedy

from tformer.config import ConfigError
from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.paged import PagedKVCache, kv_bytes_per_token
from tformer.engine.runner import compiled_decode_step
from tformer.engine.sampling import SamplingParams
from tformer.kernels import kv_int8
from tformer.kernels.kv_int8 import dequantize_int8, quantize_int8
from tformer.kernels.paged_attention import available
from tformer.kernels.quantize import set_precision
from tformer.layers.kv_cache import LayerCache

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BF16_ULP_AT_20 = 0.125  # a bf16 step between 16 and 32, where SmolLM2's best logits lie


class StoredAsInt8:
    """A one-forward cache: `update` hands the forward's keys and values back as an int8 KV cache stores them."""

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_int8(*quantize_int8(k), k.dtype), dequantize_int8(*quantize_int8(v), v.dtype)


def int8_kv_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The uncached forward's logits (T, V) with every layer's keys and values rounded as the int8 cache does."""
    cache = [LayerCache(StoredAsInt8()) for _ in model.decoder.layers]
    with torch.no_grad():
        return model(torch.tensor([ids]), cache=cache)[0]


def int8_kv_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(int8_kv_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def rounding_sensitive_llama() -> torch.nn.Module:
    """A tiny LLaMA (seed 3) whose greedy tokens for one of `prompts_of_mixed_lengths` differ once its keys and values
    are rounded (most tiny random models pick the same tokens either way): a path that skipped the rounding fails."""
    return make_model(tiny_config("tiny-llama"), seed=3)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(prompts, params)]


def test_quantize_int8_follows_its_formula() -> None:
    """numbers = round(x / s), s = max |x| / 127 per vector: the largest entry becomes +-127, each entry comes back
    within half a step, a zero vector stays zero (no 0 / 0)."""
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 40.0])[:, None]
    x[4, 2] = 0.0
    numbers, scale = quantize_int8(x)
    assert numbers.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5, 3)
    expected = x.abs().amax(-1) / 127
    torch.testing.assert_close(scale, expected, rtol=0, atol=0)
    assert torch.equal(numbers.abs().amax(-1)[:4], torch.full((4, 3), 127, dtype=torch.int8))
    back = dequantize_int8(numbers, scale, torch.float32)
    assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[4, 2], torch.zeros(64)) and not back.isnan().any()


def test_an_int8_layer_reads_back_the_rounded_vectors_it_stored() -> None:
    """`LayerTensors.encode` then `store` and `read` (any slot shape), and `decode` of what `encode` gave, all give
    dequantize(quantize(x)) in the attention's dtype, bit for bit: the one rule every path of the engine follows."""
    layer = PagedKVCache(1, 4, 4, n_kv_heads=2, head_dim=8, dtype=torch.bfloat16, kv_cache_dtype="int8").layers[0]
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, 2, 8, generator=generator, dtype=torch.bfloat16) * 3 for _ in "kv")
    slots = torch.tensor([3, 0, 7, 12, 9])
    expected = [dequantize_int8(*quantize_int8(x), torch.bfloat16) for x in (k, v)]
    encoded = [layer.encode(x) for x in (k, v)]
    layer.store(slots, *encoded[0], *encoded[1])
    for got in ([layer.decode(*e) for e in encoded], layer.read(slots)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    keys, values = layer.read(slots.view(1, 5))
    assert keys.shape == (1, 5, 2, 8) and torch.equal(keys[0], expected[0]) and torch.equal(values[0], expected[1])
    assert layer.k.dtype == torch.int8 and torch.equal(layer.k_scale[slots], quantize_int8(k)[1])


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs as NaNs (their sign bit may differ)."""
    nan = b.isnan()
    return torch.equal(a.isnan(), nan) and torch.equal(
        a[~nan].float().view(torch.int32), b[~nan].float().view(torch.int32)
    )


@pytest.mark.skipif(not kv_int8.available(), reason="the int8 KV kernel did not build on this machine")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_the_kernel_writes_and_reads_the_formula_bits(dtype: torch.dtype, head_dim: int) -> None:
    """`store_rounded` of keys (B, Hkv, T, D) laid out token-major (as a projection gives them): the pool's numbers
    and scales at each real token's slot, nothing at a padding slot, and the read-back, equal `quantize_int8` and
    `dequantize_int8` bit for bit, through zero, subnormal, NaN and infinite vectors; `read_rounded` (any slot shape)
    equals the formula on the pool; a slot outside the pool is an error."""
    generator = torch.Generator().manual_seed(0)
    B, H, T, S = 3, 2, 37, 200
    x = torch.randn(B, T, H, head_dim, generator=generator) * torch.rand(B, T, H, 1, generator=generator) * 5
    x = x.to(dtype).transpose(1, 2)  # (B, H, T, D), not contiguous
    x[0, 1, 3], x[2, 0, 5] = 0.0, 1e-40
    x[1, 0, 2, 5], x[2, 1, 4, 1] = float("nan"), float("inf")
    slots = torch.randperm(S, generator=generator)[: B * T]
    slots[5] = -1  # a padding token
    numbers, scales = torch.zeros(S, H, head_dim, dtype=torch.int8), torch.zeros(S, H)
    rounded = kv_int8.store_rounded(x, slots, numbers, scales)
    expected_numbers, expected_scales = quantize_int8(x)
    assert same_values(rounded, dequantize_int8(expected_numbers, expected_scales, dtype))
    real = slots >= 0
    assert torch.equal(numbers[slots[real]], expected_numbers.transpose(1, 2).flatten(0, 1)[real])
    assert same_values(scales[slots[real]], expected_scales.transpose(1, 2).flatten(0, 1)[real])
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots[real]] = False  # the padding token's numbers went nowhere
    assert not numbers[untouched].any() and not scales[untouched].any()
    read_slots = slots[real][:60].view(2, 30)
    assert same_values(
        kv_int8.read_rounded(numbers, scales, read_slots, dtype),
        dequantize_int8(numbers[read_slots], scales[read_slots], dtype),
    )
    with pytest.raises(Exception, match="outside the cache's 200 slots"):
        kv_int8.read_rounded(numbers, scales, torch.tensor([200]), dtype)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("pack", [True, False])
def test_int8_engine_gives_the_int8_reference_tokens(preset: str, pack: bool) -> None:
    """Mixed-length prompts, chunked prefill (6 tokens a step), 4-token blocks: the reference's tokens exactly (fp32),
    and the pool holds int8 numbers. The rounding is real: the LLaMA's plain forward picks other tokens."""
    model = rounding_sensitive_llama() if preset == "tiny-llama" else make_model(tiny_config(preset))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    config = EngineConfig(block_size=4, max_batched_tokens=6, kv_cache_dtype="int8", pack_prompts=pack)
    engine = Engine(model, config=config)
    assert engine.kv.k[0].dtype == torch.int8 and engine.kv.layers[0].k_scale is not None
    outputs = run(engine, prompts)
    assert outputs == [int8_kv_greedy(model, prompt, GREEDY.max_tokens) for prompt in prompts]
    if preset == "tiny-llama":
        assert outputs != [reference_greedy(model, prompt, GREEDY.max_tokens) for prompt in prompts]


def test_int8_engine_gives_the_same_tokens_through_the_gather_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps without the in-place kernel read the cache through `LayerTensors.read`: the same tokens."""
    model = rounding_sensitive_llama()
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    config = EngineConfig(block_size=4, kv_cache_dtype="int8")
    in_place = run(Engine(model, config=config), prompts)
    monkeypatch.setattr("tformer.engine.paged.supports", lambda dtype, device: False)
    engine = Engine(model, config=config)
    gathered = run(engine, prompts)
    assert gathered == in_place == [int8_kv_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_prefix_hits_and_a_sliding_window_read_the_int8_cache() -> None:
    """A second request sharing the first's 16-token prefix takes its cached int8 blocks; under a sliding window of 8
    the engine frees blocks and still gives the reference's tokens (the reference masks with the window)."""
    model = make_model(tiny_config("tiny-llama"))
    prefix = torch.randint(1, 90, (16,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(model, config=EngineConfig(block_size=4, kv_cache_dtype="int8"))
    run(engine, [prefix + [3]])
    assert run(engine, [prefix + [7, 9]])[0] == int8_kv_greedy(model, prefix + [7, 9], GREEDY.max_tokens)
    windowed = make_model(tiny_config("tiny-llama", sliding_window=8, max_seq_len=128))
    config = EngineConfig(block_size=4, max_batched_tokens=6, kv_cache_dtype="int8", prefix_caching=False)
    prompts = [prefix + [3], prefix[:5]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompt, tokens in zip(prompts, run(Engine(windowed, config=config), prompts, params), strict=True):
        assert tokens == int8_kv_greedy(windowed, prompt, params.max_tokens)


def test_an_encoder_decoder_decodes_over_an_int8_self_attention_cache() -> None:
    """The paper's model as the engine serves translations: the decoder's own keys and values in the int8 cache (the
    cross-attention's stay per request, unrounded): the greedy tokens of the reference decoder from <s> (id 1).
    Tiny random encoder-decoders pick the same tokens with and without the rounding, so this holds the family's
    plumbing; the decoder tests above hold the rounding."""
    model = make_model(tiny_config("tiny-transformer"))
    sources = [[t if t > 2 else 3 for t in s] for s in prompts_of_mixed_lengths(model.config.vocab_size, (6, 11, 3))]
    engine = Engine(model, config=EngineConfig(block_size=4, max_batched_tokens=8, kv_cache_dtype="int8"))
    for source, tokens in zip(sources, run(engine, sources), strict=True):
        memory, target = model.encode(torch.tensor([source])), [1]
        for _ in range(GREEDY.max_tokens):
            cache = [LayerCache(StoredAsInt8()) for _ in model.decoder.layers]
            with torch.no_grad():
                target.append(int(model.decode(torch.tensor([target]), memory, cache=cache)[0, -1].argmax()))
        assert tokens == target[1:]


def test_greedy_speculation_over_int8_caches_gives_the_target_alone() -> None:
    """A draft (the target with noise in its weights) keeps its own int8 cache; verifying its tokens writes and reads
    the target's int8 cache several tokens a row: the target's reference tokens, with drafts both kept and refused."""
    target = rounding_sensitive_llama()
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.5 * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=generator))
    prompts = prompts_of_mixed_lengths(target.config.vocab_size)
    config = EngineConfig(block_size=4, num_speculative_tokens=3, kv_cache_dtype="int8")
    engine = Engine(target, config=config, draft=draft)
    assert run(engine, prompts) == [int8_kv_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    assert engine.drafter.kv.k[0].dtype == torch.int8
    assert 0 < engine.speculative.accepted < engine.speculative.proposed


@pytest.mark.skipif(not available(), reason="needs the paged attention kernel (a C++ compiler)")
def test_compiled_int8_decode_steps_give_the_reference_tokens() -> None:
    model = rounding_sensitive_llama()
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    engine = Engine(model, config=EngineConfig(block_size=4, kv_cache_dtype="int8", compile=True))
    assert run(engine, prompts) == [int8_kv_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    assert compiled_decode_step(model.decoder).compiled is not None  # one whole graph: no eager fallback


def test_an_int8_pool_holds_more_tokens_in_the_same_memory() -> None:
    """Bytes a token takes: Hkv x (D int8 numbers + a 4-byte scale) x 2 x layers, against Hkv x D x 4 in fp32; the
    engine sizes its pool from it, and the tensors take what it says."""
    model = make_model(tiny_config("tiny-llama"))
    mc = model.config
    assert kv_bytes_per_token(model, "int8") == mc.n_kv_heads * (mc.head_dim + 4) * 2 * mc.n_decoder_layers
    plain = Engine(model, config=EngineConfig(block_size=4, kv_cache_bytes=1 << 20, max_seqs=10_000))
    small = Engine(
        model, config=EngineConfig(block_size=4, kv_cache_bytes=1 << 20, max_seqs=10_000, kv_cache_dtype="int8")
    )
    ratio = kv_bytes_per_token(model) / kv_bytes_per_token(model, "int8")
    assert small.allocator.pool.num_blocks == pytest.approx(plain.allocator.pool.num_blocks * ratio, rel=0.01)
    assert small.kv.nbytes <= 1 << 20 and small.kv.nbytes == pytest.approx(plain.kv.nbytes, rel=0.01)


def test_a_bad_kv_cache_dtype_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype must be one of auto, int8, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")


def test_smollm2_bf16_with_an_int8_cache_stays_near_the_int8_reference(smollm2_pretrained) -> None:
    """SmolLM2-135M in bf16: teacher-forced on the engine's tokens, each scores within two bf16 steps (at logits
    near 20) of the best logit of the reference forward whose keys and values are rounded likewise (the two paths
    reduce in different shapes, so exact bf16 tokens are not a property of the engine), a wrong token does not, and
    the answer after "The capital of France is" still names Paris."""
    model, tokenizer = smollm2_pretrained
    bf16 = set_precision(copy.deepcopy(model), "bfloat16")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tokenizer.encode(chat)
    engine = Engine(bf16, tokenizer, EngineConfig(block_size=16, kv_cache_dtype="int8"))
    tokens = run(engine, [prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    logits = int8_kv_logits(bf16, prompt + tokens)[len(prompt) - 1 : -1].float()  # (10, V)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (chosen >= logits.amax(1) - 2 * BF16_ULP_AT_20).all(), (chosen, logits.amax(1))
    assert logits[-1, 13] < logits[-1].max() - 2 * BF16_ULP_AT_20  # the check can fail: token 13 is not a near-tie
    answer = prompt + tokenizer.encode("The capital of France is")
    assert "Paris" in engine.generate(answer, SamplingParams(max_tokens=4, temperature=0.0))[0].text
