"""How benchmarks/translation_vs_marian.py runs its two sides: train, the steps of both models alternating on the
same batches until each has spent its budget; Pauser, which waits outside the timed steps while other processes
are busy; and decode, greedy translations of the test sentences by both, batch by batch in alternation."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from common import busy_processes, wait_for_idle
from marian_side import MAX_POSITIONS, BatchStream, Side, mean_loss
from torch import nn

from tformer.data import Tokenizer
from tformer.decoding import translate_ids

EXTRA_LEN, DECODE_BATCH = 50, 32  # translate_ids' defaults: at most len(source) + 50 tokens, 32 sentences a batch


class Pauser:
    """Waits (outside every timed step) while other processes use a CPU, up to `allowance` seconds in all.

    On 2 cores, a competitor that takes one core stalls each of torch's parallel regions, and steps get up to
    10x slower; pausing keeps such stretches out of the numbers instead of hoping they hit both sides alike.
    """

    def __init__(self, allowance: float) -> None:
        self.allowance, self.left, self.paused, self.count, self.seen = allowance, allowance, 0.0, 0, set()

    def __call__(self) -> None:
        if self.left <= 0:
            return
        busy = busy_processes(0.3, 0.5)
        if busy == "none":
            return
        self.seen.add(busy.split(" (pid")[0])
        waited, _ = wait_for_idle(self.left)
        self.left -= waited
        self.paused += waited
        self.count += 1

    def summary(self) -> str:
        return f"paused {self.count} times, {self.paused:.0f}s in all, for: {', '.join(sorted(self.seen)) or '-'}" + (
            "; pause allowance used up" if self.left <= 0 < self.allowance else ""
        )


def train(sides: Sequence[Side], batches: BatchStream, budget: float, log_every: int, pause: Pauser) -> int:
    """Alternates the sides step by step on the same batches until each has spent `budget` seconds.

    Returns the number of rounds in which every side stepped (the paired steps).
    """
    paired, r = 0, 0
    while True:
        active = [s for s in sides if s.elapsed < budget]
        if not active:
            return paired
        if r % 10 == 0:
            pause()
        batch = batches[r]
        for side in active if r % 2 == 0 else active[::-1]:
            side.step(batch)
        paired += len(active) == len(sides)
        r += 1
        if r % log_every == 0:
            window = slice(-log_every, None)
            progress = (
                f"{s.name} {len(s.times)} steps {s.elapsed:.0f}s loss {mean_loss(s, window):.3f}" for s in sides
            )
            print(f"  round {r}: " + "; ".join(progress), flush=True)


# ---- decoding -------------------------------------------------------------------------------------------
@torch.no_grad()
def marian_translate_ids(model: nn.Module, sources: Sequence[Sequence[int]], tokenizer: Tokenizer) -> list[list[int]]:
    """Greedy decoding of one batch with generate(), with translate_ids' source format and length limit."""
    model.eval()
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    rows = [[*s, eos] for s in sources]
    width = max(len(r) for r in rows)
    src = torch.full((len(rows), width), pad, dtype=torch.long)
    for j, row in enumerate(rows):
        src[j, : len(row)] = torch.tensor(row)
    max_len = min(width + EXTRA_LEN, MAX_POSITIONS)
    out = model.generate(
        input_ids=src, attention_mask=(src != pad).long(), max_new_tokens=max_len, do_sample=False, num_beams=1
    )
    ids = out[:, 1:].tolist()  # without the decoder start token <s>
    return [row[: row.index(eos)] if eos in row else row for row in ids]


def tformer_translate_ids(model: nn.Module, sources: Sequence[Sequence[int]], tokenizer: Tokenizer) -> list[list[int]]:
    return translate_ids(
        model,
        sources,
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.pad_id,
        beam_size=1,
        batch_size=DECODE_BATCH,
        extra_len=EXTRA_LEN,
    )


def decode(
    sides: Sequence[Side],
    translators: dict[str, Callable],
    tokenizer: Tokenizer,
    sources: list[str],
    pause: Callable[[], None],
) -> None:
    """Greedy translations of `sources` by every side, batch by batch (sorted by length), in alternation."""
    encoded = tokenizer.encode_batch(sources)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    outputs: dict[str, list[list[int]]] = {s.name: [[] for _ in encoded] for s in sides}
    for k, start in enumerate(range(0, len(order), DECODE_BATCH)):
        chunk = order[start : start + DECODE_BATCH]
        pause()
        for side in sides if k % 2 == 0 else sides[::-1]:
            began = time.perf_counter()
            ids = translators[side.name](side.model, [encoded[i] for i in chunk], tokenizer)
            side.decode_seconds += time.perf_counter() - began
            side.decode_tokens += sum(len(row) for row in ids)
            for i, row in zip(chunk, ids, strict=True):
                outputs[side.name][i] = row
    for side in sides:
        side.hypotheses = tokenizer.decode_batch(outputs[side.name])
