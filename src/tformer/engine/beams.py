"""Beam search inside the engine: an encoder-decoder's beam requests go to the offline search, batched
(`SourceBeams`); a decoder's K beams are K sequences that share KV blocks (`BeamGroup`).

`SourceBeams` holds an encoder-decoder's beam requests until the engine's next step, then searches a batch of them
(the oldest and up to `BATCH` - 1 of similar lengths) with `decoding.search.beam_search`, the search
of `tformer translate` and `eval`: one encoder pass for the batch, cross-attention keys once per source, beams that
continue their own cache row. The engine's paged path would run every beam as a sequence of its own, with its cross
keys gathered every step, at a fraction of that speed; the results are the same hypotheses.

`search.Beams` keeps the books (scores, finished hypotheses, when to stop), exactly as the offline beam search
does; `BeamGroup` maps its rows to engine sequences. Every live beam's next-token log-probabilities are
collected as its step completes; once all live beams of the request have theirs, `Beams.advance` picks the
next beams, and each new beam starts as a fork of its parent's block table: the blocks are shared, and the
first write into a shared block copies it (the scheduler's copy-on-write). A new beam also inherits the
prefix-cache keys of its parent's published blocks, so the step keys only a block that has just filled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tformer.decoding.search import Beams, beam_search
from tformer.engine.blocks import BlockAllocator
from tformer.engine.scheduler import SequenceState
from tformer.models import EncoderDecoder, TransformerModel

BATCH = 32  # sources a step searches together: `translate_ids`' batch


@dataclass
class SourceBeam:
    """One encoder-decoder beam request waiting for its search."""

    request_id: str
    source: list[int]
    bos_id: int
    eos_id: int  # -1: none (ignore_eos)
    limit: int  # the most tokens it may generate (max_tokens)
    beam_width: int
    alpha: float


class SourceBeams:
    """An encoder-decoder's beam requests, searched a batch per engine step by the offline beam search."""

    def __init__(self, model: EncoderDecoder) -> None:
        self.model = model
        self.pending: dict[str, SourceBeam] = {}

    @classmethod
    def of(cls, model: TransformerModel) -> SourceBeams | None:
        """The model's `SourceBeams` if it is an encoder-decoder (the offline search's model), else None."""
        return cls(model) if isinstance(model, EncoderDecoder) else None

    def add(self, seq: SequenceState, eos_id: int) -> None:
        """Queues the request of `seq` (its first sequence: the source, and <s> as its decoder prompt)."""
        params = seq.params
        assert seq.source is not None
        self.pending[seq.request_id] = SourceBeam(
            seq.request_id,
            list(seq.source),
            seq.prompt[0],
            eos_id,
            params.max_tokens,
            params.beam_width,
            params.length_penalty,
        )

    def discard(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.pending)

    def run(self) -> list[tuple[str, list[int], bool]]:
        """Searches one batch of the waiting requests: the oldest, and up to `BATCH` - 1 others of its search settings
        whose sources are closest to its length (less padding, as `translate_ids` sorts by length; the oldest is
        always served, so none waits forever). Returns (request id, best hypothesis with </s> if it ended, whether
        it ended)."""
        first = next(iter(self.pending.values()))
        key = (first.bos_id, first.eos_id, first.beam_width, first.alpha)
        alike = [r for r in self.pending.values() if (r.bos_id, r.eos_id, r.beam_width, r.alpha) == key]
        batch = sorted(alike, key=lambda r: abs(len(r.source) - len(first.source)))[:BATCH]
        batch.sort(key=lambda r: len(r.source))
        for request in batch:
            del self.pending[request.request_id]
        device = next(self.model.parameters()).device
        width = max(len(r.source) for r in batch)
        src = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        src_mask = torch.zeros_like(src)
        for row, request in enumerate(batch):
            src[row, : len(request.source)] = torch.tensor(request.source)
            src_mask[row, : len(request.source)] = 1
        limits = [r.limit for r in batch]
        best = beam_search(self.model, src, src_mask, limits, first.bos_id, first.eos_id, first.beam_width, first.alpha)
        results = []
        for request, tokens in zip(batch, best, strict=True):
            ended = len(tokens) < request.limit  # as BeamGroup.result: a hypothesis cut by the limit has `limit`
            results.append((request.request_id, tokens + [request.eos_id] * ended, ended))
        return results


class BeamGroup:
    """The beams of one request: `Beams` for one row of `beam_width`, and the sequence of each live beam."""

    def __init__(self, first: SequenceState, eos_id: int) -> None:
        params = first.params
        self.limit = params.max_tokens
        self.beams = Beams.start([self.limit], params.beam_width, params.length_penalty, eos_id, torch.device("cpu"))
        self.members: list[SequenceState | None] = [first] + [None] * (params.beam_width - 1)  # None: a dead beam
        self.log_probs: dict[int, torch.Tensor] = {}

    @property
    def live(self) -> list[SequenceState]:
        return [member for member in self.members if member is not None]

    def record(self, seq: SequenceState, logits: torch.Tensor) -> bool:
        """Keeps a beam's next-token log-probabilities (V,); True once every live beam has given them."""
        self.log_probs[self.members.index(seq)] = torch.log_softmax(logits.float(), -1)
        return len(self.log_probs) == len(self.live)

    def advance(self, allocator: BlockAllocator) -> list[SequenceState] | None:
        """The next beams, forked from their parents (the caller frees the old ones), or None when done."""
        vocab = next(iter(self.log_probs.values())).shape[0]
        rows = torch.stack([self.log_probs.get(k, torch.zeros(vocab)) for k in range(len(self.members))])
        self.log_probs.clear()
        parents = self.beams.advance(rows)  # a dead row's score is -inf, so its zeros never win
        if parents is None:
            return None
        members: list[SequenceState | None] = []
        for k, parent_row in enumerate(parents.tolist()):
            if self.beams.scores[0, k] == float("-inf"):
                members.append(None)
                continue
            parent = self.members[parent_row]
            members.append(parent.fork(allocator, output=self.beams.tokens[k].tolist()))
        self.members = members
        return self.live

    def result(self) -> tuple[list[int], bool]:
        """The best hypothesis, with its end-of-sequence token if it has one, and whether it has one.

        A hypothesis cut by the limit has exactly `limit` tokens; one that ended earlier ended with </s>.
        """
        best = self.beams.best()[0]
        ended = len(best) < self.limit
        return best + [self.beams.eos_id] * ended, ended
