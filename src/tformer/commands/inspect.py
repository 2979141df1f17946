"""The commands that describe a model without running it: `info`, `presets` and `viz`."""

from __future__ import annotations

from pathlib import Path

from tformer.config import ModelConfig
from tformer.errors import ConfigError


def info(model: str, context: int | None = None, dtype: str = "fp16") -> None:
    """Print the parameter count, FLOPs per token and KV-cache size of a preset or config file.

    model: a preset name (e.g. transformer-base, gpt2, llama2-7b) or a YAML/JSON config file
    context: context length for attention FLOPs and the KV-cache total (default: the model's max_seq_len)
    dtype: KV-cache element type: fp32, fp16, bf16, fp8 or int8 (int8 with a float32 scale per head vector, as
      the engine's `--kv-cache-dtype int8` keeps)
    """
    from tformer.info import format_info, model_info

    config = ModelConfig.from_file(model) if Path(model).is_file() else ModelConfig.from_preset(model)
    print(format_info(model, config, model_info(config, context, dtype)))


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
            from tformer.checkpoints import resolve_checkpoint
            from tformer.models import load

            source = load(resolve_checkpoint(target))
        else:
            source = ModelConfig.from_file(target) if Path(target).is_file() else ModelConfig.from_preset(target)
        plots.plot_positions(source, out, length)
    elif kind == "attention":
        if model is None:
            raise ConfigError("'attention' needs --model: a translation checkpoint or training run directory")
        from tformer.checkpoints import resolve_checkpoint
        from tformer.data import Tokenizer
        from tformer.decoding.attention_map import cross_attention_map
        from tformer.models import load

        checkpoint = resolve_checkpoint(model)
        attention = cross_attention_map(load(checkpoint), Tokenizer.load(checkpoint), target, beam_size)
        plots.plot_cross_attention(attention, out)
    else:
        raise ConfigError(f"unknown figure '{kind}'; choose 'curves', 'positions' or 'attention'")
    print(f"wrote {out}")


def presets() -> None:
    """List the named model configurations with their parameter counts (built on the meta device: no memory)."""
    from tformer.info import model_info
    from tformer.presets import PRESETS

    for name, values in PRESETS.items():
        n_params = model_info(ModelConfig.from_preset(name)).n_params
        print(f"{name:18s} {values['family']:22s} {n_params:>18,}")
