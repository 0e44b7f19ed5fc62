"""What a pop takes, pure selection over the state and what the queues hold: first
deliveries visible again, then new offsets, spread over the queues that have messages
(each queue an equal share, what one cannot use going to the others), starting at a
queue that turns with every pop of the group (a backlog in one queue does not starve
the others)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ._inflight import Flight, QueueFlights
from ._reads import Fresh


@dataclass
class Ask:
    """One pop as asked (checked and clamped)."""

    group: str
    client_id: str
    topic: str
    queue_ids: list[int]
    limit: int
    invisible_time_ms: int
    tags: list[str] | None = None
    orderly: bool = False
    max_bytes: int | None = None
    start_from: str = "earliest"
    max_reconsume_times: int = 16


@dataclass
class Taken:
    """One queue's part of a pop: offsets reserved (in order), their attempts, where
    the records are, and the deliveries they replace (None: a new offset)."""

    queue_id: int
    queue: QueueFlights
    offsets: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    where: list[tuple[int, int]] = field(default_factory=list)  # (commit-log offset, size)
    before: list[Flight | None] = field(default_factory=list)
    placed: list[Flight] = field(default_factory=list)  # the flights this pop put (identity: still ours?)
    advanced: tuple[int, int] | None = None  # (next offset before, after) when this pop moved it

    def reserve(self, offset: int, flight: Flight, before: Flight | None, attempt: int) -> None:
        """Put ``flight`` (this pop's delivery of ``offset``) in the queue's state."""
        self.offsets.append(offset)
        self.attempts.append(attempt)
        self.before.append(before)
        self.placed.append(flight)
        self.queue.put(offset, flight)


def rotated(queue_ids: Sequence[int], turn: int) -> list[int]:
    """``queue_ids`` starting at the ``turn``-th (modulo their count)."""
    if not queue_ids:
        return []
    k = turn % len(queue_ids)
    return [*queue_ids[k:], *queue_ids[:k]]


def share(limit: int, count: int) -> int:
    """Each of ``count`` queues' first share of ``limit`` messages."""
    return max(1, -(-limit // max(1, count)))


def fresh_after(fresh: Fresh, next_offset: int) -> Fresh:
    """``fresh`` read from an older next offset, without what another pop took since."""
    if next_offset <= fresh.start:
        return fresh
    keep = [i for i, o in enumerate(fresh.offsets) if o >= next_offset]
    return Fresh(
        next_offset,
        [fresh.offsets[i] for i in keep],
        [fresh.commitlog[i] for i in keep],
        [fresh.sizes[i] for i in keep],
        max(fresh.end, next_offset),
    )


def allocate(available: dict[int, int], order: Sequence[int], budget: int) -> dict[int, int]:
    """How many of each queue's ``available`` offsets to take within ``budget``: equal
    shares first, what a queue cannot use to the others, in ``order``."""
    alloc = dict.fromkeys(order, 0)
    while budget > 0:
        live = [q for q in order if alloc[q] < available.get(q, 0)]
        if not live:
            break
        each = max(1, budget // len(live))
        for q in live:
            n = min(each, available[q] - alloc[q], budget)
            alloc[q] += n
            budget -= n
            if budget <= 0:
                break
    return alloc


def within_bytes(
    fresh: dict[int, Fresh], alloc: dict[int, int], order: Sequence[int], max_bytes: int, used: int
) -> None:
    """Cut ``alloc`` so that the records taken stay within ``max_bytes`` (``used`` by
    deliveries already taken); the first record always goes."""
    total, first = used, used == 0
    for qid in order:
        n = alloc.get(qid, 0)
        for i in range(n):
            size = fresh[qid].sizes[i]
            if total + size > max_bytes and not first:
                alloc[qid] = i
                for rest in order[order.index(qid) + 1 :]:
                    alloc[rest] = 0
                return
            total, first = total + size, False


def next_after(fresh: Fresh, taken: int) -> int:
    """The queue's next offset once ``taken`` of ``fresh``'s offsets are taken: past
    them and past the entries skipped before the first not taken."""
    return fresh.offsets[taken] if taken < len(fresh.offsets) else fresh.end
