"""`tformer serve`'s POST /v1/translations under 32 concurrent clients against CTranslate2's `translate_batch` on the
same sentences and the same weights, and tformer's offline `Translator.translate_batch`, in one run.

- **server**: `tformer serve --model RUN` as a subprocess (2 OpenMP threads); an asyncio client keeps `--concurrency`
  requests in flight, one dev verse each (beam 4, alpha 0.6, no attention map), until every verse is translated;
- **CTranslate2**: the run converted with `tformer convert --to ctranslate2`, float32 and int8, `translate_batch`
  over all the verses (max_batch_size 32, beam 4, length_penalty 0.6, 2 threads), in this process;
- **offline**: `Translator.translate_batch` in this process (batches of 32 sorted by length).

The sides alternate round by round (one idles while another runs). Printed: median wall seconds, verses/s, CPU
seconds (the server process's, from /proc, plus the client's), BLEU, and how many translations equal the offline
search's; the ratios server / CTranslate2 and server / offline.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/translation_server.py --rounds 2 \
        --output benchmarks/results/translation_server.txt
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_report, machine_info, median  # noqa: E402
from server_vs_llamacpp import free_port  # noqa: E402

BEAM, ALPHA, BATCH = 4, 0.6, 32


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, every thread of it, in seconds (Linux)."""
    text = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def post_all(url: str, sentences: list[str], concurrency: int) -> list[dict]:
    """Every sentence as its own POST /v1/translations, `concurrency` in flight; the answers in input order."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:

        async def one(sentence: str) -> dict:
            async with gate:
                body = {"input": sentence, "beam_size": BEAM, "alpha": ALPHA, "attention": False}
                response = await client.post("/v1/translations", json=body)
                response.raise_for_status()
                return response.json()

        return await asyncio.gather(*(one(s) for s in sentences))


def start_server(run: str, port: int, threads: int, log: Path):
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TFORMER_THREAD_POLICY": "off"}
    command = [sys.executable, "-m", "tformer", "serve", "--model", run, "--port", str(port)]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"the server was not ready in 180 s:\n{log.read_text()[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/en-de-10min")
    parser.add_argument("--sentences", type=int, default=618, help="the first N dev verses (618: all)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    import ctranslate2
    import sacrebleu
    import torch

    from tformer.data.corpora import bible_pairs
    from tformer.decoding.translator import Translator
    from tformer.interop.ctranslate2 import decode_tokens, source_tokens, to_ctranslate2

    lines: list[str] = []

    def out(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)
        if args.output is not None:
            args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")

    torch.set_num_threads(args.threads)
    out(
        f"translation_server: tformer serve (/v1/translations, {args.concurrency} concurrent) vs CTranslate2 "
        f"{ctranslate2.__version__} translate_batch on {args.run}"
    )
    out(f"machine: {machine_info()}")
    out(f"command: {' '.join(sys.argv)}")
    out(load_report("before"))
    translator = Translator.load(args.run)
    tokenizer = translator.tokenizer
    pairs = bible_pairs("en-de", "dev")[: args.sentences]
    sentences, references = [p[0] for p in pairs], [p[1] for p in pairs]
    work = Path(tempfile.mkdtemp(prefix="ct2-server-"))
    to_ctranslate2(translator.model, tokenizer, work / "model")
    max_len = translator.model.config.max_seq_len
    ct2 = {
        c: ctranslate2.Translator(str(work / "model"), device="cpu", compute_type=c, intra_threads=args.threads)
        for c in ("float32", "int8")
    }

    def ct2_run(compute: str) -> list[str]:
        batch = [source_tokens(tokenizer, s) for s in sentences]
        results = ct2[compute].translate_batch(
            batch,
            beam_size=BEAM,
            max_batch_size=BATCH,
            length_penalty=ALPHA,
            min_decoding_length=0,
            max_decoding_length=max_len,
        )
        return tokenizer.decode_batch([decode_tokens(tokenizer, r.hypotheses[0]) for r in results])

    server, url = start_server(args.run, free_port(), args.threads, work / "server.log")
    try:
        asyncio.run(post_all(url, sentences[:8], args.concurrency))  # warm-up
        ct2_run("float32")
        translator.translate_batch(sentences[:8])
        sides = {
            "tformer serve, /v1/translations": lambda: [
                a["translation"] for a in asyncio.run(post_all(url, sentences, args.concurrency))
            ],
            "tformer offline Translator.translate_batch": lambda: translator.translate_batch(sentences, BEAM, ALPHA),
            "CTranslate2 float32 translate_batch": lambda: ct2_run("float32"),
            "CTranslate2 int8 translate_batch": lambda: ct2_run("int8"),
        }
        walls = {n: [] for n in sides}
        cpus = {n: [] for n in sides}
        texts: dict[str, list[str]] = {}
        names = list(sides)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                server_cpu = process_cpu_seconds(server.pid)
                wall, cpu = time.perf_counter(), time.process_time()
                texts.setdefault(name, sides[name]())
                walls[name].append(time.perf_counter() - wall)
                cpus[name].append(time.process_time() - cpu + process_cpu_seconds(server.pid) - server_cpu)
            out(f"round {r + 1}: " + ", ".join(f"{n} {walls[n][-1]:.2f} s" for n in names) + f"; {load_report('now')}")
    finally:
        server.terminate()
        server.wait(30)
    offline = texts["tformer offline Translator.translate_batch"]
    out()
    out(
        f"{len(sentences)} dev verses, beam {BEAM}, alpha {ALPHA}, {args.threads} threads per system, "
        f"{args.rounds} rounds alternating"
    )
    out("| system | wall s | verses/s | CPU s (server + client) | BLEU | equal to the offline search |")
    out("|---|---:|---:|---:|---:|---:|")
    rate = {}
    for name in names:
        wall = median(walls[name])
        rate[name] = len(sentences) / wall
        bleu = sacrebleu.corpus_bleu(texts[name], [references]).score
        same = sum(a == b for a, b in zip(texts[name], offline, strict=True))
        out(
            f"| {name} | {wall:.2f} | {rate[name]:.1f} | {median(cpus[name]):.2f} | {bleu:.2f} | "
            f"{same} / {len(sentences)} |"
        )
    served = rate["tformer serve, /v1/translations"]
    out()
    out(
        f"ratios (verses/s): server / CTranslate2 float32 = "
        f"{served / rate['CTranslate2 float32 translate_batch']:.2f}x; server / CTranslate2 int8 = "
        f"{served / rate['CTranslate2 int8 translate_batch']:.2f}x; server / offline = "
        f"{served / rate['tformer offline Translator.translate_batch']:.2f}x"
    )
    out(load_report("after"))


if __name__ == "__main__":
    main()
