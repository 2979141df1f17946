"""The trainer's random streams: one seed per (run seed, stream), so that a resumed run, a run on several ranks
and a benchmark that interleaves another model all draw what an uninterrupted `tformer train` draws."""

from __future__ import annotations

import torch


def stream_seed(seed: int, index: int) -> int:
    """The seed of random stream `index` of a run seeded with `seed`; 1,000,003 is prime, so streams of
    neighbouring seeds stay apart for a million indices."""
    return seed * 1_000_003 + index


def seed_dropout(seed: int, step: int, rank: int = 0) -> None:
    """Seeds torch's global generator for the dropout draws of optimizer step `step` (0-based) on one rank.

    A step's masks then depend on (seed, step, rank) alone: a resumed run draws what an uninterrupted one
    does, and a loop that runs another model in between (benchmarks/translation_vs_marian.py) draws what
    `tformer train` does.
    """
    torch.manual_seed(stream_seed(seed, step * 1_009 + rank))
