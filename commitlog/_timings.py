"""Durations the log measures for whoever watches it (the broker's metrics): a plain
histogram, no metrics library here (storage code stays plain Python)."""

from __future__ import annotations

import bisect
import threading

from clmq.common import DURATION_BUCKETS_S

FSYNC_BUCKETS_S = DURATION_BUCKETS_S  # clmq.common's histogram bounds


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
