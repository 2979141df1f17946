"""Plain functions and data that several test modules share; fixtures and the tiny-config helpers live in conftest.py,
the Hugging Face reference models in hf_cases.py and the serving helpers in serve_helpers.py.

- The engine, speculation and quantization tests: the uncached greedy decoder, the bf16 rounding margin, prompts of
  mixed lengths, the decoder variants the engine must serve, and the chi-square statistic.
- The training tests: a tiny recipe on a synthetic corpus, the trainer built from it or run as `tformer train`.
- The fine-tuning and LoRA tests: the pretrained model's text, a recipe from it, a run interrupted and resumed.
- The GGUF tests: llama.cpp's permutation of q and k rows, a transformers LLaMA's tensors and metadata as GGUF,
  and a small SentencePiece vocabulary with byte fallback as a GGUF file.
- The figure tests: a drawn PNG.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from tformer.checkpoints import list_checkpoints
from tformer.training import Trainer, load_recipe

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


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command that runs `args` (a script or `-m module ...`) on `nproc` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def run_processes(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `command` in its own process group with ENV; past `timeout` seconds the whole group is killed
    (torchrun's workers too, which a plain subprocess timeout would leave running) and the test fails."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            raise AssertionError(f"timed out after {timeout} s: {' '.join(command)}\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


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
        "corpus": str(write_corpus(directory / "corpus.tsv")),
        "vocab_size": 300,
        "max_len": 32,
        "max_tokens": 256,
        "max_steps": 20,
        "save_every": 5,
        "eval_every": 10_000,
        "log_every": 5,
        "optimizer": "adamw-cosine",
        "lr": 1e-3,
        "warmup": 5,
        "out_dir": str(directory / "run"),
        **train,
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


# ---- fine-tuning: a tiny pretrained model's text, recipe, and an interrupted run ------------------------------

LINES = [
    "In the beginning God created the heavens and the earth.",
    "The earth was formless and empty, and darkness was on the surface of the deep.",
    "God said, let there be light, and there was light.",
    "God saw the light, and saw that it was good.",
    "God called the light day, and the darkness he called night.",
    "There was evening and there was morning, the first day.",
] * 4


def write_finetune_recipe(directory: Path, init_from: Path, model: dict | None = None, **train: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    train = {
        "init_from": str(init_from),
        "corpus": str(corpus),
        "objective": "clm",
        "max_len": 32,
        "max_tokens": 256,
        "max_steps": 10,
        "save_every": 5,
        "eval_every": 10_000,
        "log_every": 1,
        "optimizer": "adamw-cosine",
        "lr": 3e-3,
        "warmup": 2,
        "label_smoothing": 0.0,
        "out_dir": str(directory / "run"),
        **train,
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": model, "train": train} if model else {"train": train}))
    return path


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


def interrupt_and_resume(recipe: Path, tmp_path: Path) -> tuple[Trainer, Trainer]:
    """Runs `recipe` uninterrupted, and again killed right after its first checkpoint (at step 5) and resumed:
    the two trainers, for a test to compare what they wrote."""
    whole = trainer(recipe, f"train.out_dir={tmp_path / 'whole'}")
    whole.fit()
    stopped = trainer(recipe, f"train.out_dir={tmp_path / 'stopped'}")
    save = stopped._save

    def save_then_die() -> None:  # as if killed right after the first checkpoint
        save()
        raise KeyboardInterrupt

    stopped._save = save_then_die
    try:
        stopped.fit()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the run was not interrupted")
    assert steps(stopped.run_dir) == [5]
    resumed = trainer(recipe, f"train.out_dir={tmp_path / 'stopped'}")
    assert resumed.step == 5
    resumed.fit()
    return whole, resumed


# ---- GGUF -----------------------------------------------------------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows (its interleaved RoPE pairs)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


LAYER_NAMES = {  # transformers LlamaForCausalLM -> GGUF, per layer
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_spm_gguf(path: Path, pieces: list[str]) -> Path:
    """A LLaMA-style SentencePiece vocabulary as a GGUF file with no tensors: <unk>, <s>, </s>, the 256 byte
    pieces <0x00>..<0xFF> (byte fallback), then `pieces` scored 0, -1, -2, ... in their order."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *pieces]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))  # unknown, control, byte, normal
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names, q and k permuted as llama.cpp's converter writes them."""
    cfg, state = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for hf_name, name in LAYER_NAMES.items():
            value = state[f"model.layers.{i}.{hf_name}.weight"]
            if name in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if name == "attn_q" else cfg.num_key_value_heads
                value = llama_cpp_permute(value, heads)
            tensors[f"blk.{i}.{name}.weight"] = value
    return tensors


def llama_metadata(model: Any) -> dict[str, Any]:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return {
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "rope.dimension_count": head_dim,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "vocab_size": cfg.vocab_size,
    }


# ---- figures -----------------------------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    """A PNG file of a drawn figure: an empty canvas has one colour, text and a plot have many."""
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=256)  # None: more than 256
    assert colours is None or len(colours) > 20, f"{path}: only {len(colours)} colours"
