"""The scheduled messages due in the second being delivered (or before), in memory:
a heap by due time, and the batch taken from it that is being appended."""

from __future__ import annotations

import heapq
import threading

from ._delivery import Due


class DueHeap:
    """Due entries moving from the wheel to the heap, and from the heap to the batch
    being appended (``inflight``). Retention's floor (the store's housekeeping thread)
    reads both under ``lock``, and every move holds it: a pending entry is always in
    the wheel, the heap or the batch."""

    def __init__(self) -> None:
        self.heap: list[Due] = []
        self.inflight: list[Due] = []  # the batch being appended
        # At or below the queue offset of every entry in ``heap`` (None: it is empty);
        # it may lag (lower is safe): a snapshot then needs no walk over the heap.
        self.low: int | None = None
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.heap)

    def clear(self) -> None:
        """Forget the heap (the timer stopped: a start rebuilds it from the log)."""
        self.heap, self.low = [], None

    def push(self, due: Due) -> None:
        heapq.heappush(self.heap, due)
        if self.low is None or due[1] < self.low:
            self.low = due[1]

    def head_ms(self) -> int | None:
        """The earliest due time in the heap (None: empty)."""
        return self.heap[0][0] if self.heap else None

    def take(self, now: int, limit: int) -> list[Due]:
        """Up to ``limit`` entries due at ``now``, in due order: the batch in flight."""
        batch: list[Due] = []
        with self.lock:
            while self.heap and self.heap[0][0] <= now and len(batch) < limit:
                batch.append(heapq.heappop(self.heap))
            self.inflight = batch
            if not self.heap:
                self.low = None
        return batch

    def put_back(self, batch: list[Due]) -> None:
        """The batch was not stored: due again, tried at the next tick."""
        with self.lock:
            for due in batch:
                self.push(due)
            self.inflight = []

    def held_low(self) -> int | None:
        """The lowest queue offset in the heap and the batch (under ``lock``)."""
        return min((d[1] for d in self.heap + self.inflight), default=None)

    def heads_ms(self) -> list[int]:
        """The earliest due times of the heap and of the batch in flight."""
        return [d[0] for d in self.heap[:1] + self.inflight[:1]]
