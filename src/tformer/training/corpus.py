"""From a TrainConfig's data keys to encoded training examples, a tokenizer and held-out text: read from the corpus
and encoded in memory, or read through memory maps from the shards `tformer prepare` wrote (train.prepared)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tformer.data import (
    DataError,
    Tokenizer,
    bible_pairs,
    bible_text,
    encode_pairs,
    lm_lengths,
    read_parallel,
    read_text,
    seq2seq_lengths,
)
from tformer.data.genre import encode_labelled, labelled_split
from tformer.data.objectives import OBJECTIVES, Objective
from tformer.data.packing import pack_sequences, packed_causal_lm
from tformer.data.shards import PackedBlocks, Pairs, ShardedCorpus, TextDocuments
from tformer.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from tformer.training.config import TrainConfig
from tformer.training.init_from import vocab_of

PARALLEL_OBJECTIVES = ("seq2seq",)
LABELLED_OBJECTIVES = ("classification",)  # examples are (text, class id): bible:genre or a labelled file


@dataclass
class PreparedData:
    """Everything the training loop reads: examples are token ids, held-out sets stay as text for BLEU."""

    tokenizer: Tokenizer
    examples: Sequence  # (src_ids, tgt_ids) pairs, or token id lists for LM objectives (lazy views on shards)
    lengths: Sequence[int]  # padded length of each example, for the token-budget sampler
    dev: list  # (source, reference) text pairs, or text lines
    test: list
    skipped: int  # training examples longer than max_len


def _read_split(config: TrainConfig, split: str) -> list:
    parallel = config.objective in PARALLEL_OBJECTIVES
    if config.objective in LABELLED_OBJECTIVES:
        return labelled_split(config.corpus, split, config.dev_corpus)
    if config.corpus.startswith("bible:"):
        pair = config.corpus.split(":", 1)[1]
        if parallel:
            return bible_pairs(pair, split)
        return bible_text(split)
    if split == "test":
        return []
    if split == "dev":
        if config.dev_corpus is None:
            return []
        return read_parallel(config.dev_corpus) if parallel else read_text(config.dev_corpus)
    if not Path(config.corpus).is_file():
        raise DataError(f"corpus {config.corpus} is not a file; use 'bible:en-de', 'bible:en-fr' or a file path")
    return read_parallel(config.corpus, config.corpus_tgt) if parallel else read_text(config.corpus)


def prepare_data(config: TrainConfig, run_dir: Path, pretrained: Tokenizer | None = None) -> PreparedData:
    """Reads the corpus, trains (or reloads, when resuming) the joint BPE, encodes and filters by max_len.

    A `pretrained` tokenizer (fine-tuning) is used as it is and saved into the run instead of a trained BPE."""
    if config.prepared:
        return _prepared_data(config, run_dir, pretrained)
    train_text = _read_split(config, "train")
    saved = run_dir / TOKENIZER_FILE
    if saved.is_file():
        tokenizer = Tokenizer.from_file(saved)
    elif pretrained is not None:
        tokenizer = pretrained
        tokenizer.save(run_dir)
    else:
        texts = [t for pair in train_text for t in pair] if config.objective in PARALLEL_OBJECTIVES else train_text
        texts = [text for text, _ in train_text] if config.objective in LABELLED_OBJECTIVES else texts
        tokenizer = Tokenizer.train(texts, config.vocab_size, num_sentinels=sentinels(config))
        tokenizer.save(run_dir)
    if config.objective in PARALLEL_OBJECTIVES:
        encoded = encode_pairs(tokenizer, train_text)
        kept = [ex for ex in encoded if max(len(ex[0]), len(ex[1])) <= config.max_len]
        lengths = seq2seq_lengths(kept)
    elif config.objective in LABELLED_OBJECTIVES:
        encoded = encode_labelled(tokenizer, train_text)
        kept = [(ids, label) for ids, label in encoded if 0 < len(ids) <= config.max_len]
        lengths = lm_lengths([ids for ids, _ in kept])
    elif config.pack:  # blocks of max_len tokens of the whole stream: no verse is skipped for its length
        encoded = tokenizer.encode_batch(train_text, add_bos=False)
        vocab = vocab_of(tokenizer)  # the ids the objectives use, for tformer's BPE and pretrained tokenizers alike
        kept = pack_sequences([ids for ids in encoded if ids], config.max_len, vocab.bos_id, vocab.eos_id)
        lengths, encoded = [len(block) for block in kept], kept
    else:
        encoded = tokenizer.encode_batch(train_text, add_bos=False)  # the objective adds bos itself
        kept = [ids for ids in encoded if 0 < len(ids) <= config.max_len]
        lengths = lm_lengths(kept)
    if not kept:
        raise DataError(f"{config.corpus}: no training example has at most max_len={config.max_len} tokens")
    dev, test = _read_split(config, "dev"), _read_split(config, "test")
    return PreparedData(tokenizer, kept, lengths, dev, test, skipped=len(encoded) - len(kept))


def _prepared_data(config: TrainConfig, run_dir: Path, pretrained: Tokenizer | None) -> PreparedData:
    """The examples of `prepare_data`, in the same order, as views on the shards of `tformer prepare`: only the
    lengths (and, when some are too long, the indices kept) are in memory."""
    corpus = ShardedCorpus(config.prepared)
    kind = "pairs" if config.objective in PARALLEL_OBJECTIVES else "text"
    if config.objective in LABELLED_OBJECTIVES:
        raise DataError("train.prepared holds unlabelled text; train the classification objective from the corpus")
    if corpus.kind != kind:
        raise DataError(
            f"{config.prepared} holds {corpus.kind} but objective '{config.objective}' trains on {kind}; prepare "
            "the corpus with this recipe (`tformer prepare RECIPE`)"
        )
    saved = run_dir / TOKENIZER_FILE
    if pretrained is not None and not saved.is_file():
        pretrained.save(run_dir)
    if saved.is_file():  # a resumed run, or a fine-tune: the shards must hold ids of the same tokenizer
        corpus.check_tokenizer(run_dir)
        tokenizer = Tokenizer.from_file(saved)
    else:
        tokenizer = corpus.tokenizer()
        tokenizer.save(run_dir)
    if pretrained is None and corpus.manifest["settings"].get("vocab_size") != config.vocab_size:
        raise DataError(
            f"{config.prepared} was prepared with vocab_size {corpus.manifest['settings'].get('vocab_size')}, the "
            f"recipe asks for {config.vocab_size}; run `tformer prepare` with this recipe again"
        )
    vocab = vocab_of(tokenizer)
    if kind == "text" and (corpus.bos_id, corpus.eos_id) != (vocab.bos_id, vocab.eos_id):
        raise DataError(f"{config.prepared}: the documents are framed by other <s> and </s> ids than the tokenizer's")
    if config.pack:  # the blocks' lengths: no array a document
        examples = PackedBlocks(corpus, config.max_len)
        return _with_held_out(config, tokenizer, examples, examples.lengths(), skipped=0)
    lengths = corpus.document_lengths()
    if kind == "pairs":
        source, target = lengths[0::2], lengths[1::2]
        fits = np.maximum(source, target) <= config.max_len
        keep = None if fits.all() else np.flatnonzero(fits)
        examples: Sequence = Pairs(corpus, keep)
        lengths = np.maximum(source, target)[fits] + 1  # seq2seq_lengths
    else:
        text = lengths - 2  # stored with <s> and </s>; the objectives add their own
        fits = (text > 0) & (text <= config.max_len)
        keep = None if fits.all() else np.flatnonzero(fits)
        examples, lengths = TextDocuments(corpus, keep), text[fits] + 2  # lm_lengths
    if len(examples) == 0:
        raise DataError(f"{config.prepared}: no training example has at most max_len={config.max_len} tokens")
    return _with_held_out(config, tokenizer, examples, lengths, skipped=int((~fits).sum()))


def _with_held_out(
    config: TrainConfig, tokenizer: Tokenizer, examples: Sequence, lengths: np.ndarray, skipped: int
) -> PreparedData:
    dev, test = _read_split(config, "dev"), _read_split(config, "test")
    return PreparedData(tokenizer, examples, lengths, dev, test, skipped)


def batch_objective(config: TrainConfig) -> Objective:
    """The function that turns the run's examples into a batch: the objective's, or packed clm's (train.pack)."""
    return packed_causal_lm if config.pack else OBJECTIVES[config.objective]


def sentinels(config: TrainConfig) -> int:
    """How many T5 sentinels the tokenizer reserves for the objective (span corruption needs them)."""
    return 100 if config.objective == "span_corruption" else 0
