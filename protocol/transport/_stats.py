"""Per request code: how many requests a server answered, how many with an error, and
how long they took (a histogram), counted with integer adds on the request path and
read by the metrics collector when scraped."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from clmq.common import DURATION_BUCKETS_S

LATENCY_BUCKETS_S = DURATION_BUCKETS_S  # clmq.common's histogram bounds


@dataclass
class CodeStats:
    """One request code's counts; ``buckets[i]`` counts latencies up to
    ``LATENCY_BUCKETS_S[i]`` (not cumulative), the last one everything slower."""

    requests: int = 0
    errors: int = 0
    seconds_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))


class RequestStats:
    """Every request code's :class:`CodeStats` (the event loop's thread only)."""

    def __init__(self) -> None:
        self.by_code: dict[int, CodeStats] = {}

    def record(self, code: int, seconds: float, error: bool) -> None:
        stats = self.by_code.get(code)
        if stats is None:
            stats = self.by_code[code] = CodeStats()
        stats.requests += 1
        stats.errors += error
        stats.seconds_sum += seconds
        stats.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1

    def histogram_rows(self) -> list[tuple[int, CodeStats, list[tuple[str, float]]]]:
        """Per code (sorted): its stats and its cumulative buckets as Prometheus wants
        them (``[("0.0001", n), ..., ("+Inf", total)]``)."""
        return [
            (code, st, cumulative_buckets(LATENCY_BUCKETS_S, st.buckets)) for code, st in sorted(self.by_code.items())
        ]


def cumulative_buckets(bounds: tuple[float, ...], buckets: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last: above every bound) -> Prometheus' cumulative
    ``[(upper bound, count at or below), ..., ("+Inf", total)]``."""
    out: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip(bounds, buckets):
        running += n
        out.append((repr(bound), running))
    out.append(("+Inf", running + buckets[-1]))
    return out
