"""Plain functions and data that several test modules share; fixtures and the tiny-config helpers live in conftest.py.

- The engine, speculation and quantization tests: the uncached greedy decoder, the bf16 rounding margin, prompts of
  mixed lengths, the decoder variants the engine must serve, and the chi-square statistic.
- The training tests: a tiny recipe on a synthetic corpus, the trainer built from it or run as `tformer train`.
- The serving tests: a tiny checkpoint, a live server in a thread, the offline Engine as the reference, and
  the client-side checks of /metrics and OpenAI's error shape.
- The GGUF tests: llama.cpp's permutation of q and k rows.
- The Hugging Face tests: the transformers models they compare against, built from configs with random weights.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import torch
import uvicorn
import yaml

from tformer import ModelConfig, build_model
from tformer.data.tokenizer import Tokenizer
from tformer.inference import Completion, Engine, EngineConfig, SamplingParams
from tformer.inference.quantize import set_precision
from tformer.interop.loading import load_pretrained
from tformer.serve import AsyncEngine, create_app
from tformer.training import Trainer, load_recipe
from tformer.training.checkpoint import list_checkpoints

# ---- the engine: decoder variants and decoding references -------------------------------------------------------

DECODERS = {
    "llama (RoPE, GQA, RMSNorm, SwiGLU)": dict(preset="tiny-llama"),
    "gpt2 (learned positions)": dict(preset="tiny-gpt2"),
    "alibi": dict(preset="tiny-llama", position="alibi"),
    "sliding window": dict(preset="tiny-llama", sliding_window=5),
}


def reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the full uncached forward at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy_within_rounding(model: torch.nn.Module, prompt: list[int], tokens: list[int], margin: float) -> bool:
    """Whether each of `tokens` scores within `margin` of the best logit of the uncached forward on the prefix
    before it: greedy decoding up to near-ties that bf16 rounding can flip either way.

    Two bf16 paths that reduce in different shapes (cached decode against the full forward) round differently,
    so tests of bf16 paths state this margin instead of demanding the reference's exact tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].float()  # (len(tokens), V)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return bool((chosen >= logits.amax(1) - margin).all())


def top2_gap(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> float:
    """The smallest gap between the best and second-best logit of the uncached forward along `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].float()  # (len(tokens), V)
    best = logits.topk(2, dim=-1).values  # (len(tokens), 2)
    return float((best[:, 0] - best[:, 1]).min())


def prompts_of_mixed_lengths(vocab: int, lengths: tuple[int, ...] = (7, 2, 13, 1, 20)) -> list[list[int]]:
    """Seeded random prompts, one per length."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed `counts` against the expected distribution `probs`."""
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---- training: a tiny recipe and the ways to run it ------------------------------------------------------------

WORDS = "zero one two three four five six seven eight nine".split()
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny tensors: threads only contend on a busy machine


def write_corpus(path: Path, n: int = 200) -> Path:
    """A reversal task on number words: "three one four" -> "four one three"."""
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 5))]
        lines.append(f"{' '.join(words)}\t{' '.join(reversed(words))}\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def write_recipe(directory: Path, **train: object) -> Path:
    """A recipe for the tiny model on the synthetic corpus, with dropout so that resuming depends on the RNG."""
    directory.mkdir(parents=True, exist_ok=True)
    train = {
        "corpus": str(write_corpus(directory / "corpus.tsv")), "vocab_size": 300, "max_len": 32,
        "max_tokens": 256, "max_steps": 20, "save_every": 5, "eval_every": 10_000, "log_every": 5,
        "optimizer": "adamw-cosine", "lr": 1e-3, "warmup": 5, "out_dir": str(directory / "run"), **train,
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny-transformer", "dropout": 0.1}, "train": train}))
    return path


def trainer(recipe: Path, *overrides: str) -> Trainer:
    """The trainer of a recipe file with `section.key=value` overrides, in this process."""
    return Trainer(*load_recipe(recipe, list(overrides)))


def tformer_train(recipe: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`tformer train` on a recipe in a subprocess with one thread, so that exit codes and output are real."""
    command = [sys.executable, "-m", "tformer", "train", str(recipe), *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def steps(run_dir: Path) -> list[int]:
    """The steps of the run's finished checkpoints, oldest first."""
    return [int(p.name.removeprefix("step-")) for p in list_checkpoints(run_dir)]


# ---- GGUF -----------------------------------------------------------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows (its interleaved RoPE pairs)."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


# ---- Hugging Face: reference models built by transformers from configs, with random weights ---------------

ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 500.0}
# case -> (model_type, architecture, config fields). The "-odd" cases have odd head counts and widths, a vocabulary
# that is no multiple of 8, GQA with an odd number of KV heads, untied or unshared embeddings and other activations.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("gpt2", "GPT2LMHeadModel", dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
    "gpt2-odd": ("gpt2", "GPT2LMHeadModel", dict(
        vocab_size=101, n_positions=48, n_embd=33, n_layer=3, n_head=3, n_inner=50, activation_function="gelu",
        layer_norm_epsilon=1e-6, tie_word_embeddings=False)),
    "llama": ("llama", "LlamaForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters=ROPE_DEFAULT)),
    "llama-odd": ("llama", "LlamaForCausalLM", dict(
        vocab_size=101, hidden_size=36, intermediate_size=50, num_hidden_layers=3, num_attention_heads=9,
        num_key_value_heads=3, head_dim=6, max_position_embeddings=64, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0})),
    "llama-dynamic": ("llama", "LlamaForCausalLM", dict(  # inputs run past the 8 trained positions
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8, rope_parameters={"rope_type": "dynamic", "factor": 2.0})),
    "llama-yarn": ("llama", "LlamaForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, rope_parameters={  # betas that move the ramp's ends
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 2.0,
            "beta_slow": 0.25, "rope_theta": 50.0})),
    "mistral": ("mistral", "MistralForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)),
    "mistral-odd": ("mistral", "MistralForCausalLM", dict(
        vocab_size=101, hidden_size=36, intermediate_size=50, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, head_dim=6, max_position_embeddings=64, sliding_window=5, tie_word_embeddings=True)),
    "bert-mlm": ("bert", "BertForMaskedLM", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64)),
    "bert-mlm-odd": ("bert", "BertForMaskedLM", dict(
        vocab_size=101, hidden_size=33, num_hidden_layers=3, num_attention_heads=3, intermediate_size=50,
        max_position_embeddings=40, type_vocab_size=3, hidden_act="gelu_new", layer_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "bert": ("bert", "BertModel", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64)),
    "bert-odd": ("bert", "BertModel", dict(
        vocab_size=101, hidden_size=33, num_hidden_layers=1, num_attention_heads=11, intermediate_size=50,
        max_position_embeddings=40, type_vocab_size=1, hidden_act="relu")),
    "bart": ("bart", "BartForConditionalGeneration", dict(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
    "bart-odd": ("bart", "BartForConditionalGeneration", dict(
        vocab_size=101, d_model=33, encoder_layers=3, decoder_layers=2, encoder_attention_heads=3,
        decoder_attention_heads=3, encoder_ffn_dim=50, decoder_ffn_dim=50, max_position_embeddings=64,
        scale_embedding=True, activation_function="relu", tie_word_embeddings=False)),
    "marian": ("marian", "MarianMTModel", dict(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=95, decoder_start_token_id=95, eos_token_id=0, scale_embedding=True,
        activation_function="swish")),
    "marian-odd": ("marian", "MarianMTModel", dict(
        vocab_size=101, decoder_vocab_size=89, share_encoder_decoder_embeddings=False, d_model=30, encoder_layers=3,
        decoder_layers=2, encoder_attention_heads=3, decoder_attention_heads=3, encoder_ffn_dim=50,
        decoder_ffn_dim=50, max_position_embeddings=64, pad_token_id=88, decoder_start_token_id=88, eos_token_id=0,
        scale_embedding=True)),
}


def hf_model(case: str) -> Any:
    """The transformers model of a case with random weights: every parameter moved off its initial value."""
    import transformers  # slow to import: only the tests that build a reference model pay for it

    model_type, architecture, fields = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # norm gains away from 1, biases away from 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if not (model_type == "marian" and "embed_positions" in name):  # Marian's fixed sinusoids
                p.add_(torch.randn_like(p) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("final_logits_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.2)
    return model.eval()


# ---- serving: a tiny checkpoint, a live server, and the offline reference ---------------------------------------

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today", "birds sing at dawn"] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NAME = "tiny"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def save_tiny_checkpoint(directory: Path, max_seq_len: int) -> Path:
    """A tiny LLaMA-style decoder and a BPE tokenizer with a chat template, saved as a tformer checkpoint."""
    tokenizer = Tokenizer.train(TEXTS, vocab_size=300)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny-llama", vocab_size=len(tokenizer), dropout=0.0, max_seq_len=max_seq_len)
    build_model(config).eval().save(directory)
    tokenizer.save(directory)
    return directory


class LiveServer:
    """uvicorn serving `create_app(...)` in a background thread of this process, on a free loopback port."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 name: str = NAME, draft: torch.nn.Module | None = None) -> None:
        self.tokenizer = tokenizer
        self.engine = AsyncEngine(Engine(model, tokenizer, config, draft=draft))
        self.app = create_app(self.engine, tokenizer, name)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.engine.is_running, "the engine thread outlived the server"


class Offline:
    """The reference: an offline Engine on its own copy of the same checkpoint."""

    def __init__(self, path: Path | str, quantize: str | None = None) -> None:
        model, self.tokenizer = load_pretrained(path)
        set_precision(model, "auto", quantize)  # as `tformer serve` does: bf16 activations when quantized
        self.engine = Engine(model, self.tokenizer)

    def complete(self, prompt: str | list[int], **params: Any) -> Completion:
        return self.engine.generate([prompt], SamplingParams(**params))[0]

    def chat(self, messages: list[dict[str, str]], **params: Any) -> Completion:
        return self.complete(self.tokenizer.apply_chat_template(messages), **params)


def client(server: LiveServer, cls: type = openai.OpenAI) -> Any:
    return cls(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
