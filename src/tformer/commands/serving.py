"""The commands that load a model to run it: `generate`, `embed`, `serve`, `bench` and `convert`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tformer.errors import CheckpointError, ConfigError
from tformer.files import cache_dir


def _keep_compiled_kernels() -> None:
    """Points torch.compile's caches (FX graphs, kernels) at the user's cache directory instead of /tmp, so that
    a later `--compile` run, after a reboot too, reuses what the first one compiled; $XDG_CACHE_HOME and an
    explicit $TORCHINDUCTOR_CACHE_DIR are respected."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir("inductor")))


def generate(
    prompts: list[str],
    *,
    model: str,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    seed: int | None = None,
    chat: bool = True,
    quantize: str = "auto",
    dtype: str = "auto",
    compile: bool = False,
    draft_model: str | None = None,
    draft_quantize: str | None = None,
    speculative_tokens: int = 4,
    kv_cache_dtype: str = "auto",
    json_schema: str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    device: str = "cpu",
) -> None:
    """Generate text from prompts given as arguments, or one per line from stdin, streaming as it goes.

    model: a .gguf file, a tformer checkpoint directory or a Hugging Face model directory
    prompts: the prompts; none means read stdin
    temperature: 0 is greedy
    min_p: keep only tokens at least this times as likely as the likeliest (llama.cpp's --min-p; 0 disables it)
    repetition_penalty: > 1 discourages every token already in the prompt or output (llama.cpp's --repeat-penalty)
    presence_penalty: subtracted once from each token the output holds (-2..2)
    frequency_penalty: subtracted per occurrence of each token in the output (-2..2)
    chat: wrap each prompt as a user message with the tokenizer's chat template, when it has one
    quantize: int8 or int4 (integer weights; activations rounded finely, in two int8 steps) or w8a8 (weights and
      activations in one int8 step, x86) for the linear layers; none for float weights; auto (the default) serves
      a quantized .gguf file as stored, as llama.cpp does (2- to 4-bit types as int4, 5- to 8-bit as int8), and
      every other model in floats
    dtype: weights and activations: float32, bfloat16, float16, or auto (bfloat16 if quantized, else float32)
    compile: run decode steps through torch.compile: the first run spends a few minutes compiling (SmolLM2 INT4 on
      a 2-core Xeon: 4 minutes), later runs about 40 s, reusing the kernels cached under ~/.cache/tformer
    draft_model: a small model on the same tokenizer for speculative decoding (or the model itself, quantized)
    draft_quantize: int8, int4 or w8a8 quantization of the draft model (default: none)
    speculative_tokens: draft tokens per decode step, with a draft model
    kv_cache_dtype: auto (the model's dtype) or int8 (keys and values as int8 with a scale per token and head:
      about half bf16's bytes, so more tokens fit and long contexts decode faster; perplexity in docs/engine.md)
    json_schema: hold the output to this JSON schema (a .json file, or the schema itself), as llama.cpp's --json-schema
    json_object: hold the output to any JSON object
    regex: hold the output to this regular expression (matched whole; \\d is an ASCII digit)
    grammar: hold the output to this grammar, GBNF (llama.cpp's --grammar) or Lark: a file, or the grammar itself
    device: where the model runs: cpu, cuda, cuda:N, mps, ... (tformer's C++ kernels on an x86 CPU, torch's ops
      elsewhere; docs/devices.md)
    """
    from tformer.engine import EngineConfig, SamplingParams
    from tformer.engine.loading import load_engine
    from tformer.kernels.dispatch import resolve_device

    resolve_device(device)  # before the (slow) load

    if compile:
        _keep_compiled_kernels()
    config = EngineConfig(compile=compile, num_speculative_tokens=speculative_tokens, kv_cache_dtype=kv_cache_dtype)
    engine = load_engine(model, config, quantize, dtype, draft_model, draft_quantize, device=device)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise CheckpointError(f"{model} has no tokenizer.json; `tformer generate` needs one to read text prompts")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        seed=seed,
        structured=_structured_output(json_schema, json_object, regex, grammar),
    )
    for prompt in prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]:
        if chat and tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        for piece in engine.stream(prompt, params):
            print(piece.text, end="", flush=True)
        print()


def embed(
    texts: list[str], *, model: str, pooling: str | None = None, normalize: bool = True, device: str = "cpu"
) -> None:
    """Print one embedding per text (arguments, or one per line from stdin) as a JSON list per line.

    model: a tformer checkpoint, a Hugging Face directory (a sentence-transformers one brings its own pooling, such
      as all-MiniLM-L6-v2's) or a .gguf file
    pooling: mean, cls or last (default: the directory's sentence-transformers setting, else mean for encoders and
      last for decoders)
    normalize: scale each vector to unit length (then a dot product is the cosine similarity)
    device: where the model runs: cpu, cuda, cuda:N, mps, ... (tformer's C++ kernels on an x86 CPU, torch's ops
      elsewhere; docs/devices.md)
    """
    import json
    import warnings

    from tformer.checkpoints import load_pretrained
    from tformer.engine.embedding import Embedder, Pooling
    from tformer.kernels.dispatch import resolve_device

    where = resolve_device(device)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weights an embedding does not use (a pooler, a head) are dropped
        net, tokenizer = load_pretrained(model)
    net.to(where)
    found = Pooling.default_for(net, model)
    chosen = Pooling(pooling or found.mode, normalize, found.max_tokens)
    embedder = Embedder(net, tokenizer, chosen)
    for vector in embedder.embed(texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]):
        print(json.dumps([round(x, 7) for x in vector.tolist()]))


def _structured_output(json_schema: str | None, json_object: bool, regex: str | None, grammar: str | None):
    """`generate`'s constraint from its options (None without one); a file's text where an option names a file."""
    import json

    from tformer.engine import StructuredOutput

    def text(value: str | None) -> str | None:
        return Path(value).read_text() if value is not None and Path(value).is_file() else value

    given = {"json": text(json_schema), "json_object": json_object, "regex": regex, "grammar": text(grammar)}
    given = {kind: value for kind, value in given.items() if value}
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"give one of --json-schema, --json-object, --regex, --grammar; got {len(given)}")
    if "json" in given:
        try:
            given["json"] = json.loads(given["json"])
        except ValueError as err:
            raise ConfigError(f"--json-schema is neither a file nor JSON: {err}") from None
    return StructuredOutput(**given)


def serve(
    *,
    model: str | None = None,
    runs: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    quantize: str = "auto",
    dtype: str = "auto",
    max_model_len: int = 0,
    max_seqs: int = 64,
    max_batched_tokens: int = 512,
    kv_cache_mb: int = 1024,
    compile: bool = False,
    draft_model: str | None = None,
    draft_quantize: str | None = None,
    speculative_tokens: int = 4,
    kv_cache_dtype: str = "auto",
    max_waiting: int = 512,
    max_body_mb: float = 8.0,
    request_timeout: float = 600.0,
    shutdown_timeout: float = 10.0,
    max_embedding_tokens: int = 65536,
    device: str = "cpu",
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1, /metrics) and a web playground at / (chat, runs, ...).

    The playground chats with a decoder, translates with an encoder-decoder and shows its cross-attention map, and
    draws the training runs under --runs live.

    model: a .gguf file, a tformer checkpoint directory, a Hugging Face model directory, or a training run
      directory (its best checkpoint); without it, only the runs dashboard is served
    runs: a directory of training runs (each with a metrics.jsonl) for the playground's dashboard (default: none)
    host: address to bind; the default, loopback, accepts no other machine (0.0.0.0 accepts all)
    port: TCP port to listen on
    api_key: require 'Authorization: Bearer KEY' on every route but /health and the page at / (default:
      $TFORMER_API_KEY, else none; prefer the variable: a flag shows in `ps`)
    model_name: the model id clients send and /v1/models lists (default: the file or directory name)
    quantize: int8 or int4 (integer weights; activations rounded finely, in two int8 steps) or w8a8 (weights and
      activations in one int8 step, x86) for the linear layers; none for float weights; auto (the default) serves
      a quantized .gguf file as stored, as llama.cpp does (2- to 4-bit types as int4, 5- to 8-bit as int8), and
      every other model in floats
    dtype: weights and activations: float32, bfloat16, float16, or auto (bfloat16 if quantized, else float32)
    max_model_len: the context a request may fill, prompt and output (default 0: the model's)
    max_seqs: requests decoded together in one continuous batch
    max_batched_tokens: tokens per engine step; longer prompts are prefilled in chunks of this size
    kv_cache_mb: memory for the paged KV cache, in MiB
    compile: run decode steps through torch.compile, compiled before the server listens: a few minutes the first
      time (SmolLM2 INT4 on a 2-core Xeon: 4 minutes), about 40 s later, from the kernels cached under
      ~/.cache/tformer
    draft_model: a small model on the same tokenizer for speculative decoding (or the model itself, quantized)
    draft_quantize: int8, int4 or w8a8 quantization of the draft model (default: none)
    speculative_tokens: draft tokens per decode step, with a draft model
    kv_cache_dtype: auto (the model's dtype) or int8 (keys and values as int8 with a scale per token and head:
      about half bf16's bytes, so more tokens fit and long contexts decode faster; perplexity in docs/engine.md)
    max_waiting: requests that may wait beside the --max-seqs running; more get 503 with Retry-After
    max_body_mb: the largest request body, in MiB; a larger one gets 413 before it is read
    request_timeout: seconds a request may take from its arrival; then it ends with finish_reason "timeout" (0: none)
    shutdown_timeout: seconds running requests get to finish on SIGTERM / SIGINT; then each ends with an error
      (a stream with an error chunk and [DONE])
    max_embedding_tokens: the most tokens one /v1/embeddings request may embed
    device: where the model runs: cpu, cuda, cuda:N, mps, ... (tformer's C++ kernels on an x86 CPU, torch's ops
      elsewhere; docs/devices.md)
    """
    from tformer.engine import EngineConfig
    from tformer.kernels.dispatch import resolve_device
    from tformer.serve import run_server
    from tformer.serve.middleware import ServerLimits

    resolve_device(device)  # before the server binds its port

    for name, value in (("max_waiting", max_waiting), ("max_embedding_tokens", max_embedding_tokens)):
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name, value in (("max_body_mb", max_body_mb), ("request_timeout", request_timeout)):
        if value < 0 or (name == "max_body_mb" and value == 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be at least 0, got {shutdown_timeout}")
    limits = ServerLimits(
        max_body_bytes=int(max_body_mb * (1 << 20)),
        max_waiting=max_waiting,
        request_timeout=request_timeout or None,
        max_embedding_tokens=max_embedding_tokens,
    )

    if compile:
        _keep_compiled_kernels()
    from tformer.checkpoints import is_run_directory, resolve_checkpoint

    if model is not None and is_run_directory(model):
        model_name = model_name or Path(model).resolve().name  # the run's name, not its step-* directory's
        model = str(resolve_checkpoint(model))
    config = EngineConfig(
        max_model_len=max_model_len,
        max_seqs=max_seqs,
        max_batched_tokens=max_batched_tokens,
        kv_cache_bytes=kv_cache_mb << 20,
        compile=compile,
        num_speculative_tokens=speculative_tokens,
        kv_cache_dtype=kv_cache_dtype,
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
        runs_dir=runs,
        limits=limits,
        shutdown_timeout=shutdown_timeout,
        device=device,
    )


def convert(
    source: str,
    *,
    out: str,
    to: str = "tformer",
    merge_lora: str | None = None,
    quantization: str = "float32",
    type: str = "f16",
) -> None:
    """Convert a model: a GGUF file or Hugging Face directory to a tformer checkpoint, or any of them to HF format.

    source: a .gguf file, a Hugging Face model directory, a tformer checkpoint directory or a training run
    out: the directory to write
    to: 'tformer' (config.yaml, model.safetensors, tokenizer), 'hf' (config.json, model.safetensors, tokenizer)
        or 'ctranslate2' (an encoder-decoder as a CTranslate2 model directory, vocabulary included; needs
        `pip install ctranslate2`)
    merge_lora: a LoRA adapters directory (adapters.safetensors, lora.json) trained on SOURCE, merged into the
        weights before writing (default: none)
    quantization: with --to ctranslate2, how CTranslate2 stores the weights: float32, int8, int16, bfloat16, ...
    type: with --to gguf (OUT is then the .gguf file; LLaMA-style decoders, for llama.cpp), how the matrices are
        stored: f16, q8_0 or q4_0
    """
    from tformer.checkpoints import load_pretrained
    from tformer.interop import to_hf

    if to not in ("tformer", "hf", "ctranslate2", "gguf"):
        raise ConfigError(f"unknown target format '{to}'; choose 'tformer', 'hf', 'ctranslate2' or 'gguf'")
    if to == "ctranslate2":
        from tformer.checkpoints import load_translation_model
        from tformer.interop.ctranslate2 import to_ctranslate2

        model, tokenizer = load_translation_model(source)
        to_ctranslate2(model, tokenizer, out, quantization)
        print(
            f"wrote {model.__class__.__name__} ({model.num_parameters():,} parameters) to {out} as CTranslate2 "
            f"{quantization}"
        )
        return
    model, tokenizer = load_pretrained(source)
    if merge_lora is not None:
        from tformer.training import lora

        lora.merge_lora(lora.load_adapters(model, merge_lora))
    if to == "gguf":
        from tformer.interop.gguf_writer import to_gguf

        to_gguf(model, out, tokenizer, type)
        print(f"wrote {model.__class__.__name__} ({model.num_parameters():,} parameters) to {out} as GGUF {type}")
        return
    if to == "tformer":
        model.save(out)
    else:
        to_hf(model, out)
    if tokenizer is not None:
        tokenizer.save(out)
    print(f"wrote {model.__class__.__name__} ({model.num_parameters():,} parameters) to {out} in {to} format")


def bench(
    model: str,
    *,
    quantize: str | None = None,
    dtype: str = "auto",
    compile: bool = False,
    batch: int = 8,
    prompt_tokens: int = 128,
    new_tokens: int = 32,
    kv_cache_dtype: str = "auto",
    device: str = "cpu",
) -> None:
    """Measure prefill and decode speed (batch 1 and batch N) against memory bandwidth, and say what would help.

    model: a .gguf file, a tformer checkpoint directory or a Hugging Face directory
    quantize: int8, int4 or w8a8 for the linear layers (default: none)
    dtype: weights and activations: float32, bfloat16, float16, or auto (bfloat16 if quantized, else float32)
    compile: run decode steps through torch.compile (compiled during the warm-up)
    batch: requests decoded together for the batched figure
    prompt_tokens: prompt length (random tokens, so the prefix cache cannot help)
    new_tokens: tokens generated per request
    kv_cache_dtype: auto (the model's dtype) or int8 (keys and values as int8 with a scale per token and head:
      about half bf16's bytes, so more tokens fit and long contexts decode faster; perplexity in docs/engine.md)
    device: where the model runs: cpu, cuda, cuda:N, mps, ... (tformer's C++ kernels on an x86 CPU, torch's ops
      elsewhere; docs/devices.md)
    """
    from tformer.engine import EngineConfig
    from tformer.engine.bench import bench_engine, format_bench, remedies
    from tformer.engine.loading import load_engine
    from tformer.kernels.dispatch import resolve_device

    resolve_device(device)

    for name, value in (("batch", batch), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        if value < (2 if name == "new_tokens" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {2 if name == 'new_tokens' else 1}")
    if compile:
        _keep_compiled_kernels()
    config = EngineConfig(compile=compile, prefix_caching=False, max_seqs=max(batch, 1), kv_cache_dtype=kv_cache_dtype)
    engine = load_engine(model, config, quantize, dtype, device=device)
    result = bench_engine(engine, prompt_tokens, new_tokens, batch)
    print(format_bench(model, result, remedies(engine, result)))
