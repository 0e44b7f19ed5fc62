"""The queues whose small in-memory tails wait for a later flush, and the oldest of them.

Why: with traffic spread over 65,536 queues of a few entries each, every queue's tail
stays under ``cq_flush_min_bytes`` until the full flush. Walking all of them every
second to find the oldest entry only memory holds cost the checkpoint a scan of every
loaded queue. Here a queue is looked at when it is added (it was appended to since the
last flush) and the oldest is kept in a heap, so a checkpoint pays for the queues
that changed, not for those that wait.

Invariant: for every queue held, the heap has an item with the commit-log offset of
its oldest pending entry as last looked at. Outside :meth:`WaitingTails.add` a tail
can only lose entries (a flush, a truncation, a reset: its oldest rises or goes) or
gain them by an append, after which the queue is in the set's dirty set and added
again by the next flush. So the heap's top is checked against the queue itself before
it is believed (lazy deletion), and :meth:`WaitingTails.oldest` covers every entry
that was appended before the flush took the dirty set, as the walk it replaces did.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, Protocol, TypeVar


class _Tail(Protocol):
    def oldest_pending(self) -> int | None: ...


T = TypeVar("T", bound=_Tail)


class WaitingTails(Generic[T]):
    """Queues with unwritten entries that wait for a later flush (not thread-safe:
    the caller serialises flushes)."""

    def __init__(self) -> None:
        self._oldest: dict[T, int | None] = {}  # queue -> oldest pending offset, as last looked at
        self._heap: list[tuple[int, int, T]] = []  # (offset, tie-breaker, queue)
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._oldest)

    def __contains__(self, queue: object) -> bool:
        return queue in self._oldest

    def add(self, queue: T) -> None:
        """Hold ``queue`` (again): it was appended to, so its oldest entry is looked up now."""
        oldest = queue.oldest_pending()
        if queue in self._oldest and self._oldest[queue] == oldest:
            return
        self._oldest[queue] = oldest
        if oldest is not None:
            heapq.heappush(self._heap, (oldest, next(self._tie), queue))

    def discard(self, queue: T) -> None:
        """``queue`` was flushed (its heap item goes when it reaches the top)."""
        self._oldest.pop(queue, None)

    def take_all(self) -> list[T]:
        """Every queue held, which are then held no more (a full flush writes them)."""
        queues = list(self._oldest)
        self._oldest.clear()
        self._heap.clear()
        return queues

    def oldest(self) -> int | None:
        """The commit-log offset of the oldest entry any held queue has only in memory."""
        heap = self._heap
        while heap:
            offset, _tie, queue = heap[0]
            if queue in self._oldest and self._oldest[queue] == offset:
                now = queue.oldest_pending()
                if now == offset:
                    return offset
                self._oldest[queue] = now  # lost entries outside add(): look again
                heapq.heapreplace(heap, (now, next(self._tie), queue)) if now is not None else heapq.heappop(heap)
            else:
                heapq.heappop(heap)  # flushed, or superseded by a newer item
        return None
