"""Durations the log measures for whoever watches it (the broker's metrics): a plain
histogram, no metrics library here (storage code stays plain Python)."""

from __future__ import annotations

import bisect
import threading

# Upper bounds of the buckets, in seconds: fsyncs take from tens of microseconds (a
# quiet SSD) to seconds (a stalled disk).
FSYNC_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Timings:
    """A count, a sum and per-bucket counts (``buckets[i]``: durations up to
    ``FSYNC_BUCKETS_S[i]``, not cumulative; the last: slower than every bound)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the flush thread records, the event loop reads
        self.count = 0
        self.seconds_sum = 0.0
        self.buckets = [0] * (len(FSYNC_BUCKETS_S) + 1)

    def record(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            self.seconds_sum += seconds
            self.buckets[bisect.bisect_left(FSYNC_BUCKETS_S, seconds)] += 1

    def snapshot(self) -> tuple[int, float, list[int]]:
        """(count, sum of seconds, per-bucket counts), consistent with each other."""
        with self._lock:
            return self.count, self.seconds_sum, list(self.buckets)
