"""Beam search inside the engine: the K beams of one request are K sequences that share KV blocks.

`search.Beams` keeps the books (scores, finished hypotheses, when to stop), exactly as the offline beam search
does; `BeamGroup` maps its rows to engine sequences. Every live beam's next-token log-probabilities are
collected as its step completes; once all live beams of the request have theirs, `Beams.advance` picks the
next beams, and each new beam starts as a fork of its parent's block table: the blocks are shared, and the
first write into a shared block copies it (the scheduler's copy-on-write). A new beam also inherits the
prefix-cache keys of its parent's published blocks, so the step keys only a block that has just filled.
"""

from __future__ import annotations

import torch

from tformer.decoding.search import Beams
from tformer.engine.blocks import BlockAllocator
from tformer.engine.scheduler import SequenceState


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
