"""Messages and bytes in and out per topic, counted on the request path with a few
integer adds, and the rates they make."""

from __future__ import annotations

import collections
import time

RATE_WINDOW_S = 10.0  # rates in BROKER_INFO: over about this long


class TopicTraffic:
    """Messages and bytes in (stored) and out (served to readers) per topic."""

    def __init__(self) -> None:
        self.by_topic: dict[str, list[int]] = {}  # topic -> [messages in, bytes in, messages out, bytes out]
        self.totals = [0, 0, 0, 0]
        self._samples: collections.deque[tuple[float, list[int]]] = collections.deque()

    def _row(self, topic: str) -> list[int]:
        row = self.by_topic.get(topic)
        if row is None:
            row = self.by_topic[topic] = [0, 0, 0, 0]
        return row

    def add_in(self, topic: str, messages: int, nbytes: int) -> None:
        """Stored: counted once per produce request (the row looked up inline, no call)."""
        row, totals = self.by_topic.get(topic) or self._row(topic), self.totals
        row[0] += messages
        row[1] += nbytes
        totals[0] += messages
        totals[1] += nbytes

    def add_out(self, topic: str, messages: int, nbytes: int) -> None:
        row, totals = self._row(topic), self.totals
        row[2] += messages
        row[3] += nbytes
        totals[2] += messages
        totals[3] += nbytes

    def rates(self, now: float | None = None) -> dict[str, float]:
        """Per second over about the last RATE_WINDOW_S (samples kept as asked: the
        broker's housekeeping asks every second)."""
        now = time.monotonic() if now is None else now
        samples = self._samples
        samples.append((now, list(self.totals)))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        then, old = samples[0]
        span = now - then
        names = ("messages_in_per_s", "bytes_in_per_s", "messages_out_per_s", "bytes_out_per_s")
        return {
            n: round((new - before) / span, 1) if span > 0 else 0.0 for n, new, before in zip(names, self.totals, old)
        }
