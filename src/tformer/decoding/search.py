"""Greedy and beam search on a KV cache: for encoder-decoder models, and beam search for decoder-only ones.

Beam search keeps `beam_size` hypotheses per sentence, scores finished ones by log p(y | x) / lp(y) with
GNMT's length penalty lp(y) = ((5 + |y|) / 6) ** alpha (the 2017 paper uses alpha = 0.6, beam 4), and
stops a sentence once it has `beam_size` finished hypotheses and no live one can still beat the best.
`Beams` keeps those books; the two searches only run the model and reorder its cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tformer.decoding.beam_cache import BeamKVCache, BeamMemory
from tformer.errors import RequestError
from tformer.layers.kv_cache import LayerCache
from tformer.models import DecoderLM, EncoderDecoder, RecurrentCache

Hypothesis = tuple[float, list[int]]  # (log p / lp, tokens without specials)
Candidate = tuple[float, int, int]  # (summed log p, parent beam, next token)
# batches searched side by side by default on the CPU: two measured faster than one on 2 cores with the same
# outputs (docs/translation.md); more is unmeasured, and each holds its own KV caches
MAX_WORKERS = 4


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
    patience: float | None = None,
) -> list[list[int]]:
    """Batched beam search over sources (B, S); returns the best hypothesis per source, without specials.

    `max_len` caps the generated tokens, for the whole batch or per row. `patience` None searches until no live
    beam can beat the best finished hypothesis (exact); a number p stops a source once round(beam_size * p) of its
    hypotheses have finished, as CTranslate2's `patience` (1 is its default; docs/translation.md measures it).

    The cache is never copied wholesale: the encoder's keys and values are projected once per source and its
    K beams attend to them as K queries (`EncoderDecoder.new_cache` with the memory); a beam that continues its
    parent's row copies nothing, and only beams whose parent sits in another row copy that row's self-attention
    keys (`Beams` puts a beam in its parent's row when it can). As in fairseq, a source whose search is done
    leaves the batch: the model then runs only on the K beams of each source still searching.
    """
    model.eval()
    B, K = src.shape[0], beam_size
    limits = _row_limits(max_len, B)
    beams = Beams.start(limits, K, alpha, eos_id, src.device, patience)
    memory = model.encode(src, src_mask)
    if isinstance(model, EncoderDecoder):
        cache = model.new_cache(B * K, max(limits) + 1, memory=memory, src_mask=src_mask)
        shares_keys = not any(model.decoder.windows) and not model.decoder.positions.has_attention_bias
        for block, layer_cache in zip(model.decoder.layers, cache, strict=True):
            cross = layer_cache.cross_attn
            if block.cross_attn.attends_plainly() and BeamMemory.serves(cross, src_mask):
                layer_cache.cross_attn = BeamMemory(cross.k, cross.v, src_mask, K)  # read in place, by slots
            else:  # (B, Hkv, S, D) views of the projection's (B, S, Hkv * D): made whole once, or every step's
                cross.k, cross.v = cross.k.contiguous(), cross.v.contiguous()  # attention matmul would copy them
            beam_cache = BeamKVCache.replacing(layer_cache.self_attn)
            if shares_keys and beam_cache.attends_in_place:  # beams share their keys through a table: no copies
                beam_cache.beams = K
                layer_cache.self_attn = beam_cache
        memory = src_mask = None
    else:  # a model whose decoder state holds the memory per row (the LSTM baseline): each beam gets a copy
        memory, src_mask = memory.repeat_interleave(K, 0), src_mask.repeat_interleave(K, 0)  # (B*K, S, d)
        cache = model.new_cache(B * K, max(limits) + 1)
    tokens = torch.full((B * K, 1), bos_id, dtype=torch.long, device=src.device)
    live = list(range(B))  # the sources still searching, in the order of the model's batch
    for t in range(max(limits)):
        logits = model.decode(tokens, memory, src_mask, cache=cache, start=t)[:, -1]  # (len(live) * K, V)
        memory = None  # the cross-attention keys and values are cached after the first step
        parents = beams.advance(torch.log_softmax(logits.float(), -1), live)  # places in this step's batch
        if parents is None:
            break
        searching = [i for i, row in enumerate(live) if not beams.done[row]]
        if len(searching) < len(live):  # sources that are done leave the batch; their beams' parents with them
            parents = parents.view(len(live), K)[searching].view(-1)
            if src_mask is not None:
                src_mask = src_mask.view(len(live), K, -1)[searching].flatten(0, 1)
            live = [live[i] for i in searching]
        _reorder(cache, parents, t + 1, shrinking=len(parents) < len(tokens))
        tokens = beams.last_tokens(live)
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
    new beam continues, so that the caller reorders its KV cache to match. A new beam takes its parent's row
    when no better beam of the same parent took it first, so that most rows continue their own cache.
    """

    limits: list[int]  # the most tokens each row may generate
    beam_size: int
    alpha: float
    eos_id: int
    scores: torch.Tensor  # (B, K) summed log-probabilities of the live hypotheses; -inf for a dead beam
    tokens: torch.Tensor  # (B*K, t) the live hypotheses
    finished: list[list[Hypothesis]]  # per row, every hypothesis that ended in </s> or at the row's limit
    done: list[bool]  # per row: no live beam can beat its best finished hypothesis any more
    patience: float | None = None  # None: search exactly; p: a row is done with round(K * p) finished hypotheses

    @classmethod
    def start(
        cls,
        limits: list[int],
        beam_size: int,
        alpha: float,
        eos_id: int,
        device: torch.device,
        patience: float | None = None,
    ) -> Beams:
        """Empty hypotheses; only the first beam of a row is live, since K identical beams would expand alike."""
        if beam_size < 1:
            raise ValueError(f"beam_size is {beam_size}; it must be at least 1 (1 is greedy search)")
        if patience is not None and not patience > 0:
            raise ValueError(f"patience is {patience}; give a number above 0 (1 stops at beam_size finished), or None")
        scores = torch.full((len(limits), beam_size), float("-inf"), device=device)
        scores[:, 0] = 0.0
        tokens = torch.zeros(len(limits) * beam_size, 0, dtype=torch.long, device=device)
        done = [limit <= 0 for limit in limits]
        return cls(limits, beam_size, alpha, eos_id, scores, tokens, [[] for _ in limits], done, patience)

    def advance(self, log_probs: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor | None:
        """Extends the beams of `rows` (default: all) by one token, given the next-token log-probabilities
        (len(rows)*K, V) of their beams, in that order (the model's batch, which holds only the rows still searching).

        Returns the parent of each new beam (len(rows)*K,) as a place in that batch, or None once every row is done.
        """
        K = self.beam_size
        rows = range(len(self.limits)) if rows is None else rows
        n, V = len(rows), log_probs.shape[-1]
        device = self.tokens.device
        scores = self.scores if n == len(self.limits) else self.scores[torch.tensor(list(rows), device=device)]
        candidates = (scores.view(n * K, 1) + log_probs).view(n, K * V)
        top_scores, top_index = candidates.topk(2 * K, dim=-1)  # (n, 2K): at least K are not </s>
        scores, parents, tokens = top_scores.tolist(), (top_index // V).tolist(), (top_index % V).tolist()
        placed: list[list[Candidate]] = []
        for i, b in enumerate(rows):
            kept = [] if self.done[b] else self._select(b, zip(scores[i], parents[i], tokens[i], strict=True))
            placed.append(self._place(kept))
        if all(self.done):
            return None
        table = torch.tensor(placed, dtype=torch.float64)  # (n, K, 3): float64 holds float32 scores and ids exactly
        parent_beams = table[..., 1].long()  # (n, K): each new beam's parent among the K of its row
        B, advanced = len(self.limits), torch.tensor(list(rows), dtype=torch.long)
        all_parents = torch.arange(B * K).view(B, K)  # rows that were not advanced keep their beams
        all_parents[advanced] = advanced[:, None] * K + parent_beams
        next_tokens = torch.full((B, K), self.eos_id, dtype=torch.long)
        next_tokens[advanced] = table[..., 2].long()
        self.scores[advanced.to(device)] = table[..., 0].float().to(device)
        self.tokens = torch.cat([self.tokens[all_parents.view(-1).to(device)], next_tokens.view(-1, 1).to(device)], 1)
        return (torch.arange(n)[:, None] * K + parent_beams).view(-1).to(device)

    def _select(self, b: int, ranked: Iterable[Candidate]) -> list[Candidate]:
        """Moves row b's candidates ending in </s> to `finished`; returns the best K others as its next beams.

        As in fairseq, a </s> ranked below the K best candidates is not one of the beam's hypotheses and is
        dropped (so a one-wide beam is greedy search); at the row's limit every candidate finishes. A row is
        done once it has K finished hypotheses and the best of them beats anything a live beam can still
        reach: log-probabilities only fall, and lp() is at most lp(limit + 1), which a hypothesis stopped at
        its row's limit of tokens gets. With `patience` p a row is done once round(K * p) hypotheses finished,
        whatever the live beams could still reach (CTranslate2's rule).
        """
        K = self.beam_size
        length = self.tokens.shape[1]
        last_step = length + 1 >= self.limits[b]
        kept: list[Candidate] = []
        for rank, (score, parent, token) in enumerate(ranked):
            if score == float("-inf"):
                break
            if token == self.eos_id and rank >= K and not last_step:
                continue
            if token == self.eos_id or last_step:
                prefix = self.tokens[b * K + parent].tolist()
                hypothesis = prefix + ([] if token == self.eos_id else [token])
                self.finished[b].append((score / length_penalty(len(hypothesis) + 1, self.alpha), hypothesis))
            elif len(kept) < K:
                kept.append((score, parent, token))
        if self.patience is not None:
            self.done[b] = not kept or len(self.finished[b]) >= max(1, round(K * self.patience))
            return kept
        best_done = max((score for score, _ in self.finished[b]), default=float("-inf"))
        reachable = kept[0][0] / length_penalty(self.limits[b] + 1, self.alpha) if kept else float("inf")
        self.done[b] = not kept or (len(self.finished[b]) >= K and best_done >= reachable)
        return kept

    def _place(self, kept: list[Candidate]) -> list[Candidate]:
        """The K beams of one row in slot order: each in its parent's slot if no better beam of that parent took it
        (so its cache needs no copy), the others in the free slots, and dead beams (-inf, their own slot, </s>)
        where fewer than K live."""
        K = self.beam_size
        slots: list[Candidate | None] = [None] * K
        others = []
        for candidate in kept:
            if slots[candidate[1]] is None:
                slots[candidate[1]] = candidate
            else:
                others.append(candidate)
        free = iter(k for k in range(K) if slots[k] is None)
        for candidate in others:
            slots[next(free)] = candidate
        return [(float("-inf"), k, self.eos_id) if c is None else c for k, c in enumerate(slots)]

    def last_tokens(self, rows: Sequence[int] | None = None) -> torch.Tensor:
        """The newest token of every beam of `rows` (default: all) (len(rows)*K, 1): the next step's input."""
        K = self.beam_size
        if rows is None or len(rows) == len(self.limits):
            return self.tokens[:, -1:]
        beam_rows = torch.tensor([b * K + k for b in rows for k in range(K)], device=self.tokens.device)
        return self.tokens[beam_rows, -1:]

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
    patience: float | None = None,
    batch_tokens: int = 0,
    progress: Callable[[int], object] | None = None,
    workers: int | None = None,
) -> list[list[int]]:
    """Decodes each source (token ids, </s> appended here) into at most len(source) + 1 + `extra_len` tokens.

    Sources are batched by length and results returned in input order: a batch holds at most `batch_size`
    sources and, with `batch_tokens`, at most that many padded source tokens (at least one source). beam_size 1
    means greedy search; `patience` is beam search's early stop (`beam_search`). `progress(n)` is called as each
    batch of n sources is done. A source longer than the model's positions (max_seq_len, with its </s>) is a
    RequestError naming it.

    `workers` > 1 searches that many batches at once, each on a thread of its own with torch's intra-op threads
    shared out among them (set back after): a beam search step is many small ops, and several batches side by side
    keep the cores busier than one batch's ops split across them (docs/translation.md measures it). The results
    do not depend on it. None: `default_workers` for the model's device.
    """
    limit = model.config.max_seq_len
    for i, source in enumerate(sources):
        if len(source) + 1 > limit:
            raise RequestError(
                f"source {i} has {len(source)} tokens (+ </s>), more than this model's max_seq_len of {limit} "
                "positions; split it into shorter sentences"
            )
    device = next(model.parameters()).device
    if workers is None:
        workers = default_workers(device)
    if workers < 1:
        raise ValueError(f"workers is {workers}; give 1 (one batch at a time) or more")

    def search(chunk: list[int]) -> list[list[int]]:
        rows = [[*sources[i], eos_id] for i in chunk]
        width = max(len(r) for r in rows)
        src = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
        for j, row in enumerate(rows):
            src[j, : len(row)] = torch.tensor(row)
        src_mask = (src != pad_id).long()
        max_len = [min(len(row) + extra_len, model.config.max_seq_len) for row in rows]
        if beam_size == 1:
            return greedy_search(model, src, src_mask, max_len, bos_id, eos_id)
        return beam_search(model, src, src_mask, max_len, bos_id, eos_id, beam_size, alpha, patience)

    results: list[list[int]] = [[] for _ in sources]
    batches = length_batches([len(source) + 1 for source in sources], batch_size, batch_tokens)
    threads, workers = torch.get_num_threads(), min(workers, len(batches))
    pool = ThreadPoolExecutor(workers) if workers > 1 else None  # one: this thread, its settings (autocast) kept
    if pool is not None:
        torch.set_num_threads(max(1, threads // workers))
    try:
        for chunk, out in zip(
            batches, map(search, batches) if pool is None else pool.map(search, batches), strict=True
        ):
            for i, ids in zip(chunk, out, strict=True):
                results[i] = ids
            if progress is not None:
                progress(len(chunk))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
            torch.set_num_threads(threads)
    return results


def default_workers(device: torch.device) -> int:
    """Batches searched at once by default: on the CPU one per intra-op thread, at most MAX_WORKERS (each then
    runs on threads / workers of them), else one (an accelerator runs one batch's ops in parallel itself)."""
    return min(torch.get_num_threads(), MAX_WORKERS) if device.type == "cpu" else 1


def length_batches(lengths: Sequence[int], batch_size: int, batch_tokens: int = 0) -> list[list[int]]:
    """Indices of `lengths` sorted by length and cut into batches of at most `batch_size` items and, with
    `batch_tokens`, at most that many padded tokens (items x the longest); an item longer than that goes alone."""
    if batch_size < 1 or batch_tokens < 0:
        raise ValueError(f"batch_size {batch_size} and batch_tokens {batch_tokens}: give batch_size >= 1, tokens >= 0")
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        batch = batches[-1] if batches else None
        full = batch is None or len(batch) >= batch_size
        if not full and batch_tokens and (len(batch) + 1) * lengths[i] > batch_tokens:
            full = True  # sorted by length: the newest item is the longest
        if full:
            batches.append([i])
        else:
            batch.append(i)
    return batches
