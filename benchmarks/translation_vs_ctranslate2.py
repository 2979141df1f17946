"""EN-DE translation decoding: tformer against CTranslate2 on the same weights, CPU.

The run's best checkpoint (default runs/en-de-10min, `make main`) is converted with `tformer convert --to
ctranslate2` (interop/ctranslate2.py), so both systems hold the same weights. The dev split's 618 verses (or the
test split's 1,794 with --split test) are translated with beam 4 and length-penalty exponent 0.6, batches of 32,
by each side in each of its modes:
- tformer fp32 (beams sharing their keys through a table), the same with the copying KV cache of before, with
  patience 1, through the engine (`Engine` beam requests, the server's path), and with bf16 / int8 / w8a8 weights
  (`Translator.load(run, dtype, quantize)`); --modes picks some;
- CTranslate2 float32 with its own length penalty (score / length ** 0.6), CTranslate2 float32 with its n-best
  (num_hypotheses 4, length_penalty 0: summed log-probabilities) re-ranked with tformer's ((5 + |y|) / 6) ** 0.6,
  and CTranslate2 int8 (compute_type int8 on the same converted model).
The modes alternate in one process, in an order rotated each round, and the report gives medians of wall time,
target tokens/s (generated tokens without </s>), CPU seconds (time.process_time: every thread of the process),
sacreBLEU of the first round's outputs and how many outputs are token-identical to tformer fp32's.

--contention measures robustness on a shared machine instead: each system decodes --contention-sentences dev
verses with beam 4 in a fresh worker process (thread settings such as OMP_WAIT_POLICY only count before torch
loads), once on the quiet machine and once beside a busy process (`while True: pass`) pinned to core 0, and the
report gives each setting's slowdown.

    .venv/bin/python benchmarks/translation_vs_ctranslate2.py                   # dev, 3 rounds
    .venv/bin/python benchmarks/translation_vs_ctranslate2.py --split test --rounds 1
    .venv/bin/python benchmarks/translation_vs_ctranslate2.py --contention
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BEAM, ALPHA, BATCH = 4, 0.6, 32
HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/en-de-10min", help="a training run or checkpoint (default runs/en-de-10min)")
    p.add_argument("--split", choices=["dev", "test"], default="dev", help="which split to translate (default dev)")
    p.add_argument("--limit", type=int, default=0, help="only the first N sentences (default 0: all)")
    p.add_argument("--rounds", type=int, default=3, help="times each mode translates the split (default 3)")
    p.add_argument("--threads", type=int, default=None, help="threads per system (default: every CPU)")
    p.add_argument("--output", type=Path, default=None, help="also write the report to this file")
    p.add_argument(
        "--modes", default="", help="comma-separated parts of mode names to run (default: all), e.g. 'fp32,int8'"
    )
    p.add_argument("--contention", action="store_true", help="measure the slowdown beside a busy process instead")
    p.add_argument("--contention-sentences", type=int, default=20, help="dev verses per contention run (default 20)")
    p.add_argument("--contention-repeats", type=int, default=3, help="timed passes per worker (default 3)")
    p.add_argument(
        "--wait-idle", type=float, default=300.0, help="--contention: first wait up to this long for a quiet machine"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a contention worker's JSON settings
    return p.parse_args(argv)


class Report:
    def __init__(self, path: Path | None) -> None:
        self.lines: list[str] = []
        self.path = path

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("\n".join(self.lines) + "\n", encoding="utf-8")


# ---- the two systems ----------------------------------------------------------------------------------------------
def tformer_decoder(model, tokenizer, patience: float | None = None, workers: int = 1):
    from tformer.decoding.search import translate_ids

    def run(sentences: list[str]) -> list[list[int]]:
        sources = tokenizer.encode_batch(sentences)
        return translate_ids(
            model,
            sources,
            tokenizer.bos_id,
            tokenizer.eos_id,
            tokenizer.pad_id,
            beam_size=BEAM,
            alpha=ALPHA,
            batch_size=BATCH,
            patience=patience,
            workers=workers,
        )

    return run


def copying_decoder(model, tokenizer):
    """tformer fp32 as it was before the beams shared their keys through a table: KVCache, moved rows copied."""
    from tformer.decoding import beam_cache

    run_shared = tformer_decoder(model, tokenizer)

    def run(sentences: list[str]) -> list[list[int]]:
        applies = beam_cache.applies
        beam_cache.applies = lambda device, dtype: False
        try:
            return run_shared(sentences)
        finally:
            beam_cache.applies = applies

    return run


def engine_decoder(model, tokenizer):
    """The server's path: each sentence an `Engine` request with beam_width 4 (an encoder-decoder's beam requests
    are searched in batches by the offline search, engine/beams.py), as many tokens as translate_ids allows."""
    from tformer.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(model, tokenizer, EngineConfig(max_seqs=BATCH))
    limit = model.config.max_seq_len

    def run(sentences: list[str]) -> list[list[int]]:
        prompts = [[*ids, tokenizer.eos_id] for ids in tokenizer.encode_batch(sentences)]
        params = [
            SamplingParams(max_tokens=min(len(p) + 50, limit - 1), beam_width=BEAM, length_penalty=ALPHA)
            for p in prompts
        ]
        results = engine.generate(prompts, params)
        return [r.token_ids[: len(r.token_ids) - (r.finish_reason == "stop")] for r in results]

    return run


def ctranslate2_decoder(translator, tokenizer, max_len: int, rerank: bool):
    from tformer.decoding.search import length_penalty
    from tformer.interop.ctranslate2 import decode_tokens, source_tokens

    def run(sentences: list[str]) -> list[list[int]]:
        batch = [source_tokens(tokenizer, s) for s in sentences]
        options = dict(beam_size=BEAM, max_batch_size=BATCH, min_decoding_length=0, max_decoding_length=max_len)
        if not rerank:
            results = translator.translate_batch(batch, length_penalty=ALPHA, **options)
            return [decode_tokens(tokenizer, r.hypotheses[0]) for r in results]
        results = translator.translate_batch(
            batch, num_hypotheses=BEAM, length_penalty=0.0, return_scores=True, **options
        )
        out = []
        for r in results:  # scores are summed log-probabilities with </s>: tformer's lp counts it too
            ranked = zip(r.scores, r.hypotheses, strict=True)
            best = max(ranked, key=lambda h: h[0] / length_penalty(len(h[1]) + 1, ALPHA))
            out.append(decode_tokens(tokenizer, best[1]))
        return out

    return run


# ---- the side-by-side comparison ---------------------------------------------------------------------------------
def compare(args: argparse.Namespace, out: Report) -> None:
    import ctranslate2
    import sacrebleu
    from common import load_report, machine_info, median, set_threads

    from tformer.data.corpora import bible_pairs
    from tformer.decoding.translator import Translator
    from tformer.interop.ctranslate2 import to_ctranslate2

    threads = set_threads(args.threads)
    out(f"translation_vs_ctranslate2: tformer vs CTranslate2 {ctranslate2.__version__} on {args.run}, {args.split}")
    out(f"machine: {machine_info()}")
    out(f"command: {' '.join(sys.argv)}")
    out(load_report("before"))
    translator = Translator.load(args.run)
    model, tokenizer = translator.model, translator.tokenizer
    pairs = bible_pairs("en-de", args.split)
    pairs = pairs[: args.limit] if args.limit else pairs
    sentences, references = [p[0] for p in pairs], [p[1] for p in pairs]
    work = Path(tempfile.mkdtemp(prefix="ct2-"))
    began = time.perf_counter()
    to_ctranslate2(model, tokenizer, work / "float32")
    out(f"converted to CTranslate2 in {time.perf_counter() - began:.1f} s ({work / 'float32'})")
    ct2 = {
        compute: ctranslate2.Translator(
            str(work / "float32"), device="cpu", compute_type=compute, intra_threads=threads
        )
        for compute in ("float32", "int8")
    }
    max_len = model.config.max_seq_len
    builders = {
        "tformer fp32": lambda: tformer_decoder(model, tokenizer),
        "tformer fp32, copying KV cache (before)": lambda: copying_decoder(model, tokenizer),
        "tformer fp32, patience 1": lambda: tformer_decoder(model, tokenizer, patience=1.0),
        "tformer fp32, 2 batches at once": lambda: tformer_decoder(model, tokenizer, workers=2),
        "tformer fp32, Engine beams (server path)": lambda: engine_decoder(model, tokenizer),
        "tformer bf16 weights": lambda: tformer_decoder(Translator.load(args.run, "bfloat16").model, tokenizer),
        "tformer int8 weights, twice-rounded int8 activations": lambda: tformer_decoder(
            Translator.load(args.run, "auto", "int8").model, tokenizer
        ),
        "tformer w8a8, bf16": lambda: tformer_decoder(Translator.load(args.run, "auto", "w8a8").model, tokenizer),
        "tformer w8a8, bf16, 2 batches at once": lambda: tformer_decoder(
            Translator.load(args.run, "auto", "w8a8").model, tokenizer, workers=2
        ),
        "tformer w8a8, fp32": lambda: tformer_decoder(Translator.load(args.run, "float32", "w8a8").model, tokenizer),
        "CTranslate2 float32": lambda: ctranslate2_decoder(ct2["float32"], tokenizer, max_len, rerank=False),
        "CTranslate2 float32, re-ranked": lambda: ctranslate2_decoder(ct2["float32"], tokenizer, max_len, rerank=True),
        "CTranslate2 int8": lambda: ctranslate2_decoder(ct2["int8"], tokenizer, max_len, rerank=False),
    }
    wanted = [part.strip() for part in args.modes.split(",") if part.strip()]
    # the references of the ratios, and the search before the shared keys
    always = ("tformer fp32", "tformer fp32, copying KV cache (before)", "tformer fp32, 2 batches at once")
    always += ("CTranslate2 float32", "CTranslate2 int8")
    modes = {
        name: build()
        for name, build in builders.items()
        if name in always or not wanted or any(part in name for part in wanted)
    }
    out(
        f"{len(sentences)} {args.split} sentences, beam {BEAM}, alpha {ALPHA}, batches of {BATCH}, {threads} threads "
        f"each, {args.rounds} rounds alternating"
    )
    for run in modes.values():  # warm-up: first calls allocate and pick kernels
        run(sentences[:8])
    walls: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    outputs: dict[str, list[list[int]]] = {}
    names = list(modes)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            ids = modes[name](sentences)
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
            outputs.setdefault(name, ids)
        out(f"round {r + 1}: " + ", ".join(f"{n} {walls[n][-1]:.2f} s" for n in names) + f"; {load_report('now')}")
    reference = outputs["tformer fp32"]
    tformer_rates = {}
    out()
    out("| system | wall s | target tok/s | CPU s | CPU s / sentence | BLEU | identical to tformer fp32 |")
    out("|---|---:|---:|---:|---:|---:|---:|")
    rates = {}
    for name in names:
        tokens = sum(map(len, outputs[name]))
        wall = median(walls[name])
        rates[name] = tokens / wall
        if name.startswith("tformer"):
            tformer_rates[name] = rates[name]
        bleu = sacrebleu.corpus_bleu(tokenizer.decode_batch(outputs[name]), [references]).score
        same = sum(a == b for a, b in zip(outputs[name], reference, strict=True))
        out(
            f"| {name} | {wall:.2f} | {rates[name]:,.0f} | {median(cpus[name]):.2f} | "
            f"{median(cpus[name]) / len(sentences) * 1000:.1f} ms | {bleu:.2f} | {same} / {len(sentences)} |"
        )
    out()
    best = max(tformer_rates, key=tformer_rates.get)
    out(
        f"ratios (target tok/s): tformer fp32 / CTranslate2 float32 = "
        f"{rates['tformer fp32'] / rates['CTranslate2 float32']:.2f}x; tformer best ({best}) / CTranslate2 int8 = "
        f"{rates[best] / rates['CTranslate2 int8']:.2f}x"
    )
    for name in tformer_rates:
        if name != "tformer fp32":
            out(f"  {name} / tformer fp32 = {rates[name] / rates['tformer fp32']:.2f}x")
    out(load_report("after"))


# ---- robustness beside a busy process ----------------------------------------------------------------------------
CONTENTION_SETTINGS: list[tuple[str, dict]] = [
    ("tformer, 2 threads, OpenMP defaults", {"system": "tformer", "threads": 2, "env": {}}),
    (
        "tformer, 2 threads, OMP_WAIT_POLICY=PASSIVE",
        {"system": "tformer", "threads": 2, "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
    ),
    (
        "tformer, 2 threads, GOMP_SPINCOUNT=10000",
        {"system": "tformer", "threads": 2, "env": {"GOMP_SPINCOUNT": "10000"}},
    ),
    ("tformer, 1 thread", {"system": "tformer", "threads": 1, "env": {}}),
    ("tformer, the CLI's policy (tformer.threads)", {"system": "tformer", "threads": 0, "env": {}, "policy": True}),
    ("CTranslate2 float32, 2 threads", {"system": "ctranslate2", "threads": 2, "env": {}}),
    ("CTranslate2 float32, 1 thread", {"system": "ctranslate2", "threads": 1, "env": {}}),
]


def worker(settings: dict, args: argparse.Namespace) -> None:
    """One contention measurement in this fresh process: prints JSON with the wall and CPU seconds of each pass."""
    if settings.get("policy"):
        from tformer.threads import apply_thread_policy

        apply_thread_policy()
    import torch

    from tformer.data.corpora import bible_pairs
    from tformer.decoding.translator import Translator

    if settings["threads"]:
        torch.set_num_threads(settings["threads"])
    translator = Translator.load(args.run)
    model, tokenizer = translator.model, translator.tokenizer
    sentences = [p[0] for p in bible_pairs("en-de", "dev")[: args.contention_sentences]]
    if settings["system"] == "tformer":
        run = tformer_decoder(model, tokenizer)
    else:
        import ctranslate2

        from tformer.interop.ctranslate2 import to_ctranslate2

        path = to_ctranslate2(model, tokenizer, tempfile.mkdtemp(prefix="ct2-"))
        ct2 = ctranslate2.Translator(path, device="cpu", intra_threads=settings["threads"])
        run = ctranslate2_decoder(ct2, tokenizer, model.config.max_seq_len, rerank=False)
    run(sentences[:4])
    walls, cpus = [], []
    for _ in range(args.contention_repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run(sentences)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    print(json.dumps({"wall": walls, "cpu": cpus, "threads": torch.get_num_threads()}))


def run_worker(settings: dict, args: argparse.Namespace, timeout: float = 300) -> dict:
    env = {**os.environ, **settings["env"]}
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        if key not in settings["env"]:
            env.pop(key, None)
    command = [
        sys.executable,
        __file__,
        "--worker",
        json.dumps(settings),
        "--run",
        args.run,
        "--contention-sentences",
        str(args.contention_sentences),
        "--contention-repeats",
        str(args.contention_repeats),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return {"wall": [timeout], "cpu": [float("nan")], "threads": "?", "timed_out": True}
    return json.loads(result.stdout.strip().splitlines()[-1])


def contention(args: argparse.Namespace, out: Report) -> None:
    from common import busy_processes, load_report, machine_info, median, wait_for_idle

    waited, busy_now = wait_for_idle(args.wait_idle)  # a neighbour would turn the quiet runs into busy ones
    out(
        f"translation_vs_ctranslate2 --contention: beam {BEAM} on {args.contention_sentences} dev verses, quiet and "
        "beside one busy process pinned to core 0"
    )
    out(f"machine: {machine_info()}")
    out(f"command: {' '.join(sys.argv)}")
    out(load_report("before"))
    out(f"waited {waited:.0f} s for other busy processes; busy now: {busy_now}")
    out()
    out("| setting | threads quiet / busy | quiet s | busy s | slowdown | quiet CPU s | busy CPU s |")
    out("|---|---:|---:|---:|---:|---:|---:|")
    for name, settings in CONTENTION_SETTINGS:
        quiet = run_worker(settings, args)
        busy = subprocess.Popen(
            [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {0})
        )
        try:
            time.sleep(0.5)
            loaded = run_worker(settings, args)
        finally:
            busy.kill()
            busy.wait()
        q, b = median(quiet["wall"]), median(loaded["wall"])
        flag = " (timed out)" if loaded.get("timed_out") else ""
        out(
            f"| {name} | {quiet['threads']} / {loaded['threads']} | {q:.2f} | {b:.2f}{flag} | {b / q:.2f}x | "
            f"{median(quiet['cpu']):.2f} | "
            f"{median(loaded['cpu']):.2f} |"
        )
    out(load_report("after"))
    out(f"other busy processes after: {busy_processes()}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.worker is not None:
        worker(json.loads(args.worker), args)
        return 0
    out = Report(args.output)
    (contention if args.contention else compare)(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
