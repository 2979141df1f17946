"""Today's beam search for encoder-decoders, as it was before the reordering-free search (decoding/search.py): the
reference that tests/test_translator.py and benchmarks/beam_ab.py compare the new search against.

It repeats the encoder's memory K times (one copy per beam), copies every row's self-attention keys and values at
every step, selects cross-attention keys only when the batch shrinks, and rebuilds the memory mask every step.
`legacy_attention` puts a model's attention layers back on the routing of that time (single-query matmuls only in
bf16/fp16, torch's fused kernel otherwise), so that an A/B measures the whole change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tformer.decoding.search import greedy_search, length_penalty
from tformer.layers import Attention
from tformer.layers import attention as attention_module
from tformer.layers.masks import AttentionMask
from tformer.models import EncoderDecoder, RecurrentCache

Hypothesis = tuple[float, list[int]]
Candidate = tuple[float, int, int]


@torch.no_grad()
def reference_beam_search(
    model: EncoderDecoder,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    max_len: int | Sequence[int],
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    patience: float | None = None,
) -> list[list[int]]:
    """Batched beam search over sources (B, S) as it was: the best hypothesis per source, without specials.

    `patience` (not in today's search) swaps its stopping rule for CTranslate2's: a source is done once
    round(beam_size * patience) hypotheses have finished."""
    model.eval()
    B, K = src.shape[0], beam_size
    limits = [max_len] * B if isinstance(max_len, int) else list(max_len)
    memory = model.encode(src, src_mask).repeat_interleave(K, 0)  # (B*K, S, d)
    src_mask = src_mask.repeat_interleave(K, 0)
    cache = model.new_cache(B * K, max(limits) + 1)
    beams = ReferenceBeams.start(limits, K, alpha, eos_id, src.device)
    beams.patience = patience
    tokens = torch.full((B * K, 1), bos_id, dtype=torch.long, device=src.device)
    live = torch.arange(B * K, device=src.device)
    for t in range(max(limits)):
        logits = model.decode(tokens, memory, src_mask, cache=cache, start=t)[:, -1]
        memory = None
        log_probs = logits.new_zeros(B * K, logits.shape[-1], dtype=torch.float32)
        log_probs[live] = torch.log_softmax(logits.float(), -1)
        parents = beams.advance(log_probs)
        if parents is None:
            break
        searching = torch.tensor([not done for done in beams.done], device=src.device).repeat_interleave(K)
        next_live = searching.nonzero()[:, 0]
        slot = torch.full((B * K,), -1, dtype=torch.long, device=src.device)
        slot[live] = torch.arange(len(live), device=src.device)
        index = slot[parents[next_live]]
        shrinking = len(next_live) < len(live)
        if shrinking:
            src_mask = src_mask[slot[next_live]]
        if isinstance(cache, RecurrentCache):  # the LSTM's state, reordered as it always was
            cache.reorder(index, shrinking)
        for layer_cache in [] if isinstance(cache, RecurrentCache) else cache:  # every row copied, as KVCache did
            self_attn, length = layer_cache.self_attn, min(t + 1, layer_cache.self_attn.k.shape[2])
            if shrinking:
                self_attn.k, self_attn.v = self_attn.k[index], self_attn.v[index]
            else:
                self_attn.k[:, :, :length] = self_attn.k[index, :, :length]
                self_attn.v[:, :, :length] = self_attn.v[index, :, :length]
            if shrinking:
                cross = layer_cache.cross_attn
                cross.k, cross.v = cross.k[index], cross.v[index]
        live = next_live
        tokens = beams.tokens[:, -1:][live]
    return beams.best()


@dataclass
class ReferenceBeams:
    """Beams as they were: every row advanced every step, beams in rank order."""

    limits: list[int]
    beam_size: int
    alpha: float
    eos_id: int
    scores: torch.Tensor
    tokens: torch.Tensor
    finished: list[list[Hypothesis]]
    done: list[bool]
    patience: float | None = None

    @classmethod
    def start(
        cls, limits: list[int], beam_size: int, alpha: float, eos_id: int, device: torch.device
    ) -> ReferenceBeams:
        scores = torch.full((len(limits), beam_size), float("-inf"), device=device)
        scores[:, 0] = 0.0
        tokens = torch.zeros(len(limits) * beam_size, 0, dtype=torch.long, device=device)
        done = [limit <= 0 for limit in limits]
        return cls(limits, beam_size, alpha, eos_id, scores, tokens, [[] for _ in limits], done)

    def advance(self, log_probs: torch.Tensor) -> torch.Tensor | None:
        B, K = self.scores.shape
        V = log_probs.shape[-1]
        candidates = (self.scores.view(B * K, 1) + log_probs).view(B, K * V)
        top_scores, top_index = candidates.topk(2 * K, dim=-1)
        scores, parents, tokens = top_scores.tolist(), (top_index // V).tolist(), (top_index % V).tolist()
        prefixes = self.tokens.view(B, K, self.tokens.shape[1]).tolist()
        kept: list[list[Candidate]] = [[] for _ in range(B)]
        for b in range(B):
            if not self.done[b]:
                kept[b] = self._select(b, zip(scores[b], parents[b], tokens[b], strict=True), prefixes[b])
        if all(self.done):
            return None
        dead = (float("-inf"), 0, self.eos_id)
        table = torch.tensor([row + [dead] * (K - len(row)) for row in kept], dtype=torch.float64)
        device = self.tokens.device
        flat_parents = (torch.arange(B)[:, None] * K + table[..., 1].long()).view(-1).to(device)
        self.scores = table[..., 0].float().to(device)
        self.tokens = torch.cat([self.tokens[flat_parents], table[..., 2].long().view(-1, 1).to(device)], 1)
        return flat_parents

    def _select(self, b: int, ranked: Iterable[Candidate], prefixes: list[list[int]]) -> list[Candidate]:
        K = self.beam_size
        last_step = len(prefixes[0]) + 1 >= self.limits[b]
        kept: list[Candidate] = []
        for rank, (score, parent, token) in enumerate(ranked):
            if score == float("-inf"):
                break
            if token == self.eos_id and rank >= K and not last_step:
                continue
            if token == self.eos_id or last_step:
                hypothesis = prefixes[parent] + ([] if token == self.eos_id else [token])
                self.finished[b].append((score / length_penalty(len(hypothesis) + 1, self.alpha), hypothesis))
            elif len(kept) < K:
                kept.append((score, parent, token))
        best_done = max((score for score, _ in self.finished[b]), default=float("-inf"))
        reachable = kept[0][0] / length_penalty(self.limits[b] + 1, self.alpha) if kept else float("inf")
        self.done[b] = not kept or (len(self.finished[b]) >= K and best_done >= reachable)
        if self.patience is not None:
            self.done[b] = not kept or len(self.finished[b]) >= max(1, round(K * self.patience))
        return kept

    def best(self) -> list[list[int]]:
        return [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in self.finished]


def reference_translate_ids(
    model: EncoderDecoder,
    sources: Sequence[Sequence[int]],
    bos_id: int,
    eos_id: int,
    pad_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    batch_size: int = 32,
    extra_len: int = 50,
) -> list[list[int]]:
    """translate_ids as it was: sources sorted by length, batches of `batch_size`, input order kept."""
    device = next(model.parameters()).device
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[list[int]] = [[] for _ in sources]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        rows = [[*sources[i], eos_id] for i in chunk]
        width = max(len(r) for r in rows)
        src = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
        for j, row in enumerate(rows):
            src[j, : len(row)] = torch.tensor(row)
        src_mask = (src != pad_id).long()
        max_len = [min(len(row) + extra_len, model.config.max_seq_len) for row in rows]
        if beam_size == 1:
            out = greedy_search(model, src, src_mask, max_len, bos_id, eos_id)
        else:
            out = reference_beam_search(model, src, src_mask, max_len, bos_id, eos_id, beam_size, alpha)
        for i, ids in zip(chunk, out, strict=True):
            results[i] = ids
    return results


def legacy_sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float
) -> tuple[torch.Tensor, None]:
    """sdpa_attention's routing before fp32 took the single-query path: matmuls for one query only in bf16/fp16."""
    if mask.bias is None and mask.needs_bias(q.shape[2], k.shape[2]):
        return attention_module.long_attention(q, k, v, mask, dropout_p), None
    low_precision = q.dtype in (torch.bfloat16, torch.float16)
    if q.shape[2] == 1 and q.shape[0] > 1 and q.device.type == "cpu" and low_precision and not dropout_p:
        return attention_module.single_query_attention(q, k, v, mask), None
    bias = None if mask.bias is None else mask.bias.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=mask.fast_causal(), enable_gqa=k.shape[1] != q.shape[1]
    )
    return out, None


@contextmanager
def legacy_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every attention layer of `model` on the sdpa backend routes as it used to."""
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.backend is attention_module.sdpa_attention]
    for layer in layers:
        layer.backend = legacy_sdpa_attention
    try:
        yield
    finally:
        for layer in layers:
            layer.backend = attention_module.sdpa_attention
