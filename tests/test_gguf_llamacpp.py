"""`tformer convert --to gguf` checked in llama.cpp itself (llama-cpp-python): a LLaMA-style model trained by
tformer, written at f16, gives llama.cpp the same greedy tokens as tformer; at q8_0 and q4_0 llama.cpp's logits
stay within a stated distance of tformer's on the same dequantized weights; a Mixtral-style model's f16 file
gives the same greedy tokens too.

llama.cpp multiplies a matrix stored as F16, Q8_0 or Q4_0 against activations rounded to the same kind (f16,
or 8-bit blocks of 32 for both quantized kinds), so its logits differ from tformer's float32 ones by that
rounding, not by the weights: the bounds below are fractions of the logits' spread (their standard deviation).
The model is trained for a few hundred steps first, so that its greedy choices are not near-ties that this
rounding could flip. The measured distances are printed (`pytest -s`); benchmarks/results/gguf_llamacpp.txt
records a run.
"""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch
from conftest import train_next_token

llama_cpp = pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed; it comes with the `bench` extra (pip install -e '.[bench]', "
    "a source build of about 10 minutes), which CI leaves out",
)

from tformer import ModelConfig, build_model  # noqa: E402
from tformer.cli import main as tformer_main  # noqa: E402
from tformer.data.tokenizer import Tokenizer  # noqa: E402
from tformer.interop.gguf import from_gguf  # noqa: E402
from tformer.interop.gguf_writer import to_gguf  # noqa: E402

TEXT = "the cat sat on the mat and the dog ran in the park while the bird sang at dawn. "
PROMPT_TEXT = "the dog ran in the"
NEW_TOKENS = 24
# max |llama.cpp logit - tformer logit| over every position, as a fraction of the logits' standard deviation
F16_BOUND, Q8_0_BOUND, Q4_0_BOUND = 0.01, 0.06, 0.15


def _train(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> torch.nn.Module:
    """A few hundred AdamW steps of next-token prediction on one text: confident, well-separated greedy choices."""
    train_next_token(model, ids, steps)
    return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny LLaMA-style model (GQA, untied head) trained by tformer, saved as a tformer checkpoint with its
    byte-level BPE tokenizer."""
    tokenizer = Tokenizer.train([TEXT] * 50, vocab_size=300)
    config = ModelConfig.from_preset(
        "tiny-llama", vocab_size=320, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, tie_embeddings=False
    )
    torch.manual_seed(0)
    ids = torch.tensor([tokenizer.encode(TEXT * 4)])
    model = _train(build_model(config), ids, steps=200)
    directory = tmp_path_factory.mktemp("trained")
    model.save(directory / "ckpt")
    tokenizer.save(directory / "ckpt")
    return model, tokenizer, directory


def _convert(directory, kind: str):
    out = directory / f"model-{kind}.gguf"
    if not out.exists():
        assert tformer_main(shlex.split(f"convert {directory / 'ckpt'} --to gguf --type {kind} --out {out}")) == 0
    return out


def _llama(path, n_ctx: int = 128):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False)


def _llamacpp_logits(path, ids: list[int]) -> torch.Tensor:
    llama = _llama(path)
    llama.eval(ids)
    return torch.from_numpy(np.array(llama.scores[: len(ids)])).float()


def _llamacpp_greedy(path, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by argmax over llama.cpp's own logits, one token at a time through its KV cache."""
    llama = _llama(path)
    llama.eval(prompt)
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(llama.scores[llama.n_tokens - 1])))
        llama.eval(tokens[-1:])
    return tokens


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def _distance(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    return float((theirs - ours).abs().max() / ours.std())


def test_f16_same_greedy_tokens_in_llama_cpp(trained):
    model, tokenizer, directory = trained
    file = _convert(directory, "f16")
    ours = from_gguf(file)  # the model's weights rounded to f16, as the file holds them
    prompt = tokenizer.encode(PROMPT_TEXT)
    expected = _greedy(ours, prompt, NEW_TOKENS)
    assert _greedy(model, prompt, NEW_TOKENS) == expected  # f16 rounding alone flips none of them
    assert _llamacpp_greedy(file, prompt, NEW_TOKENS) == expected
    ids = prompt + expected
    with torch.no_grad():
        reference = ours(torch.tensor([ids]))[0].float()
    distance = _distance(_llamacpp_logits(file, ids), reference)
    print(f"\nf16: {NEW_TOKENS} greedy tokens equal; max logit difference {distance:.4f} x std")
    assert distance < F16_BOUND
    # llama.cpp reads the tokenizer from the file: its ids for a text are tformer's (tformer's byte-level
    # pre-tokenizer adds the space before the first word, which llama.cpp's gpt2 model leaves to the text)
    llama = _llama(file)
    assert llama.tokenize(b" " + PROMPT_TEXT.encode(), add_bos=False, special=False) == prompt


@pytest.mark.parametrize(("kind", "bound"), [("q8_0", Q8_0_BOUND), ("q4_0", Q4_0_BOUND)])
def test_quantized_logits_within_bound(trained, kind, bound):
    """tformer and llama.cpp on the same quantized file: the same dequantized weights, llama.cpp's activations
    rounded to 8-bit blocks; greedy tokens reported, not required (a 4-bit file may flip a close choice)."""
    _, tokenizer, directory = trained
    file = _convert(directory, kind)
    ours = from_gguf(file)
    prompt = tokenizer.encode(PROMPT_TEXT)
    expected = _greedy(ours, prompt, NEW_TOKENS)
    ids = prompt + expected
    with torch.no_grad():
        reference = ours(torch.tensor([ids]))[0].float()
    distance = _distance(_llamacpp_logits(file, ids), reference)
    greedy = _llamacpp_greedy(file, prompt, NEW_TOKENS)
    agree = next((i for i, (a, b) in enumerate(zip(greedy, expected, strict=True)) if a != b), NEW_TOKENS)
    print(f"\n{kind}: max logit difference {distance:.4f} x std; greedy tokens agree on {agree} of {NEW_TOKENS}")
    assert distance < bound


def test_mixture_of_experts_same_greedy_tokens_in_llama_cpp(trained, tmp_path):
    """A Mixtral-style model (3 experts, 2 per token) written at f16: llama.cpp routes it as tformer does."""
    _, tokenizer, _ = trained
    config = ModelConfig.from_preset(
        "tiny-llama", vocab_size=320, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, n_experts=3, n_experts_per_token=2
    )
    torch.manual_seed(1)
    ids = torch.tensor([tokenizer.encode(TEXT * 4)])
    model = _train(build_model(config), ids, steps=150)
    file = tmp_path / "moe-f16.gguf"
    to_gguf(model, file, tokenizer, "f16")
    ours = from_gguf(file)
    prompt = tokenizer.encode(PROMPT_TEXT)
    expected = _greedy(ours, prompt, NEW_TOKENS)
    assert _llamacpp_greedy(file, prompt, NEW_TOKENS) == expected
    with torch.no_grad():
        reference = ours(torch.tensor([prompt + expected]))[0].float()
    distance = _distance(_llamacpp_logits(file, prompt + expected), reference)
    print(f"\nMoE f16: {NEW_TOKENS} greedy tokens equal; max logit difference {distance:.4f} x std")
    assert distance < F16_BOUND
