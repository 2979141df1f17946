"""Offline decoding: greedy and beam search on a KV cache, and the cross-attention map of a translation."""

from tformer.decoding.search import beam_search, beam_search_decoder, greedy_search, length_penalty, translate_ids

__all__ = ["beam_search", "beam_search_decoder", "greedy_search", "length_penalty", "translate_ids"]
