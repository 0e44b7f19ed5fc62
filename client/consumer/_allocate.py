"""RocketMQ's "allocate averagely": every member of a group computes the same split
of the sorted queues over the sorted members, with no coordinator."""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def allocate_averagely(queues: Sequence[T], members: Sequence[str], me: str) -> list[T]:
    """The contiguous share of ``queues`` (already sorted) for ``me`` among ``members``:
    the first ``len(queues) % len(members)`` members get one extra queue."""
    ordered = sorted(members)
    if me not in ordered or not queues:
        return []
    index, n, count = ordered.index(me), len(ordered), len(queues)
    base, extra = divmod(count, n)
    start = index * base + min(index, extra)
    size = base + (1 if index < extra else 0)
    return list(queues[start : start + size])
