"""Server metrics in the Prometheus text format (version 0.0.4), with no client library.

Counters and histograms are updated from the server's event loop only, so they need no lock. The engine's
gauges (queue depth, running requests, KV blocks) come from the snapshot its thread publishes.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from tformer.engine.async_engine import EngineStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    pairs += [extra] if extra else []
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Counter:
    """A monotonically increasing count per label combination."""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, labels
        self.values: dict[tuple[str, ...], float] = defaultdict(float)

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self.values[labels] += amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        values = self.values or ({(): 0.0} if not self.label_names else {})
        return lines + [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in sorted(values.items())]


class Histogram:
    """Observations counted into cumulative `le` buckets, with their sum and count, per label combination."""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = (), buckets=LATENCY_BUCKETS) -> None:
        self.name, self.help, self.label_names = name, help_text, labels
        self.buckets = tuple(buckets)
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = defaultdict(float)

    def observe(self, value: float, *labels: str) -> None:
        counts = self.counts.setdefault(labels, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1  # the last slot is +Inf
        self.sums[labels] += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, counts in sorted(self.counts.items()):
            total = 0
            for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                total += count
                le = 'le="+Inf"' if bound == float("inf") else f'le="{_number(bound)}"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {total}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(self.sums[key])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {total}")
        return lines


class Metrics:
    """Everything /metrics reports: request counts, token counts, latencies and the engine's gauges."""

    def __init__(self) -> None:
        self.requests = Counter(
            "tformer_requests_total", "HTTP requests by endpoint and status", ("endpoint", "status")
        )
        self.prompt_tokens = Counter("tformer_prompt_tokens_total", "Prompt tokens of accepted requests")
        self.generation_tokens = Counter("tformer_generation_tokens_total", "Tokens generated")
        self.latency = Histogram(
            "tformer_request_latency_seconds", "Time from receiving a request to its last token", ("endpoint",)
        )
        self.ttft = Histogram(
            "tformer_time_to_first_token_seconds", "Time from receiving a request to its first token", ("endpoint",)
        )

    def render(self, stats: EngineStats, cancelled: int) -> str:
        """The text /metrics serves; `cancelled` counts requests aborted before they finished."""
        gauges = {
            "tformer_requests_waiting": ("Requests queued for the engine (queue depth)", stats.waiting),
            "tformer_requests_running": ("Requests the engine is running", stats.running),
            "tformer_kv_blocks_in_use": ("KV-cache blocks held by live requests", stats.blocks_in_use),
            "tformer_kv_blocks_total": ("KV-cache blocks in the pool", stats.blocks_total),
        }
        lines = []
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        counters = {
            "tformer_preemptions_total": ("Requests preempted for lack of KV blocks", stats.preemptions),
            "tformer_requests_aborted_total": (
                "Requests cancelled before finishing (client gone, or shutdown)",
                cancelled,
            ),
            "tformer_spec_decode_draft_tokens_total": (
                "Draft tokens proposed (speculative decoding)",
                stats.draft_tokens,
            ),
            "tformer_spec_decode_accepted_tokens_total": (
                "Draft tokens the target accepted (speculative decoding)",
                stats.accepted_draft_tokens,
            ),
        }
        for name, (help_text, value) in counters.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens, self.latency, self.ttft):
            lines += metric.render()
        return "\n".join(lines) + "\n"
