"""Greedy and beam search on a KV cache: for encoder-decoder models, and beam search for decoder-only ones.

Beam search keeps `beam_size` hypotheses per sentence, scores finished ones by log p(y | x) / lp(y) with
GNMT's length penalty lp(y) = ((5 + |y|) / 6) ** alpha (the 2017 paper uses alpha = 0.6, beam 4), and
stops a sentence once it has `beam_size` finished hypotheses and no live one can still beat the best.
`Beams` keeps those books; the two searches only run the model and reorder its cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tformer.errors import RequestError
from tformer.layers.kv_cache import LayerCache
from tformer.models import DecoderLM, EncoderDecoder, RecurrentCache

Hypothesis = tuple[float, list[int]]  # (log p / lp, tokens without specials)
Candidate = tuple[float, int, int]  # (summed log p, parent beam, next token)


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

    `max_len` caps the generated tokens, for the whole batch or per row. As in fairseq, a source whose search
    is done leaves the batch: the model then runs only on the K beams of each source still searching, so a
    batch costs what its live sources cost, not what its longest one does.
    """
    model.eval()
    B, K = src.shape[0], beam_size
    limits = _row_limits(max_len, B)
    memory = model.encode(src, src_mask).repeat_interleave(K, 0)  # (B*K, S, d)
    src_mask = src_mask.repeat_interleave(K, 0)
    cache = model.new_cache(B * K, max(limits) + 1)
    beams = Beams.start(limits, K, alpha, eos_id, src.device)
    tokens = torch.full((B * K, 1), bos_id, dtype=torch.long, device=src.device)
    live = torch.arange(B * K, device=src.device)  # the beam rows (b * K + k) in the model's batch, in order
    for t in range(max(limits)):
        logits = model.decode(tokens, memory, src_mask, cache=cache, start=t)[:, -1]  # (len(live), V)
        memory = None  # the cross-attention keys and values are cached after the first step
        log_probs = logits.new_zeros(B * K, logits.shape[-1], dtype=torch.float32)  # rows of done sources: unread
        log_probs[live] = torch.log_softmax(logits.float(), -1)
        parents = beams.advance(log_probs)
        if parents is None:
            break
        searching = torch.tensor([not done for done in beams.done], device=src.device).repeat_interleave(K)
        next_live = searching.nonzero()[:, 0]
        slot = torch.full((B * K,), -1, dtype=torch.long, device=src.device)
        slot[live] = torch.arange(len(live), device=src.device)  # beam row -> its place in the batch
        index = slot[parents[next_live]]  # a beam's parent is a beam of the same source: still in the batch
        if len(next_live) < len(live):
            src_mask = src_mask[slot[next_live]]
        _reorder(cache, index, t + 1, shrinking=len(next_live) < len(live))
        live = next_live
        tokens = beams.last_tokens()[live]
    return beams.best()


@torch.no_grad()
def beam_search_decoder(
    model: DecoderLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
) -> list[list[int]]:
    """Batched beam search for a decoder-only model; returns each prompt's best continuation without </s>.

    Prompts of any lengths are left-padded into one batch and prefilled once; each prompt's K beams then
    start from copies of its cache rows. `max_new_tokens` caps the generated tokens, for the whole batch or
    per prompt. Hypotheses are scored, and a prompt's search stopped, as in `beam_search`.
    """
    model.eval()
    B, K = len(prompts), beam_size
    limits = _row_limits(max_new_tokens, B)
    _check_prompts(prompts, limits, model.config.max_seq_len)
    if B == 0:
        return []
    device = next(model.parameters()).device
    ids, mask = _left_pad(prompts, device)  # (B, P)
    P = ids.shape[1]
    cache = model.new_cache(B, P + max(limits))
    logits = model(ids, mask, cache=cache)[:, -1]  # (B, V): left padding puts every prompt's last token last
    prompt_rows = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,)
    _reorder(cache, prompt_rows)
    logits, mask = logits[prompt_rows], mask[prompt_rows]
    beams = Beams.start(limits, K, alpha, eos_id, device)
    for t in range(max(limits)):
        parents = beams.advance(torch.log_softmax(logits.float(), -1))
        if parents is None:
            break
        _reorder(cache, parents)  # a beam's parent has the same prompt, so the mask needs no reordering
        mask = torch.cat([mask, mask.new_ones(B * K, 1)], 1)  # (B*K, P + t + 1)
        logits = model(beams.last_tokens(), mask, cache=cache, start=P + t)[:, -1]
    return beams.best()


@dataclass
class Beams:
    """The books of a batched beam search: K live hypotheses per row, their scores, and the finished ones.

    Live hypotheses hold generated tokens only (no <s>, no prompt), in rows b * K + k like the model's
    batch. `advance` turns one step's log-probabilities into the next beams and returns the parent row each
    new beam continues, so that the caller reorders its KV cache to match.
    """

    limits: list[int]  # the most tokens each row may generate
    beam_size: int
    alpha: float
    eos_id: int
    scores: torch.Tensor  # (B, K) summed log-probabilities of the live hypotheses; -inf for a dead beam
    tokens: torch.Tensor  # (B*K, t) the live hypotheses
    finished: list[list[Hypothesis]]  # per row, every hypothesis that ended in </s> or at the row's limit
    done: list[bool]  # per row: no live beam can beat its best finished hypothesis any more

    @classmethod
    def start(cls, limits: list[int], beam_size: int, alpha: float, eos_id: int, device: torch.device) -> Beams:
        """Empty hypotheses; only the first beam of a row is live, since K identical beams would expand alike."""
        if beam_size < 1:
            raise ValueError(f"beam_size is {beam_size}; it must be at least 1 (1 is greedy search)")
        scores = torch.full((len(limits), beam_size), float("-inf"), device=device)
        scores[:, 0] = 0.0
        tokens = torch.zeros(len(limits) * beam_size, 0, dtype=torch.long, device=device)
        done = [limit <= 0 for limit in limits]
        return cls(limits, beam_size, alpha, eos_id, scores, tokens, [[] for _ in limits], done)

    def advance(self, log_probs: torch.Tensor) -> torch.Tensor | None:
        """Extends the beams by one token, given the next-token log-probabilities (B*K, V) of every beam.

        Returns the parent row (B*K,) of each new beam, or None once every row is done.
        """
        B, K = self.scores.shape
        V = log_probs.shape[-1]
        candidates = (self.scores.view(B * K, 1) + log_probs).view(B, K * V)
        top_scores, top_index = candidates.topk(2 * K, dim=-1)  # (B, 2K): at least K are not </s>
        scores, parents, tokens = top_scores.tolist(), (top_index // V).tolist(), (top_index % V).tolist()
        prefixes = self.tokens.view(B, K, self.tokens.shape[1]).tolist()
        kept: list[list[Candidate]] = [[] for _ in range(B)]
        for b in range(B):
            if not self.done[b]:
                kept[b] = self._select(b, zip(scores[b], parents[b], tokens[b], strict=True), prefixes[b])
        if all(self.done):
            return None
        dead = (float("-inf"), 0, self.eos_id)  # fills rows with fewer than K live beams
        table = torch.tensor([row + [dead] * (K - len(row)) for row in kept], dtype=torch.float64)  # (B, K, 3)
        device = self.tokens.device
        flat_parents = (torch.arange(B)[:, None] * K + table[..., 1].long()).view(-1).to(device)
        self.scores = table[..., 0].float().to(device)  # float64 holds the float32 scores and the ids exactly
        self.tokens = torch.cat([self.tokens[flat_parents], table[..., 2].long().view(-1, 1).to(device)], 1)
        return flat_parents

    def _select(self, b: int, ranked: Iterable[Candidate], prefixes: list[list[int]]) -> list[Candidate]:
        """Moves row b's candidates ending in </s> to `finished`; returns the best K others as its next beams.

        As in fairseq, a </s> ranked below the K best candidates is not one of the beam's hypotheses and is
        dropped (so a one-wide beam is greedy search); at the row's limit every candidate finishes. A row is
        done once it has K finished hypotheses and the best of them beats anything a live beam can still
        reach: log-probabilities only fall, and lp() is at most lp(limit + 1), which a hypothesis stopped at
        its row's limit of tokens gets.
        """
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
        return kept

    def last_tokens(self) -> torch.Tensor:
        """The newest token of every beam (B*K, 1): the next step's input."""
        return self.tokens[:, -1:]

    def best(self) -> list[list[int]]:
        """Each row's best finished hypothesis ([] for a row that may generate nothing)."""
        return [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in self.finished]


def _reorder(
    cache: list[LayerCache] | RecurrentCache, index: torch.Tensor, length: int | None = None, shrinking: bool = True
) -> None:
    """Each row of the batch takes the cache of row `index[row]`, for the first `length` positions (all if None).

    Cross-attention keys and values are the same for every beam of a source, so a reorder within the sources
    leaves them as they are; only a batch that drops sources (`shrinking`) selects their rows. An LSTM's state
    (models/recurrent.py) has no positions and reorders its rows the same way.
    """
    if isinstance(cache, RecurrentCache):
        cache.reorder(index, shrinking)
        return
    for layer_cache in cache:
        layer_cache.self_attn.reorder(index, length)
        if shrinking:
            layer_cache.cross_attn.reorder(index)


def _row_limits(max_len: int | Sequence[int], batch_size: int) -> list[int]:
    limits = [max_len] * batch_size if isinstance(max_len, int) else list(max_len)
    if len(limits) != batch_size:
        raise ValueError(f"got {len(limits)} length limits for a batch of {batch_size}: give one per row, or an int")
    return limits


def _check_prompts(prompts: Sequence[Sequence[int]], limits: list[int], max_seq_len: int) -> None:
    for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; beam search continues a prompt, so give it a token (e.g. <s>)")
        if len(prompt) + limit > max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens and may get {limit} more, beyond the model's max_seq_len "
                f"of {max_seq_len}; shorten the prompt or lower max_new_tokens"
            )


def _left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in a (B, P) batch of ids, padded with 0, and its mask (1 for real tokens)."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


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
    A source longer than the model's positions (max_seq_len, with its </s>) is a RequestError naming it.
    """
    limit = model.config.max_seq_len
    for i, source in enumerate(sources):
        if len(source) + 1 > limit:
            raise RequestError(
                f"source {i} has {len(source)} tokens (+ </s>), more than this model's max_seq_len of {limit} "
                "positions; split it into shorter sentences"
            )
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
        for i, ids in zip(chunk, out, strict=True):
            results[i] = ids
    return results
