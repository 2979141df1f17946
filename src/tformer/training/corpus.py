"""From a TrainConfig's data keys to encoded training examples, a tokenizer and held-out text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
from tformer.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from tformer.training.config import TrainConfig
from tformer.training.init_from import vocab_of

PARALLEL_OBJECTIVES = ("seq2seq",)
LABELLED_OBJECTIVES = ("classification",)  # examples are (text, class id): bible:genre or a labelled file


@dataclass
class PreparedData:
    """Everything the training loop reads: examples are token ids, held-out sets stay as text for BLEU."""

    tokenizer: Tokenizer
    examples: list  # (src_ids, tgt_ids) pairs, or token id lists for LM objectives
    lengths: list[int]  # padded length of each example, for the token-budget sampler
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
        tokenizer = Tokenizer.train(texts, config.vocab_size, num_sentinels=_sentinels(config))
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


def batch_objective(config: TrainConfig) -> Objective:
    """The function that turns the run's examples into a batch: the objective's, or packed clm's (train.pack)."""
    return packed_causal_lm if config.pack else OBJECTIVES[config.objective]


def _sentinels(config: TrainConfig) -> int:
    return 100 if config.objective == "span_corruption" else 0
