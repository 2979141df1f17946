"""Speculative decoding with a draft model, batched over requests of different lengths.

Each round the small draft model proposes k tokens per row; the target scores all k + 1 positions in one
forward, and the standard rejection scheme (Leviathan et al., 2023; Chen et al., 2023) decides how many to
keep: draft token x with draft probability q(x) survives with probability min(1, p(x) / q(x)); the first
rejected one is replaced by a sample from norm(max(0, p - q)); if all k survive, one more token comes from
the target's last distribution. The output follows the target's distribution exactly, and with greedy
parameters (one-hot p and q) it is the target's own greedy output. Rows advance by different amounts, so
each row's new tokens are placed at its own positions in contiguous KV caches.

In the engine (`Engine(model, draft=...)`), a `Drafter` keeps the draft's keys and values in a paged cache of
its own that the target's block tables address: the two caches hold the same positions of the same sequences,
so blocks, copy-on-write, prefix hits and preemption serve both. The draft runs over every prompt chunk the
target runs over, then proposes tokens for the decode rows of a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tformer.engine.paged import PagedKVCache
from tformer.engine.runner import DecoderRunner, StepBatch, step_inputs
from tformer.engine.sampling import (
    RequestError,
    SamplingParams,
    greedy_tokens,
    make_generator,
    sample_index,
    sampling_probs,
)
from tformer.engine.scheduler import SequenceState
from tformer.errors import ConfigError
from tformer.models import DecoderLM, TransformerModel


def accept_draft(
    draft_tokens: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> list[int]:
    """The tokens one row keeps: accepted draft tokens plus one from the target. q: (k, V), p: (k + 1, V)."""
    kept = []
    for i, token in enumerate(draft_tokens):
        p, q = float(target_probs[i, token]), float(draft_probs[i, token])
        if q > 0 and (p >= q or torch.rand((), generator=generator).item() < p / q):
            kept.append(token)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        total = residual.sum()
        choice = residual / total if total > 0 else target_probs[i]
        return kept + [sample_index(choice, generator)]
    return kept + [sample_index(target_probs[len(draft_tokens)], generator)]


def accept_greedy(draft_tokens: list[int], target_tokens: list[int]) -> list[int]:
    """What `accept_draft` keeps when p and q are one-hot (greedy): the drafts up to the first one that is not
    the target's argmax at its position, then the target's argmax there. target_tokens has k + 1 entries."""
    kept = []
    for token, best in zip(draft_tokens, target_tokens[: len(draft_tokens)], strict=True):
        if token != best:
            break
        kept.append(token)
    return kept + [target_tokens[len(kept)]]


@dataclass
class SpeculativeStats:
    """How well the draft guessed: proposed and accepted draft tokens, and target forwards."""

    proposed: int = 0
    accepted: int = 0
    target_calls: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class _Rows:
    """Per-row state of a batch: token ids so far, how many each model has cached, and the row's goal."""

    def __init__(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        self.ids = [list(p) for p in prompts]
        self.goal = [len(p) + max_tokens for p in prompts]
        self.target_cached = [0] * len(prompts)
        self.draft_cached = [0] * len(prompts)

    def active(self) -> list[bool]:
        return [len(ids) < goal for ids, goal in zip(self.ids, self.goal, strict=True)]


def _feed(model: DecoderLM, cache: list, rows: list[list[int]], starts: list[int]) -> torch.Tensor:
    """Runs each row's tokens from its start position through the cached model; logits (B, T, V).

    An empty row (a finished request) is all padding: position -1, nothing written.
    """
    batch = StepBatch.build(rows, starts, model.decoder.tokens.weight.device)
    return model(batch.tokens, cache=cache, inputs=batch.stack_inputs(cache)).float()


@torch.inference_mode()
def speculative_generate(
    target: DecoderLM,
    draft: DecoderLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    k: int = 4,
    stats: SpeculativeStats | None = None,
) -> list[list[int]]:
    """Generates params.max_tokens tokens per prompt (eos is not special here), k draft tokens per round."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise RequestError(
            f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}); pick a draft trained with the same tokenizer"
        )
    stats = stats if stats is not None else SpeculativeStats()
    longest = max(len(p) for p in prompts) + params.max_tokens + k + 1
    # rows advance at their own positions, which a rolling window buffer cannot take: keep every position
    t_cache = target.new_cache(len(prompts), longest, rolling=False)
    d_cache = draft.new_cache(len(prompts), longest, rolling=False)
    rows = _Rows(prompts, params.max_tokens)
    generator = None if params.greedy else make_generator(params.seed)
    while any(active := rows.active()):
        proposals, q = _propose(draft, d_cache, rows, active, params, k, generator)
        fed = [
            ids[start:] + prop if on else []
            for ids, start, prop, on in zip(rows.ids, rows.target_cached, proposals, active, strict=True)
        ]
        logits = _feed(target, t_cache, fed, rows.target_cached)
        stats.target_calls += 1
        best = greedy_tokens(logits.flatten(0, 1)).view(logits.shape[:2]).tolist() if params.greedy else None
        for b in (b for b, on in enumerate(active) if on):
            n_pending = len(fed[b]) - k  # tokens not yet in the target cache, before the proposal
            if best is not None:
                kept = accept_greedy(proposals[b], best[b][n_pending - 1 : n_pending + k])
            else:
                assert q is not None
                p = torch.stack([sampling_probs(logits[b, n_pending - 1 + i], params) for i in range(k + 1)])
                kept = accept_draft(proposals[b], q[b], p, generator)
            stats.proposed += k
            stats.accepted += len(kept) - 1
            rows.target_cached[b] = len(rows.ids[b]) + len(kept) - 1  # the last kept token is not cached yet
            rows.draft_cached[b] = min(rows.draft_cached[b], rows.target_cached[b])
            rows.ids[b] += kept
    return [ids[len(p) : goal] for ids, p, goal in zip(rows.ids, prompts, rows.goal, strict=True)]


def _propose(
    draft: DecoderLM,
    cache: list,
    rows: _Rows,
    active: list[bool],
    params: SamplingParams,
    k: int,
    generator: torch.Generator | None,
) -> tuple[list[list[int]], torch.Tensor | None]:
    """k draft tokens per active row and the draft distributions they were drawn from, (B, k, V); None when
    greedy."""
    proposals: list[list[int]] = [[] for _ in rows.ids]
    dists = []
    for _ in range(k):
        starts = list(rows.draft_cached)
        fed = [
            (ids + prop)[start:] if on else []
            for ids, prop, start, on in zip(rows.ids, proposals, starts, active, strict=True)
        ]
        logits = _feed(draft, cache, fed, starts)
        last = torch.tensor([max(len(f) - 1, 0) for f in fed], device=logits.device)
        next_logits = logits[torch.arange(len(fed)), last]  # (B, V)
        if params.greedy:  # one-hot distributions: the argmax is all a greedy round needs
            best = greedy_tokens(next_logits).tolist()
        else:
            dists.append(torch.stack([sampling_probs(row, params) for row in next_logits]))
        for b in (b for b, on in enumerate(active) if on):
            token = best[b] if params.greedy else sample_index(dists[-1][b], generator)
            proposals[b].append(token)
            rows.draft_cached[b] = starts[b] + len(fed[b])
    return proposals, torch.stack(dists, 1) if dists else None


class Drafter:
    """The draft model of the engine's speculative decoding, with its paged KV cache (see the module docstring)."""

    def __init__(self, draft: DecoderLM, kv: PagedKVCache, compile: bool = False) -> None:
        self.runner = DecoderRunner(draft, compile)
        self.kv = kv

    def follow(self, seqs: list[SequenceState], chunks: list[list[int]], starts: list[int], pack: bool = True) -> None:
        """Runs the draft over the tokens the target has just run (chunks[i] from position starts[i]; prompt chunks
        packed in one row with `pack`, where the draft allows it too): its cache keeps pace.

        A sequence whose draft cache lagged behind (a beam, say) is left behind; it is never drafted for.
        """
        prompts = min(len(chunk) for chunk in chunks) > 1  # a decode group never packs: spare the layer walk
        batch, views = step_inputs(
            self.kv, [seq.table for seq in seqs], chunks, starts, pack and prompts and self.runner.packs()
        )
        self.runner.logits(seqs, batch, views)
        for seq, start, chunk in zip(seqs, starts, chunks, strict=True):
            if seq.draft_computed == start:
                seq.draft_computed = start + len(chunk)

    def propose(self, seqs: list[SequenceState], lengths: list[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """lengths[i] draft tokens for each sequence (one forward per token, over the rows still drafting) and
        the distributions they were drawn from, (lengths[i], V), by each sequence's own sampling parameters
        (empty for a greedy sequence, whose drafts are the draft's argmax).

        Each sequence's pending token (and any token the draft has not seen yet) is fed first.
        """
        proposals: list[list[int]] = [[] for _ in seqs]
        dists: list[list[torch.Tensor]] = [[] for _ in seqs]
        device = self.kv.k[0].device
        for i in range(max(lengths, default=0)):
            rows = [b for b, n in enumerate(lengths) if i < n]
            starts = [seqs[b].draft_computed for b in rows]
            chunks = [(seqs[b].tokens + proposals[b])[start:] for b, start in zip(rows, starts, strict=True)]
            batch = StepBatch.build(chunks, starts, device)
            views = self.kv.step_views([seqs[b].table for b in rows], batch.positions)
            logits = self.runner.logits([seqs[b] for b in rows], batch, views)  # (R, V)
            best = greedy_tokens(logits).tolist() if any(seqs[b].params.greedy for b in rows) else None  # one call
            for j, b in enumerate(rows):
                seq = seqs[b]
                if best is not None and seq.params.greedy:  # a one-hot q: its argmax is all acceptance reads
                    proposals[b].append(best[j])
                else:
                    q = sampling_probs(logits[j], seq.params)
                    proposals[b].append(sample_index(q, seq.generator))
                    dists[b].append(q)
                seq.draft_computed = starts[j] + len(chunks[j])
        return proposals, [torch.stack(d) if d else torch.empty(0) for d in dists]


def check_draft(model: TransformerModel, draft: DecoderLM, max_model_len: int) -> None:
    """A draft must be a decoder-only model on the target's vocabulary that reads the whole context."""
    if not isinstance(model, DecoderLM) or not isinstance(draft, DecoderLM):
        raise ConfigError(
            "speculative decoding in the engine needs a decoder-only target and draft, got "
            f"{type(model).__name__} and {type(draft).__name__}; serve encoder-decoder models without a draft"
        )
    if draft.config.vocab_size != model.config.vocab_size:
        raise ConfigError(
            f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
            f"({model.config.vocab_size}); "
            "pick a draft trained with the same tokenizer"
        )
    if draft.config.max_seq_len < max_model_len:
        raise ConfigError(
            f"the draft reads at most {draft.config.max_seq_len} tokens but the engine serves contexts of "
            f"{max_model_len}; set EngineConfig.max_model_len (--max-model-len) to at most {draft.config.max_seq_len}"
        )
