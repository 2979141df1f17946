"""`tformer <command>`: a table from command name to a typed function.

Each function's signature becomes its command line: parameters without a default are positional,
keyword-only ones and those with a default are `--options`, and a list is a variable-length positional; the
docstring's first line is the help text, and its `name: text` lines (continued on indented lines) document the
parameters.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from tformer.config import ModelConfig
from tformer.errors import CheckpointError, ConfigError, TformerError


def info(model: str, context: int | None = None, dtype: str = "fp16") -> None:
    """Print the parameter count, FLOPs per token and KV-cache size of a preset or config file.

    model: a preset name (e.g. transformer-base, gpt2, llama2-7b) or a YAML/JSON config file
    context: context length for attention FLOPs and the KV-cache total (default: the model's max_seq_len)
    dtype: KV-cache element type: fp32, fp16, bf16, fp8 or int8
    """
    from tformer.info import format_info, model_info

    config = ModelConfig.from_file(model) if Path(model).is_file() else ModelConfig.from_preset(model)
    print(format_info(model, config, model_info(config, context, dtype)))


def train(recipe: str, overrides: list[str], device: str = "cpu") -> None:
    """Train a model from a recipe (a YAML file with `model:` and `train:` sections); resumes if interrupted.

    recipe: YAML recipe, e.g. configs/en-de-10min.yaml
    overrides: section.key=value pairs that override the recipe, e.g. train.max_steps=100 model.d_model=256
    device: cpu or cuda
    """
    from tformer.training import run_recipe

    run_recipe(recipe, overrides, device)


def translate(sentences: list[str], *, model: str, beam_size: int = 4, alpha: float = 0.6) -> None:
    """Translate sentences given as arguments, or one per line from stdin, with a trained checkpoint.

    model: a checkpoint directory, or a training run directory (its best checkpoint is used)
    sentences: source sentences; none means read stdin
    beam_size: beam width; 1 is greedy search
    alpha: length penalty exponent of ((5 + len) / 6) ** alpha
    """
    from tformer.training import load_translator

    translator = load_translator(model)
    lines = sentences or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for line in translator(lines, beam_size, alpha):
        print(line)


def evaluate(
    *,
    model: str,
    data: str = "bible:en-de",
    split: str = "test",
    beam_size: int = 4,
    alpha: float = 0.6,
    limit: int = 0,
) -> None:
    """Score a translation checkpoint with sacreBLEU on a held-out split or a parallel file.

    model: a checkpoint directory, or a training run directory (its best checkpoint is used)
    data: 'bible:en-de' / 'bible:en-fr' (uses --split) or a TSV / JSONL file of source and reference
    split: dev or test, for the embedded corpus
    limit: score only the first N sentences (0: all)
    """
    from tformer.training import evaluate_checkpoint

    result = evaluate_checkpoint(model, data, split, beam_size, alpha, limit)
    for sample in result.samples(3):
        print(f"src: {sample['source']}\nhyp: {sample['hypothesis']}\nref: {sample['reference']}\n")
    name = f"{split} " if data.startswith("bible:") else ""
    print(
        f"{name}BLEU {result.bleu:.2f} on {len(result.hypotheses)} sentences, beam {beam_size}, decoded in "
        f"{result.seconds:.0f} s ({result.signature})"
    )


def average(checkpoints: list[str], *, out: str) -> None:
    """Average the weights of several checkpoints of one run (the paper averages the last 5 or 20).

    checkpoints: checkpoint directories (checkpoints/step-*)
    out: directory to write the averaged checkpoint to
    """
    from tformer.training.checkpoint import average_checkpoints

    average_checkpoints([Path(c) for c in checkpoints], Path(out))
    print(f"averaged {len(checkpoints)} checkpoints into {out}")


def viz(kind: str, target: str, *, out: str, length: int = 100, model: str | None = None, beam_size: int = 1) -> None:
    """Draw a figure to a PNG: a run's training curves, a model's position scheme or a translation's cross-attention.

    kind: 'curves', 'positions' or 'attention'
    target: for 'curves', a training run directory; for 'positions', a preset, a config file, or a checkpoint or
      run directory (needed for learned positions: their trained table is drawn); for 'attention', the sentence
    out: PNG file to write
    length: number of positions to draw, for 'positions'
    model: for 'attention': a translation checkpoint directory, or a training run directory (its best checkpoint)
    beam_size: for 'attention': the beam width of the translation whose attention is drawn; 1 is greedy search
    """
    from tformer import viz as plots

    if kind == "curves":
        plots.plot_training_curves(Path(target) / "metrics.jsonl", out)
    elif kind == "positions":
        if Path(target).is_dir():
            from tformer.models import load
            from tformer.training.checkpoint import resolve_checkpoint

            source = load(resolve_checkpoint(target))
        else:
            source = ModelConfig.from_file(target) if Path(target).is_file() else ModelConfig.from_preset(target)
        plots.plot_positions(source, out, length)
    elif kind == "attention":
        if model is None:
            raise ConfigError("'attention' needs --model: a translation checkpoint or training run directory")
        from tformer.data import Tokenizer
        from tformer.inference.attention_map import cross_attention_map
        from tformer.models import load
        from tformer.training.checkpoint import resolve_checkpoint

        checkpoint = resolve_checkpoint(model)
        attention = cross_attention_map(load(checkpoint), Tokenizer.load(checkpoint), target, beam_size)
        plots.plot_cross_attention(attention, out)
    else:
        raise ConfigError(f"unknown figure '{kind}'; choose 'curves', 'positions' or 'attention'")
    print(f"wrote {out}")


def _keep_compiled_kernels() -> None:
    """Points torch.compile's caches (FX graphs, kernels) at the user's cache directory instead of /tmp, so that
    a later `--compile` run, after a reboot too, reuses what the first one compiled; $XDG_CACHE_HOME and an
    explicit $TORCHINDUCTOR_CACHE_DIR are respected."""
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_home / "tformer" / "inductor"))


def generate(
    prompts: list[str],
    *,
    model: str,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat: bool = True,
    quantize: str | None = None,
    dtype: str = "auto",
    compile: bool = False,
    draft_model: str | None = None,
    draft_quantize: str | None = None,
    speculative_tokens: int = 4,
) -> None:
    """Generate text from prompts given as arguments, or one per line from stdin, streaming as it goes.

    model: a .gguf file, a tformer checkpoint directory or a Hugging Face model directory
    prompts: the prompts; none means read stdin
    temperature: 0 is greedy
    chat: wrap each prompt as a user message with the tokenizer's chat template, when it has one
    quantize: int8 or int4 (weights only) or w8a8 (weights and activations, x86) for the linear layers (default: none)
    dtype: weights and activations: float32, bfloat16, float16, or auto (bfloat16 if quantized, else float32)
    compile: run decode steps through torch.compile: the first run spends about 40 s compiling (SmolLM2, 2
      cores), later runs about 15 s, reusing the kernels cached under ~/.cache/tformer
    draft_model: a small model on the same tokenizer for speculative decoding (or the model itself, quantized)
    draft_quantize: int8, int4 or w8a8 quantization of the draft model (default: none)
    speculative_tokens: draft tokens per decode step, with a draft model
    """
    from tformer.inference import EngineConfig, SamplingParams
    from tformer.serve.loading import load_engine

    if compile:
        _keep_compiled_kernels()
    config = EngineConfig(compile=compile, num_speculative_tokens=speculative_tokens)
    engine = load_engine(model, config, quantize, dtype, draft_model, draft_quantize)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise CheckpointError(f"{model} has no tokenizer.json; `tformer generate` needs one to read text prompts")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    for prompt in prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]:
        if chat and tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        for piece in engine.stream(prompt, params):
            print(piece.text, end="", flush=True)
        print()


def serve(
    *,
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    quantize: str | None = None,
    dtype: str = "auto",
    max_model_len: int = 0,
    max_seqs: int = 64,
    max_batched_tokens: int = 512,
    kv_cache_mb: int = 1024,
    compile: bool = False,
    draft_model: str | None = None,
    draft_quantize: str | None = None,
    speculative_tokens: int = 4,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics).

    model: a .gguf file, a tformer checkpoint directory or a Hugging Face model directory
    host: address to bind; the default, loopback, accepts no other machine (0.0.0.0 accepts all)
    port: TCP port to listen on
    api_key: require 'Authorization: Bearer KEY' on /v1 routes (default: $TFORMER_API_KEY, else none)
    model_name: the model id clients send and /v1/models lists (default: the file or directory name)
    quantize: int8 or int4 (weights only) or w8a8 (weights and activations, x86) for the linear layers (default: none)
    dtype: weights and activations: float32, bfloat16, float16, or auto (bfloat16 if quantized, else float32)
    max_model_len: the context a request may fill, prompt and output (default 0: the model's)
    max_seqs: requests decoded together in one continuous batch
    max_batched_tokens: tokens per engine step; longer prompts are prefilled in chunks of this size
    kv_cache_mb: memory for the paged KV cache, in MiB
    compile: run decode steps through torch.compile, compiled before the server listens: about 40 s the first
      time (SmolLM2, 2 cores), about 15 s later, from the kernels cached under ~/.cache/tformer
    draft_model: a small model on the same tokenizer for speculative decoding (or the model itself, quantized)
    draft_quantize: int8, int4 or w8a8 quantization of the draft model (default: none)
    speculative_tokens: draft tokens per decode step, with a draft model
    """
    from tformer.inference import EngineConfig
    from tformer.serve import run_server

    if compile:
        _keep_compiled_kernels()
    config = EngineConfig(
        max_model_len=max_model_len,
        max_seqs=max_seqs,
        max_batched_tokens=max_batched_tokens,
        kv_cache_bytes=kv_cache_mb << 20,
        compile=compile,
        num_speculative_tokens=speculative_tokens,
    )
    run_server(
        model,
        host=host,
        port=port,
        api_key=api_key,
        model_name=model_name,
        engine_config=config,
        quantize=quantize,
        dtype=dtype,
        draft_model=draft_model,
        draft_quantize=draft_quantize,
    )


def convert(source: str, *, out: str, to: str = "tformer") -> None:
    """Convert a model: a GGUF file or Hugging Face directory to a tformer checkpoint, or any of them to HF format.

    source: a .gguf file, a Hugging Face model directory or a tformer checkpoint directory
    out: the directory to write
    to: 'tformer' (config.yaml, model.safetensors, tokenizer) or 'hf' (config.json, model.safetensors, tokenizer)
    """
    from tformer.interop import load_pretrained, to_hf

    if to not in ("tformer", "hf"):
        raise ConfigError(f"unknown target format '{to}'; choose 'tformer' or 'hf'")
    model, tokenizer = load_pretrained(source)
    if to == "tformer":
        model.save(out)
    else:
        to_hf(model, out)
    if tokenizer is not None:
        tokenizer.save(out)
    print(f"wrote {type(model).__name__} ({model.num_parameters():,} parameters) to {out} in {to} format")


def estimate(
    model: str,
    overrides: list[str],
    *,
    batch_tokens: int | None = None,
    seq_len: int | None = None,
    dtype: str | None = None,
    checkpointing: bool | None = None,
    stage: int | None = None,
    world_size: int = 1,
    optimizer: str | None = None,
    device: str = "cpu",
) -> None:
    """Predict the peak training memory per rank: weights, gradients, optimizer state, activations, temporaries.

    model: a recipe (YAML with model: and train: sections), a model config file or a preset name (e.g. llama2-7b)
    overrides: section.key=value pairs that override a recipe, e.g. train.max_tokens=8192 model.d_model=512
    batch_tokens: tokens of one micro-batch on one rank (default: the recipe's max_tokens, else one sequence)
    seq_len: padded sequence length (default: the recipe's max_len plus <s>/</s>, else the model's max_seq_len)
    dtype: fp32, bf16-autocast (train.bf16), fp16-mixed or bf16-mixed (half weights and gradients, fp32 master
      weights and Adam state: 16 bytes per parameter), or bf16-pure (default: the recipe's, else fp32)
    checkpointing: activation checkpointing of each block (default: the model's activation_checkpointing)
    stage: ZeRO stage: 0 DDP or one process, 1 optimizer state sharded, 2 and gradients (FSDP grad-op),
      3 and weights (FSDP full) (default: the recipe's parallel and fsdp_sharding, else 0)
    world_size: data-parallel ranks that shard (ZeRO) or replicate (DDP) the model
    optimizer: adam, adamw, adam-noam, adamw-cosine, sgd or sgd-momentum (default: the recipe's, else adam)
    device: cpu or cuda; on the CPU, bf16 training over at most 256 keys takes the math attention path
    """
    from tformer.training.estimate import estimate_memory, format_estimate, load_inputs

    config, inputs = load_inputs(model, overrides)
    given = {"batch_tokens": batch_tokens, "seq_len": seq_len, "dtype": dtype, "stage": stage, "optimizer": optimizer}
    inputs.update({key: value for key, value in given.items() if value is not None})
    inputs.setdefault("batch_tokens", inputs["seq_len"])  # a preset or model file: one sequence per rank
    result = estimate_memory(config, checkpointing=checkpointing, world_size=world_size, device=device, **inputs)
    print(format_estimate(model, config, result))


def bench(
    model: str,
    *,
    quantize: str | None = None,
    dtype: str = "auto",
    compile: bool = False,
    batch: int = 8,
    prompt_tokens: int = 128,
    new_tokens: int = 32,
) -> None:
    """Measure prefill and decode speed (batch 1 and batch N) against memory bandwidth, and say what would help.

    model: a .gguf file, a tformer checkpoint directory or a Hugging Face directory
    quantize: int8, int4 or w8a8 for the linear layers (default: none)
    dtype: weights and activations: float32, bfloat16, float16, or auto (bfloat16 if quantized, else float32)
    compile: run decode steps through torch.compile (compiled during the warm-up)
    batch: requests decoded together for the batched figure
    prompt_tokens: prompt length (random tokens, so the prefix cache cannot help)
    new_tokens: tokens generated per request
    """
    from tformer.inference import EngineConfig
    from tformer.inference.bench import bench_engine, format_bench, remedies
    from tformer.serve.loading import load_engine

    for name, value in (("batch", batch), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        if value < (2 if name == "new_tokens" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {2 if name == 'new_tokens' else 1}")
    if compile:
        _keep_compiled_kernels()
    config = EngineConfig(compile=compile, prefix_caching=False, max_seqs=max(batch, 1))
    engine = load_engine(model, config, quantize, dtype)
    result = bench_engine(engine, prompt_tokens, new_tokens, batch)
    print(format_bench(model, result, remedies(engine, result)))


def presets() -> None:
    """List the named model configurations."""
    from tformer.presets import PRESETS

    for name, values in PRESETS.items():
        print(f"{name:18s} {values['family']}")


COMMANDS: dict[str, Callable[..., None]] = {
    "train": train,
    "eval": evaluate,
    "translate": translate,
    "generate": generate,
    "convert": convert,
    "serve": serve,
    "average": average,
    "info": info,
    "estimate": estimate,
    "bench": bench,
    "viz": viz,
    "presets": presets,
}


def _param_help(fn: Callable[..., None]) -> dict[str, str]:
    """Each parameter's help from the docstring's `name: text` lines (indented lines continue the text)."""
    doc = inspect.getdoc(fn) or ""
    helps: dict[str, str] = {}
    name = None
    for line in doc.splitlines()[1:]:
        if line.startswith("  ") and name is not None:
            helps[name] += " " + line.strip()
            continue
        name, sep, text = line.partition(": ")
        if sep and name.isidentifier():
            helps[name] = text
        else:
            name = None
    return helps


def _add_command(subparsers: argparse._SubParsersAction, name: str, fn: Callable[..., None]) -> None:
    summary = (inspect.getdoc(fn) or "").splitlines()[0]
    parser = subparsers.add_parser(name, help=summary, description=summary)
    helps = _param_help(fn)
    hints = typing.get_type_hints(fn)
    for param in inspect.signature(fn).parameters.values():
        kind = next(t for t in typing.get_args(hints[param.name]) or (hints[param.name],) if t is not type(None))
        text = helps.get(param.name, "")
        if typing.get_origin(hints[param.name]) is list:
            parser.add_argument(param.name, nargs="*", type=kind, help=text)
        elif param.default is inspect.Parameter.empty and param.kind is not param.KEYWORD_ONLY:
            parser.add_argument(param.name, type=kind, help=text)
        elif param.default is inspect.Parameter.empty:
            parser.add_argument(
                f"--{param.name.replace('_', '-')}", dest=param.name, type=kind, required=True, help=text
            )
        elif kind is bool:
            parser.add_argument(
                f"--{param.name.replace('_', '-')}",
                action=argparse.BooleanOptionalAction,
                default=param.default,
                help=text,
            )
        else:
            parser.add_argument(
                f"--{param.name.replace('_', '-')}",
                dest=param.name,
                type=kind,
                default=param.default,
                help=text if "default" in text else f"{text} (default: %(default)s)",
            )
    parser.set_defaults(_command=fn)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tformer", description="Train, inspect and serve Transformers.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, fn in COMMANDS.items():
        _add_command(subparsers, name, fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("_command")
    code = 0
    try:
        command(**args)
    except TformerError as err:
        print(f"tformer: error: {err}", file=sys.stderr)
        code = 2
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a multi-process run leaves without the interpreter's teardown: there gloo's threads can
        # abort the process ("terminate called without an active exception", exit -6) after a peer has died
        # or hung, or even after a clean run, and the launcher would see a crash instead of this exit code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
