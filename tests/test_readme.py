"""The README, run as written (as litgpt's test_readme.py does), so that the guide cannot rot.

Its Python snippets run in a scratch directory and their outputs are checked against references; its command
table is checked against `tformer --help` and each command's `--help`; its cheap command lines run and their
output is compared with what the README shows and with the arithmetic behind it; every path it names exists.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import smollm2_path
from helpers import reference_greedy

from tformer import ModelConfig, build_model, load
from tformer.cli import main as tformer_main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

pytestmark = pytest.mark.usefixtures("one_thread")  # a busy 2-core machine slows 2 threads 10x, 1 thread not


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in `language` ("" for bare fences), in order."""
    found, current, open_language = [], [], None
    for line in README.splitlines():
        if line.startswith("```"):
            if open_language is None:
                open_language, current = line[3:].strip(), []
            else:
                found += ["\n".join(current) + "\n"] if open_language == language else []
                open_language = None
        elif open_language is not None:
            current.append(line)
    return found


def section(title: str) -> str:
    """The README's text under `## title`, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.S | re.M)
    assert match, f"README has no section '## {title}'"
    return match.group(1)


def run_snippet(index: int, capsys: pytest.CaptureFixture) -> dict:
    """Runs the index-th Python block of the README in the current directory; checks that every `print(...)  # text`
    line printed that text (the README's comment is the output), and returns the block's variables."""
    code = blocks("python")[index]
    namespace: dict = {"__name__": "readme"}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    promised = [
        line.split("  # ", 1)[1].strip() for line in code.splitlines() if line.startswith("print(") and "  # " in line
    ]
    printed = capsys.readouterr().out.splitlines()
    assert [line.strip() for line in printed[: len(promised)]] == promised
    return namespace


def test_every_python_snippet_has_a_test_here() -> None:
    assert len(blocks("python")) == 3, "a README snippet was added or removed: give it a test in this file"


def test_tour_builds_saves_and_loads_a_model(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    ns = run_snippet(0, capsys)  # prints "768 12 12": GPT-2 small's width, heads and depth (Radford et al., 2019)
    assert ns["logits"].shape == (2, 10, ns["tiny"].vocab_size)
    assert (tmp_path / "runs/tiny-llama/model.safetensors").is_file()


def test_tour_trains_from_python(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    ns = run_snippet(1, capsys)
    trainer, config = ns["trainer"], ns["train_config"]
    assert ns["result"]["step"] == trainer.step == config.max_steps
    checkpoint = tmp_path / config.out_dir / "checkpoints" / f"step-{config.max_steps:08d}"
    saved = load(checkpoint).state_dict()
    trained = trainer.model.state_dict()
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)
    torch.manual_seed(config.seed)  # the trainer's own initialisation: the steps must have moved the weights
    initial = build_model(trainer.model_config).state_dict()
    assert any(not torch.equal(initial[k], trained[k]) for k in trained)


def test_tour_serves_real_weights(tmp_path, monkeypatch, capsys) -> None:
    smollm2_path()  # skips, naming the package to install, when the SmolLM2 weights are missing
    monkeypatch.chdir(tmp_path)
    ns = run_snippet(2, capsys)  # its print promises "The capital of France is Paris."
    for out in ns["outs"]:  # fp32 greedy: the engine's tokens are those of the plain uncached forward
        assert out.token_ids == reference_greedy(ns["model"], out.prompt_token_ids, len(out.token_ids))
    assert json.loads(ns["answer"].text) == {"country": "FRANCE", "capital": "Paris"}  # what its print promises


# ---- the command line ----------------------------------------------------------------------------------------------


def table_commands() -> dict[str, str]:
    """Command name -> the synopsis the README's command table gives it."""
    rows = re.findall(r"^\| `tformer (\w+)([^`]*)` \|", section("The command line"), flags=re.M)
    return {name: synopsis for name, synopsis in rows}


def test_the_command_table_lists_exactly_the_commands_of_tformer_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tformer", "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    listed = result.stdout.split("commands:", 1)[1]
    commands = re.findall(r"^    (\w+)", listed, flags=re.M)  # argparse indents each command by four spaces
    assert commands and sorted(commands) == sorted(table_commands())


@pytest.mark.parametrize("name", list(table_commands()))
def test_each_command_has_help_with_the_options_the_readme_shows(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tformer_main([name, "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith(f"usage: tformer {name} ")
    for option in re.findall(r"--[\w-]+", table_commands()[name]):
        assert option in usage, f"README shows `tformer {name} {option}`, which its --help does not list"


def readme_command_lines() -> list[str]:
    """The plain `tformer ...` lines of the README's bash blocks (the `.venv/bin/tformer` ones train or load)."""
    return [line.strip() for block in blocks("bash") for line in block.splitlines() if line.startswith("tformer ")]


def test_the_cheap_command_lines_are_info_and_presets() -> None:
    assert readme_command_lines() == ["tformer presets", "tformer info gpt2"]


def test_presets_lists_configs_of_the_families_it_names(capsys) -> None:
    assert tformer_main(shlex.split("tformer presets")[1:]) == 0
    listed = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert len(listed) > 10
    for name, family, count in listed:
        assert ModelConfig.from_preset(name).family == family
        assert int(count.replace(",", "")) > 0


def gpt2_parameters(c: ModelConfig) -> tuple[int, int]:
    """GPT-2's parameters written out: (all, without the token and position tables)."""
    d, f = c.d_model, c.d_ff
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d  # q, k, v, o; up, down; two LayerNorms
    body = c.n_decoder_layers * block + 2 * d  # the final LayerNorm; the LM head is tied to the token table
    return body + (c.vocab_size + c.max_seq_len) * d, body


def test_info_prints_what_the_readme_shows_and_the_parameter_formula(capsys) -> None:
    assert tformer_main(shlex.split("tformer info gpt2")[1:]) == 0
    output = capsys.readouterr().out
    shown = blocks("text")[0]
    assert output.strip() == shown.strip()
    total, body = gpt2_parameters(ModelConfig.from_preset("gpt2"))
    assert total == 124_439_808  # the released GPT-2 small checkpoint
    assert re.search(r"^parameters +([\d,]+) \(([\d,]+) without", output, flags=re.M).groups() == (
        f"{total:,}",
        f"{body:,}",
    )


# ---- paths -----------------------------------------------------------------------------------------------------


def test_every_file_the_readme_links_or_lays_out_exists() -> None:
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    assert links and [link for link in links if not (ROOT / link).exists()] == []
    layout = blocks("")[-1]  # the last bare block is the layout
    assert layout.startswith("src/tformer/")
    missing, folder = [], ROOT
    for line in layout.splitlines():
        top = re.match(r"^([\w/]+/)\s", line)
        sub = re.match(r"^  (\w+/)\s", line)
        if top:
            folder = ROOT / top.group(1)
        elif sub:
            folder = ROOT / "src/tformer" / sub.group(1)
        elif re.match(r"^  \w+\.py\s", line):
            folder = ROOT / "src/tformer"
        missing += [name for name in re.findall(r"\b[\w-]+\.(?:py|yaml|md)\b", line) if not (folder / name).exists()]
    assert missing == []


def test_the_benchmarks_readme_indexes_every_report_in_results() -> None:
    index = (ROOT / "benchmarks/README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([^`]+)` \|", index.split("## results/", 1)[1].split("\n## ", 1)[0], flags=re.M))
    assert listed == {path.name for path in (ROOT / "benchmarks/results").iterdir()}


def test_the_readme_is_a_short_guide_with_a_short_benchmark_table() -> None:
    """At most 200 lines; the benchmark table at most 10 rows of one short line each (history lives in
    benchmarks/README.md)."""
    assert len(README.splitlines()) <= 200
    table = section("Benchmarks").split("| benchmark (`benchmarks/...`)", 1)[1].splitlines()[2:]
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), table))
    assert 1 <= len(rows) <= 10, f"{len(rows)} rows: keep the newest 10, move the rest to benchmarks/README.md"
    assert all(len(row) <= 300 for row in rows), max(rows, key=len)
