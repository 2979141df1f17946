"""`--device` on every command that runs a model: the name checked first (a ConfigError saying how to get the
device), then the model, engine and kernels on that device. The CUDA path itself: tests/test_cuda.py (`-m cuda`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tformer.cli import build_parser, main
from tformer.errors import ConfigError
from tformer.kernels.dispatch import PORTABLE_SWITCH, resolve_device

# every command that loads a model to run it, with the least arguments that reach the device check
COMMANDS = {
    "generate": ["generate", "hello", "--model", "missing-model"],
    "serve": ["serve", "--model", "missing-model"],
    "eval": ["eval", "--model", "missing-model"],
    "translate": ["translate", "hello", "--model", "missing-model"],
    "bench": ["bench", "missing-model"],
    "embed": ["embed", "hello", "--model", "missing-model"],
    "qa": ["qa", "--model", "missing-model", "--question", "who?", "--context", "me"],
    "train": ["train", "missing-recipe.yaml"],
}


def test_resolve_device_names_the_problem_and_the_fix() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="unknown device 'gpu0'.*cpu, cuda, cuda:N"):
        resolve_device("gpu0")
    with pytest.raises(ConfigError, match="'meta' holds no numbers"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        reason = "built without CUDA.*install a CUDA build" if torch.version.cuda is None else "finds no GPU"
        with pytest.raises(ConfigError, match=f"device 'cuda:1' is unavailable: .*{reason}.*--device cpu"):
            resolve_device("cuda:1")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_model_command_takes_a_device_and_checks_it_before_loading(command: str, capsys) -> None:
    options = build_parser().parse_args(COMMANDS[command])
    assert options.device == (None if command == "train" else "cpu")  # train: the recipe's train.device
    assert main([*COMMANDS[command], "--device", "tpu-ish"]) == 2  # refused before the missing model is looked for
    err = capsys.readouterr().err
    assert "unknown device 'tpu-ish'" in err and "missing" not in err
    if not torch.cuda.is_available():
        assert main([*COMMANDS[command], "--device", "cuda"]) == 2
        assert "device 'cuda' is unavailable" in capsys.readouterr().err


def test_a_recipe_names_its_device_and_the_command_line_wins(tmp_path, capsys) -> None:
    from helpers import write_recipe

    recipe = write_recipe(tmp_path, device="tpu-ish", max_steps=1)
    assert main(["train", str(recipe)]) == 2  # refused before the corpus is read or a model built
    assert "unknown device 'tpu-ish'" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(["train", str(recipe), "train.save_every=1", "--device", "cpu"]) == 0  # the command line wins
    assert "device: cpu" in (tmp_path / "run" / "train.yaml").read_text()  # the run records where it trained


def test_generate_on_the_portable_path_prints_what_the_native_engine_generates(tmp_path) -> None:
    from tformer import ModelConfig, build_model
    from tformer.data.tokenizer import Tokenizer
    from tformer.engine import Engine, SamplingParams

    texts = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today"] * 20
    tokenizer = Tokenizer.train(texts, vocab_size=300)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny-llama", vocab_size=len(tokenizer), dropout=0.0)).eval()
    model.save(tmp_path)
    tokenizer.save(tmp_path)
    expected = Engine(model, tokenizer).generate("the cat", SamplingParams(max_tokens=8, temperature=0.0))[0].text
    command = [sys.executable, "-m", "tformer", "generate", "the cat", "--model", str(tmp_path), "--device", "cpu"]
    command += ["--max-tokens", "8", "--no-chat", "--quantize", "none"]
    env = {**os.environ, PORTABLE_SWITCH: "1"}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
