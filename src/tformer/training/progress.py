"""How training shows its progress: a live tqdm bar on a terminal, plain log lines anywhere else.

A bar redrawn with carriage returns suits a terminal; in a file or a CI log it becomes one line of tens of
kilobytes. When standard error is not a terminal, the bar is off and every `log_every` steps one line is
printed instead.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """The training loop's progress display, shown only on the rank that logs (`enabled`)."""

    def __init__(self, enabled: bool, total_steps: int | None, done_steps: int) -> None:
        self.enabled = enabled
        self.plain = not sys.stderr.isatty()
        self.bar = tqdm(
            total=total_steps, initial=done_steps, desc="train", dynamic_ncols=True, disable=not enabled or self.plain
        )

    def advance(self) -> None:
        """One optimizer step done."""
        self.bar.update(1)

    def report(self, step: int, loss: float, lr: float, tokens_per_s: float, seconds_left: float | None) -> None:
        """The figures of the last `log_every` steps: in the bar's postfix, or as one printed line."""
        left = {} if seconds_left is None else {"left": f"{seconds_left / 60:.0f}min"}
        self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}", **left)
        if self.enabled and self.plain:
            until = "" if seconds_left is None else f", {seconds_left / 60:.1f} min left"
            print(f"step {step}: loss {loss:.3f}, lr {lr:.2e}, {tokens_per_s:,.0f} target tok/s{until}", flush=True)

    def write(self, line: str) -> None:
        """A line printed above the bar (or plainly), e.g. an evaluation's result."""
        if self.enabled:
            tqdm.write(line)

    def close(self) -> None:
        self.bar.close()
