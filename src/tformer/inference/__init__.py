"""Inference: decoding (greedy, beam search) on KV caches. Never imports tformer.training."""

from tformer.inference.search import beam_search, greedy_search, length_penalty, translate_ids

__all__ = ["beam_search", "greedy_search", "length_penalty", "translate_ids"]
