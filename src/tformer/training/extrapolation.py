"""Length extrapolation: packed training text, sliding-window perplexity (Press et al.) and passkey retrieval.

A model trained on sequences of L tokens is scored on held-out text at context lengths N = L, 2L, ... 32L.
`sliding_window_nll` is the ALiBi paper's sliding-window evaluation: windows of N positions slide over one
long token stream by `stride` tokens and only the last `stride` predictions of each window are scored, so
every scored token is predicted with at least N - stride tokens of left context. Each window starts with bos
(as every training example does), followed by N - 1 text tokens; its N predictions are of the N text tokens
after bos. The same target tokens are scored at every N when `start` >= the longest N - stride.

`passkey_example` builds the passkey test (Mohtashami & Jaggi, 2023): a 5-digit key hidden at a given depth in
repeated filler, then the question; `passkey_scores` says whether greedy decoding would return the key, and
how many of its digits the model predicts after the true prefix (a model that ignores the needle: at most one in ten).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tformer.data import Tokenizer
from tformer.models import TransformerModel

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def pack_texts(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Groups consecutive texts, in order, into runs whose token counts sum to at most `max_tokens`.

    Returns the indices of each group. A text longer than `max_tokens` on its own is left out, and ends the
    group before it (a group is always contiguous text)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and (n > max_tokens or used + n > max_tokens):
            groups.append(current)
            current, used = [], 0
        if n > max_tokens:
            continue
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def pack_lines(tokenizer: Tokenizer, texts: Sequence[str], max_tokens: int) -> list[str]:
    """Consecutive texts joined by spaces into lines of at most `max_tokens` tokens each (no bos, no eos).

    Lines are checked against the tokenizer once joined: one that encodes longer than its parts (a merge
    across the joining space) is split back into its parts' groups of one."""
    lengths = [len(ids) for ids in tokenizer.encode_batch(list(texts), add_bos=False)]
    lines = [" ".join(texts[i] for i in group) for group in pack_texts(lengths, max_tokens)]
    encoded = tokenizer.encode_batch(lines, add_bos=False)
    return [line for line, ids in zip(lines, encoded, strict=True) if len(ids) <= max_tokens]


@dataclass(frozen=True)
class Window:
    """One model input, bos + stream[first : end - 1], whose predictions of stream[first : end] are those of
    targets first, ..., end - 1; the targets [score_from, end) are scored."""

    first: int
    score_from: int
    end: int


def plan_windows(start: int, count: int, window: int, stride: int) -> list[Window]:
    """The windows that score targets [start, start + count), each from the last `stride` predictions of a
    window of `window` positions (fewer when the stream starts later than that)."""
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be between 1 and the window ({window}), got {stride}")
    windows = []
    for lo in range(start, start + count, stride):
        hi = min(lo + stride, start + count)  # targets [lo, hi)
        first = max(0, hi - window)
        windows.append(Window(first, lo, hi))
    return windows


@torch.no_grad()
def sliding_window_nll(
    model: TransformerModel,
    ids: Sequence[int],
    *,
    window: int,
    stride: int,
    bos_id: int,
    start: int = 0,
    count: int | None = None,
    batch_size: int = 8,
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of targets ids[start : start + count] and how many there are.

    Each target is predicted inside a window of `window` positions: bos, then the text tokens before it; the
    windows move by `stride` and score only their last `stride` predictions (Press et al., 2022)."""
    count = len(ids) - start if count is None else count
    if start < 0 or count < 1 or start + count > len(ids):
        raise ValueError(f"targets [{start}, {start + count}) are not inside the stream of {len(ids)} tokens")
    model.eval()
    stream = torch.as_tensor(list(ids), dtype=torch.long)
    device = next(model.parameters()).device
    total, scored = 0.0, 0
    plan = plan_windows(start, count, window, stride)
    for group in _same_length_batches(plan, batch_size):
        inputs = torch.stack([_window_input(stream, w, bos_id) for w in group]).to(device)  # (B, n)
        logprobs = torch.log_softmax(model(inputs).float(), dim=-1)  # (B, n, V)
        for row, w in enumerate(group):
            positions = torch.arange(w.score_from - w.first, w.end - w.first)
            targets = stream[w.score_from : w.end].to(device)
            total -= logprobs[row, positions.to(device), targets].sum().item()
            scored += len(targets)
    return total, scored


def sliding_window_perplexity(model: TransformerModel, ids: Sequence[int], **kwargs) -> float:
    """exp(mean negative log-likelihood) of `sliding_window_nll` (same keyword arguments)."""
    total, scored = sliding_window_nll(model, ids, **kwargs)
    return math.exp(total / scored)


def _window_input(stream: torch.Tensor, w: Window, bos_id: int) -> torch.Tensor:
    return torch.cat([torch.tensor([bos_id]), stream[w.first : w.end - 1]])  # (end - first,)


def _same_length_batches(plan: list[Window], batch_size: int) -> list[list[Window]]:
    batches: list[list[Window]] = []
    for w in plan:
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and last[0].end - last[0].first == w.end - w.first:
            last.append(w)
        else:
            batches.append([w])
    return batches


@dataclass
class PasskeyExample:
    """A passkey prompt (bos first), the key's answer tokens and which of them are single digits."""

    prompt: list[int]
    answer: list[int]
    digits: list[bool]  # per answer token: is it one digit (scored by digit accuracy, at most 1/10 by chance)
    depth: float  # where the needle sits, as a fraction of the filler before it
    digit_ids: list[int] | None = None  # the ten single-digit tokens, 0-9, when the vocabulary has them all


def passkey_example(tokenizer: Tokenizer, n_tokens: int, depth: float, rng: random.Random) -> PasskeyExample:
    """The longest passkey prompt whose prompt plus answer fit in `n_tokens`, with a random 5-digit key placed
    after round(depth * repeats) of its filler repeats."""
    key = rng.randrange(10_000, 100_000)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False)

    intro, filler, question = encode(PASSKEY_INTRO), encode(PASSKEY_FILLER), encode(PASSKEY_QUESTION)
    needle, answer = encode(PASSKEY_NEEDLE.format(key=key)), encode(str(key))
    fixed = 1 + len(intro) + len(needle) + len(question) + len(answer)
    repeats = (n_tokens - fixed) // len(filler)
    if repeats < 0:
        raise ValueError(f"{n_tokens} tokens cannot hold a passkey prompt ({fixed} tokens without filler)")
    before = round(depth * repeats)
    prompt = [tokenizer.bos_id, *intro, *filler * before, *needle, *filler * (repeats - before), *question]
    digits = [len(text := tokenizer.decode([t]).strip()) == 1 and text.isdigit() for t in answer]
    digit_ids = [tokenizer.token_to_id(str(d)) for d in range(10)]
    return PasskeyExample(prompt, answer, digits, depth, None if None in digit_ids else digit_ids)


@torch.no_grad()
def passkey_scores(model: TransformerModel, example: PasskeyExample) -> tuple[bool, int, int]:
    """(greedy decoding returns the key, how many of its digit tokens are the argmax after the true prefix, how
    many are the likeliest of the ten digits there).

    Greedy decoding returns the key exactly when every answer token is the argmax after the true prefix, so one
    teacher-forced pass decides it without generating. The key's digits are uniform and independent, so a model
    that does not read the needle gets each digit right with probability 1/10 if it always predicts a digit,
    and less otherwise; choosing among the ten digits only, it gets exactly 1/10 in expectation, so that score
    shows whether the needle moves the model's choice of digit even when it would rather write a word."""
    model.eval()
    device = next(model.parameters()).device
    inputs = torch.tensor([example.prompt + example.answer[:-1]], device=device)
    at = len(example.prompt) - 1  # the position that predicts the answer's first token
    logits = model(inputs)[0, at:].cpu()  # (len(answer), V)
    answer, digits = torch.tensor(example.answer), torch.tensor(example.digits)
    hits = logits.argmax(-1) == answer
    among_digits = 0
    if example.digit_ids is not None:
        choices = torch.tensor(example.digit_ids)
        among_digits = int((choices[logits[:, choices].argmax(-1)] == answer)[digits].sum())
    return bool(hits.all()), int(hits[digits].sum()), among_digits
