"""Look-ups in one queue's entries, over any way of reading them (``read(offset,
count) -> (first offset, raw entries)``): the entry at an offset, and the first offset
whose entry satisfies a monotone predicate (binary search, holes looked past)."""

from __future__ import annotations

from typing import Callable

from ._entries import ENTRY, ENTRY_SIZE, Entry

ReadEntries = Callable[[int, int], tuple[int, bytes]]


def entry_at(read: ReadEntries, offset: int) -> Entry | None:
    """The entry at ``offset`` (None: not held)."""
    at, data = read(offset, 1)
    if at != offset or len(data) < ENTRY_SIZE:
        return None
    return ENTRY.unpack(data)


def search(read: ReadEntries, lo: int, hi: int, predicate: Callable[[Entry], bool]) -> int:
    """The first offset in ``lo .. hi`` whose entry satisfies ``predicate`` (monotone
    over the queue); holes are looked past to the next real entry. ``hi`` if none."""
    while lo < hi:
        mid = (lo + hi) // 2
        probe = real_entry_at_or_after(read, mid, hi)
        if probe is None or predicate(probe[1]):
            hi = mid
        else:
            lo = probe[0] + 1
    return lo


def real_entry_at_or_after(read: ReadEntries, offset: int, hi: int) -> tuple[int, Entry] | None:
    """The first entry at or after ``offset`` (below ``hi``) that is no hole marker."""
    while offset < hi:
        at, data = read(offset, min(256, hi - offset))
        for i in range(len(data) // ENTRY_SIZE):
            entry = ENTRY.unpack_from(data, i * ENTRY_SIZE)
            if entry[1]:
                return at + i, entry
        offset = at + max(1, len(data) // ENTRY_SIZE)
    return None
