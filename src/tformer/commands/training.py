"""The training commands: `train`, `eval`, `translate`, `average` and `estimate` (will a run fit?)."""

from __future__ import annotations

import sys
from pathlib import Path


def train(recipe: str, overrides: list[str], device: str | None = None) -> None:
    """Train a model from a recipe (a YAML file with `model:` and `train:` sections); resumes if interrupted.

    recipe: YAML recipe, e.g. configs/en-de-10min.yaml
    overrides: section.key=value pairs that override the recipe, e.g. train.max_steps=100 model.d_model=256
    device: cpu, cuda or cuda:N (one process a GPU under torchrun; docs/devices.md) (default: the recipe's
      train.device, else cpu)
    """
    from tformer.kernels.dispatch import resolve_device
    from tformer.training import run_recipe

    if device is not None:
        resolve_device(device)  # a clear error before the recipe is read
    run_recipe(recipe, overrides, device)


def translate(
    sentences: list[str],
    *,
    model: str,
    input: str = "",
    output: str = "",
    beam_size: int = 4,
    alpha: float = 0.6,
    patience: float = 0.0,
    batch_size: int = 32,
    batch_tokens: int = 0,
    workers: int = 0,
    dtype: str = "auto",
    quantize: str | None = None,
    device: str = "cpu",
) -> None:
    """Translate sentences given as arguments, or a file (or stdin) one sentence a line, with a trained checkpoint.

    model: a checkpoint directory, or a training run directory (its best checkpoint is used)
    sentences: source sentences; none means read --input, else stdin
    input: a text file of source sentences, one a line (an empty line gives an empty line)
    output: write the translations here, one a line in input order (default: stdout)
    beam_size: beam width (--beam); 1 is greedy search
    alpha: length penalty exponent of ((5 + len) / 6) ** alpha
    patience: stop a sentence once round(beam_size * patience) hypotheses have finished, as CTranslate2's
      patience (1 is its default; 0 searches until no live beam can beat the best, tformer's exact search)
    batch_size: most sentences a batch holds (batches are cut from the sentences sorted by length)
    batch_tokens: most padded source tokens a batch holds (0: no limit but batch_size)
    workers: batches searched at once, torch's threads shared among them (0: one per thread on the CPU, at most 4)
    dtype: weights and activations: float32, bfloat16, float16, or auto (bfloat16 if quantized, else float32)
    quantize: int8 (integer weights, activations rounded in two int8 steps) or w8a8 (one step) for the linear
      layers, on the CPU's integer dot products (default: none; docs/translation.md has their BLEU and speed)
    device: where the model runs: cpu, cuda, cuda:N, mps, ... (docs/devices.md)
    """
    from tformer.decoding.translator import Translator
    from tformer.errors import RequestError
    from tformer.kernels.dispatch import resolve_device

    where = resolve_device(device)

    if sentences and input:
        raise RequestError("give sentences as arguments or --input FILE, not both")
    if patience < 0:
        raise RequestError(f"--patience is {patience}; give 0 (exact search) or a factor above 0, e.g. 1")
    if workers < 0:
        raise RequestError(f"--workers is {workers}; give 0 (one per thread) or a number of batches, e.g. 1")
    translator = Translator.load(model, dtype, quantize)
    translator.model.to(where)
    if sentences:
        lines = list(sentences)
    elif input:
        try:
            lines = Path(input).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise RequestError(f"cannot read --input {input}: {err.strerror}") from None
    else:
        lines = sys.stdin.read().splitlines()
    filled = [i for i, line in enumerate(lines) if line.strip()]  # an empty line stays an empty line
    progress = None
    if sys.stderr.isatty() and len(filled) > 1:
        from tqdm import tqdm

        progress = tqdm(total=len(filled), unit="sent", file=sys.stderr, leave=False)
    try:
        translated = translator.translate_batch(
            [lines[i] for i in filled],
            beam_size,
            alpha,
            batch_size,
            patience=patience or None,
            batch_tokens=batch_tokens,
            progress=None if progress is None else progress.update,
            workers=workers or None,
        )
    finally:
        if progress is not None:
            progress.close()
    results = [""] * len(lines)
    for i, text in zip(filled, translated, strict=True):
        results[i] = text
    text = "".join(line + "\n" for line in results)
    if output:
        Path(output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


def evaluate(
    *,
    model: str,
    data: str = "bible:en-de",
    split: str = "test",
    beam_size: int = 4,
    alpha: float = 0.6,
    patience: float = 0.0,
    limit: int = 0,
    block_size: int = 0,
    workers: int = 0,
    dtype: str = "auto",
    quantize: str | None = None,
    device: str = "cpu",
) -> None:
    """Score a checkpoint on a held-out split or a file: a translation model with sacreBLEU, a decoder LM with
    perplexity, an MLM encoder with masked-token accuracy and MLM loss.

    model: a checkpoint directory, or a training run directory (its best checkpoint is used)
    data: 'bible:en-de' / 'bible:en-fr' (uses --split; language models read its English side) or a TSV / JSONL
        file of source and reference (language models: a text file, one line per example)
    split: dev or test, for the embedded corpus
    patience: translation: stop a sentence once round(beam_size * patience) hypotheses have finished (CTranslate2's
      patience; 0: exact search)
    limit: score only the first N sentences (0: all)
    block_size: decoder LMs: score the lines packed into blocks of this many tokens (0: each line on its own)
    workers: translation: batches searched at once (0: one per thread on the CPU, at most 4)
    dtype: translation: weights and activations: float32, bfloat16, float16, or auto (bfloat16 if quantized)
    quantize: translation: int8 or w8a8 linear layers (default: none)
    device: where the model runs: cpu, cuda, cuda:N, mps, ... (docs/devices.md)
    """
    from tformer.kernels.dispatch import resolve_device
    from tformer.training import evaluate_checkpoint
    from tformer.training.lm_eval import evaluate_lm_checkpoint, is_language_model

    where = resolve_device(device)

    if is_language_model(model):
        score = evaluate_lm_checkpoint(model, data, split, limit, block_size, where)
        print(f"{split + ' ' if data.startswith('bible:') else ''}{score.summary()}")
        return

    result = evaluate_checkpoint(
        model,
        data,
        split,
        beam_size,
        alpha,
        limit,
        patience=patience or None,
        device=where,
        dtype=dtype,
        quantize=quantize,
        workers=workers or None,
    )
    for sample in result.samples(3):
        print(f"src: {sample['source']}\nhyp: {sample['hypothesis']}\nref: {sample['reference']}\n")
    name = f"{split} " if data.startswith("bible:") else ""
    print(
        f"{name}BLEU {result.bleu:.2f} on {len(result.hypotheses)} sentences, beam {beam_size}"
        f"{f', patience {patience:g}' if patience else ''}, decoded in "
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
