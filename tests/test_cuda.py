"""tformer on a CUDA GPU (`pytest -m cuda`, run by benchmarks/gpu_check.sh): the families' fp32 logits against
transformers on the GPU, the engine's greedy tokens against the uncached forward (fp32: equal; bf16 and INT8 /
INT4 on the portable kernels: within stated margins), translation and `tformer generate --device cuda`.

Every test skips on a machine without a GPU, saying so; tests/test_portable_kernels.py runs the same portable
kernel paths on the CPU."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import prompts_of_mixed_lengths
from test_interop_hf import OUTPUTS, SIDES, TOLERANCE

from tformer.engine import Engine, EngineConfig, SamplingParams
from tformer.interop.hf import from_hf
from tformer.kernels import dispatch
from tformer.kernels.quantize import set_precision

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (benchmarks/gpu_check.sh runs these)"),
]

CUDA = torch.device("cuda")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
FAMILIES = ["gpt2", "llama-odd", "mistral", "bert-mlm", "bart", "marian-odd"]


class OnDevice:
    """A model moved to `device`, called with CPU tensors and giving CPU outputs (so the CPU tests' comparison
    helpers serve as they are)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device, self.config = model.to(device), device, model.config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        def there(value: Any) -> Any:
            return value.to(self.device) if isinstance(value, torch.Tensor) else value

        out = self.model(*map(there, args), **{key: there(value) for key, value in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return out.cpu()
        return type(out)(**{key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in out.items()})


@pytest.mark.parametrize("case", FAMILIES)
def test_fp32_logits_equal_transformers_on_the_gpu(case: str, checkpoint) -> None:
    theirs, path = checkpoint(case)
    ours = OnDevice(from_hf(path).eval(), CUDA)
    theirs = OnDevice(theirs.eval(), CUDA)
    assert next(ours.model.parameters()).is_cuda and next(theirs.model.parameters()).is_cuda
    worst = 0.0
    for side in SIDES[ours.config.family]:
        with torch.no_grad():
            mine, reference, mask = OUTPUTS[ours.config.family](ours, theirs, side)
        real = mask.bool()
        worst = max(worst, (mine[real] - reference[real]).abs().max().item())
    assert worst <= TOLERANCE


def uncached_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the full uncached forward at every step, on the model's device."""
    ids = list(prompt)
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=device))[0, -1].argmax()))
    return ids[len(prompt) :]


def within_rounding(model: torch.nn.Module, prompt: list[int], tokens: list[int], margin: float) -> bool:
    """Whether each token scores within `margin` of the uncached forward's best logit (helpers.greedy_within_rounding
    on the model's device)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=device))[0, len(prompt) - 1 : -1].float().cpu()
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return bool((chosen >= logits.amax(1) - margin).all())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "sliding-window"])
def test_engine_fp32_greedy_equals_the_uncached_forward_on_the_gpu(preset: str, kv_cache_dtype: str) -> None:
    overrides = {"sliding_window": 5} if preset == "sliding-window" else {}
    model = make_model(tiny_config("tiny-llama" if preset == "sliding-window" else preset, **overrides)).to(CUDA)
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    config = EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    engine = Engine(model, config=config)
    assert engine.kv.k[0].is_cuda and not dispatch.native(engine.kv.k[0].device)
    results = engine.generate(prompts, GREEDY)
    expected = [uncached_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    if kv_cache_dtype == "auto":
        assert [r.token_ids for r in results] == expected
    else:  # int8 keys and values: each token within a small margin of the float forward's best
        for prompt, result in zip(prompts, results, strict=True):
            assert within_rounding(model, prompt, result.token_ids, 0.05)


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "w8a8", "fp8"])
def test_engine_bf16_and_quantized_within_margin_on_the_gpu(quantize: str | None) -> None:
    config = tiny_config("tiny-llama", head_dim=32, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=96)
    model = set_precision(make_model(config), "bfloat16", quantize).to(CUDA)
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    results = Engine(model, config=EngineConfig(block_size=4, num_blocks=64)).generate(prompts, GREEDY)
    with torch.no_grad():
        largest = max(float(model(torch.tensor([p], device=CUDA)).abs().max()) for p in prompts)
    margin = 4 * 2.0 ** (math.floor(math.log2(largest)) - 7)  # four bf16 steps at the largest logit
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.token_ids) == GREEDY.max_tokens
        assert within_rounding(model, prompt, result.token_ids, margin)


def test_speculative_decoding_on_the_gpu_keeps_the_targets_tokens() -> None:
    import copy

    model = make_model(tiny_config("tiny-llama")).to(CUDA)
    draft = set_precision(copy.deepcopy(model), "float32", "int8", fuse=False)
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    plain = [r.token_ids for r in Engine(model).generate(prompts, GREEDY)]
    assert [r.token_ids for r in Engine(model, draft=draft).generate(prompts, GREEDY)] == plain
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)  # rejection draws: the CPU
    assert all(len(r.token_ids) == 8 for r in Engine(model, draft=draft).generate(prompts, sampled))


def test_seeded_sampling_draws_the_cpu_stream_on_the_gpu() -> None:
    model = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    on_cpu = [r.token_ids for r in Engine(model).generate(prompts, params)]
    on_gpu = [r.token_ids for r in Engine(model.to(CUDA)).generate(prompts, params)]
    # the same uniform draws against fp32 probabilities that differ in the last bits: a flip needs a draw that
    # lands within those bits of a boundary
    assert sum(a == b for a, b in zip(on_cpu, on_gpu, strict=True)) >= len(prompts) - 1


def test_engine_beam_search_on_the_gpu_equals_the_cpu() -> None:
    model = make_model(tiny_config("tiny-llama"))
    prompts = prompts_of_mixed_lengths(model.config.vocab_size, (5, 9))
    params = SamplingParams(max_tokens=8, beam_width=3, length_penalty=0.6)
    on_cpu = [r.token_ids for r in Engine(model).generate(prompts, params)]
    assert [r.token_ids for r in Engine(model.to(CUDA)).generate(prompts, params)] == on_cpu


def test_translation_on_the_gpu_equals_the_cpu() -> None:
    from tformer.decoding.search import translate_ids

    model = make_model(tiny_config("tiny-transformer"))
    sources = prompts_of_mixed_lengths(model.config.vocab_size, (6, 3, 9))
    sources = [[max(t, 3) for t in s] for s in sources]  # no pad, <s> or </s> inside a source
    on_cpu = translate_ids(model, sources, 1, 2, 0, 4, 0.6, 8)
    on_gpu = translate_ids(model.to(CUDA), sources, 1, 2, 0, 4, 0.6, 8)
    assert on_gpu == on_cpu


def test_generate_command_on_cuda(tmp_path: Path) -> None:
    from serve_helpers import save_tiny_checkpoint

    from tformer.checkpoints import load_pretrained

    save_tiny_checkpoint(tmp_path, max_seq_len=64)
    model, tokenizer = load_pretrained(tmp_path)
    expected = Engine(model, tokenizer).generate("the cat", SamplingParams(max_tokens=8, temperature=0.0))[0].text
    command = [sys.executable, "-m", "tformer", "generate", "the cat", "--model", str(tmp_path), "--device", "cuda"]
    out = subprocess.run([*command, "--max-tokens", "8", "--no-chat"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
