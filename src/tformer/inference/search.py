"""Decoding for encoder-decoder models: greedy and beam search with a length penalty, on a KV cache.

Beam search keeps `beam_size` hypotheses per sentence, scores finished ones by log p(y | x) / lp(y) with
GNMT's length penalty lp(y) = ((5 + |y|) / 6) ** alpha (the 2017 paper uses alpha = 0.6, beam 4), and
stops a sentence once it has `beam_size` finished hypotheses and no live one can still beat the best.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tformer.models import EncoderDecoder


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp(y) = ((5 + |y|) / 6) ** alpha; alpha = 0 ranks by raw log-probability."""
    return ((5 + length) / 6) ** alpha


@torch.no_grad()
def greedy_search(
    model: EncoderDecoder,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    max_len: int | Sequence[int],
    bos_id: int,
    eos_id: int,
) -> list[list[int]]:
    """The arg-max token at every step, for a batch of sources (B, S); returns ids without <s> / </s>.

    `max_len` caps the generated tokens, for the whole batch or per row.
    """
    model.eval()
    B = src.shape[0]
    limits = _row_limits(max_len, B)
    memory = model.encode(src, src_mask)
    cache = model.new_cache(B, max(limits) + 1)
    tokens = torch.full((B, 1), bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    out: list[torch.Tensor] = []
    row_limits = torch.tensor(limits, device=src.device)
    for t in range(max(limits)):
        logits = model.decode(tokens, memory, src_mask, cache=cache, start=t)[:, -1]  # (B, V)
        tokens = logits.argmax(-1, keepdim=True).masked_fill(done[:, None], eos_id)
        out.append(tokens)
        done |= (tokens[:, 0] == eos_id) | (row_limits <= t + 1)
        if done.all():
            break
    ids = torch.cat(out, 1).tolist()
    return [row[: row.index(eos_id)] if eos_id in row else row for row in ids]


@torch.no_grad()
def beam_search(
    model: EncoderDecoder,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    max_len: int | Sequence[int],
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
) -> list[list[int]]:
    """Batched beam search over sources (B, S); returns the best hypothesis per source, without specials.

    `max_len` caps the generated tokens, for the whole batch or per row.
    """
    model.eval()
    B, K = src.shape[0], beam_size
    limits = _row_limits(max_len, B)
    memory = model.encode(src, src_mask).repeat_interleave(K, 0)  # (B*K, S, d)
    src_mask = src_mask.repeat_interleave(K, 0)
    cache = model.new_cache(B * K, max(limits) + 1)
    tokens = torch.full((B * K, 1), bos_id, dtype=torch.long, device=src.device)
    scores = torch.zeros(B, K, device=src.device)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done = [False] * B
    for t in range(max(limits)):
        logits = model.decode(tokens[:, -1:], memory, src_mask, cache=cache, start=t)[:, -1]  # (B*K, V)
        log_probs = torch.log_softmax(logits.float(), -1)
        V = log_probs.shape[-1]
        candidates = (scores.view(B * K, 1) + log_probs).view(B, K * V)
        top_scores, top_index = candidates.topk(2 * K, dim=-1)  # (B, 2K): at least K are not </s>
        parents, next_tokens = top_index // V, top_index % V
        new_scores, new_parents, new_tokens = _select_beams(
            top_scores, parents, next_tokens, tokens.view(B, K, -1), finished, done, eos_id, alpha, limits
        )
        if all(done):
            break
        flat_parents = (torch.arange(B, device=src.device)[:, None] * K + new_parents).view(-1)
        for layer_cache in cache:
            layer_cache.reorder(flat_parents)
        tokens = torch.cat([tokens[flat_parents], new_tokens.view(-1, 1)], 1)
        scores = new_scores
    return [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in finished]


def _select_beams(
    top_scores: torch.Tensor,
    parents: torch.Tensor,
    next_tokens: torch.Tensor,
    prefixes: torch.Tensor,
    finished: list[list[tuple[float, list[int]]]],
    done: list[bool],
    eos_id: int,
    alpha: float,
    limits: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Moves hypotheses ending in </s> to `finished`; keeps the best K others as the next beams.

    As in fairseq, a </s> ranked below the K best candidates is not one of the beam's hypotheses and is
    dropped (so a one-wide beam is greedy search). A sentence is done once it has K finished hypotheses and
    the best of them beats anything a live beam can still reach: log-probabilities only fall, and lp() is
    at most lp(limit + 1), which a hypothesis stopped at its row's limit of tokens gets.
    """
    B, K = top_scores.shape[0], top_scores.shape[1] // 2
    new_scores = torch.full((B, K), float("-inf"), device=top_scores.device)
    new_parents = torch.zeros(B, K, dtype=torch.long, device=top_scores.device)
    new_tokens = torch.full((B, K), eos_id, dtype=torch.long, device=top_scores.device)
    for b in range(B):
        if done[b]:
            continue
        last_step = prefixes.shape[-1] == limits[b]
        kept = 0
        ranked = zip(top_scores[b].tolist(), parents[b].tolist(), next_tokens[b].tolist())
        for rank, (score, parent, token) in enumerate(ranked):
            if score == float("-inf"):
                break
            if token == eos_id and rank >= K and not last_step:
                continue
            hypothesis = prefixes[b, parent, 1:].tolist()  # without <s>
            if token == eos_id or last_step:
                if token != eos_id:
                    hypothesis = [*hypothesis, token]
                finished[b].append((score / length_penalty(len(hypothesis) + 1, alpha), hypothesis))
            elif kept < K:
                new_scores[b, kept], new_parents[b, kept], new_tokens[b, kept] = score, parent, token
                kept += 1
        reachable = new_scores[b, 0].item() / length_penalty(limits[b] + 1, alpha)
        best_done = max((score for score, _ in finished[b]), default=float("-inf"))
        if kept == 0 or (len(finished[b]) >= K and best_done >= reachable):
            done[b] = True
    return new_scores, new_parents, new_tokens


def _row_limits(max_len: int | Sequence[int], batch_size: int) -> list[int]:
    return [max_len] * batch_size if isinstance(max_len, int) else list(max_len)


def translate_ids(
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
    """Decodes each source (token ids, </s> appended here) into at most len(source) + 1 + `extra_len` tokens.

    Sources are batched by length and results returned in input order. beam_size 1 means greedy search.
    """
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
            out = beam_search(model, src, src_mask, max_len, bos_id, eos_id, beam_size, alpha)
        for i, ids in zip(chunk, out):
            results[i] = ids
    return results
