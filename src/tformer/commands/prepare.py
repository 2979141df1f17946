"""`tformer prepare`: tokenize a recipe's corpus once into memory-mapped shards (data/shards.py), which
`tformer train` then reads instead of the corpus (train.prepared)."""

from __future__ import annotations

import time
from pathlib import Path


def prepare(
    recipe: str,
    overrides: list[str],
    *,
    workers: int = 0,
    sample_mb: float = 64.0,
    shard_tokens: float = 128.0,
    tokenizer: str = "",
    keys: str = "",
    time_budget: float = 0.0,
) -> None:
    """Tokenize a recipe's corpus once, in parallel, into memory-mapped shards in train.prepared for `tformer train`.

    recipe: YAML recipe whose train.corpus (plain text, TSV, JSONL or Parquet) and train.prepared (the output
      directory) say what to prepare; its objective says text or pairs, its vocab_size the tokenizer's size
    overrides: section.key=value pairs that override the recipe, e.g. train.prepared=data/shards
    workers: processes that tokenize (0: one per CPU)
    sample_mb: megabytes of the corpus, read in stretches spread over the file, that the tokenizer is trained on
    shard_tokens: millions of token ids per shard file
    tokenizer: a directory holding tokenizer.json to use instead of training one (default: the one of
      train.init_from when that is a directory)
    keys: the JSONL fields or Parquet columns holding the text, comma-separated (default: text; for pairs src,tgt)
    time_budget: stop cleanly after this many seconds; the same command continues where it stopped (0: no limit)
    """
    import numpy as np

    from tformer.data.shards import CorpusFile, prepare_shards
    from tformer.data.tokenizer import Tokenizer
    from tformer.errors import DataError
    from tformer.training import load_recipe
    from tformer.training.corpus import LABELLED_OBJECTIVES, PARALLEL_OBJECTIVES, sentinels
    from tformer.training.init_from import vocab_of

    _, config = load_recipe(recipe, overrides)
    if not config.prepared:
        raise DataError("the recipe names no output directory: set train.prepared (or pass train.prepared=DIR)")
    if config.corpus.startswith("bible:") or config.corpus_tgt or config.objective in LABELLED_OBJECTIVES:
        joined = " with train.corpus_tgt (join the two: paste src.txt tgt.txt > pairs.tsv)" if config.corpus_tgt else ""
        labelled = ", objective classification (labelled data)" if config.objective in LABELLED_OBJECTIVES else ""
        raise DataError(
            f"tformer prepare reads one corpus file of text or pairs; train.corpus is {config.corpus!r}{joined}"
            f"{labelled}; train from the corpus directly (without train.prepared) or give a file"
        )
    if sample_mb <= 0 or shard_tokens <= 0:
        raise DataError(f"--sample-mb ({sample_mb}) and --shard-tokens ({shard_tokens}) must be positive")
    kind = "pairs" if config.objective in PARALLEL_OBJECTIVES else "text"
    corpus = CorpusFile.of(config.corpus, kind, [k.strip() for k in keys.split(",")] if keys else None)
    source = tokenizer or (config.init_from if config.init_from and Path(config.init_from).is_dir() else "")
    if config.init_from and not source:
        raise DataError(f"train.init_from {config.init_from} is not a directory: pass its tokenizer with --tokenizer")
    sample_bytes = int(sample_mb * 2**20)

    def make_tokenizer() -> Tokenizer:
        if source:
            return Tokenizer.load(source)
        print(f"training the tokenizer on {sample_mb:g} MB of {corpus.path}")
        begun = time.perf_counter()
        trained = Tokenizer.train(corpus.sample(sample_bytes), config.vocab_size, num_sentinels=sentinels(config))
        print(f"trained the tokenizer in {time.perf_counter() - begun:.1f} s")
        return trained

    def special_ids(tok: Tokenizer) -> tuple[int, int]:
        vocab = vocab_of(tok)
        return vocab.bos_id, vocab.eos_id

    settings = {
        "vocab_size": config.vocab_size,
        "sentinels": sentinels(config),
        "sample_bytes": sample_bytes,
        "tokenizer": str(Path(source).resolve()) if source else "trained",
    }
    started = time.perf_counter()
    manifest = prepare_shards(
        corpus,
        Path(config.prepared),
        make_tokenizer,
        settings=settings,
        special_ids=special_ids,
        workers=workers,
        shard_tokens=int(shard_tokens * 1e6),
        time_budget=time_budget,
    )
    if manifest is None:
        return
    seconds = time.perf_counter() - started
    print(
        f"prepared {manifest['examples']:,} {'pairs' if kind == 'pairs' else 'documents'}, "
        f"{manifest['tokens']:,} tokens ({np.dtype(manifest['dtype']).name}) in {len(manifest['shards'])} shards in "
        f"{config.prepared}; {seconds:.1f} s this run"
    )
