"""Reads POP makes (in worker threads): the next entries of queues, with the tag
filter, and the records of deliveries as stored (spans, for the answer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from clmq.broker.store import GetStatus, Span, Store
from clmq.consumequeue import tag_hash

from ._state import read_entries, real

SCAN_ENTRIES_MIN = 256  # entries looked at per queue per pop at least (with a tag filter: skipped ones)


@dataclass
class Fresh:
    """What a queue holds from ``start``: the offsets worth delivering (tag matched,
    not holes) with their commit-log offsets and sizes, and the offset after the last
    entry looked at."""

    start: int
    offsets: list[int]
    commitlog: list[int]
    sizes: list[int]
    end: int


def tag_codes(tags: Sequence[str] | None) -> np.ndarray | None:
    """The entries' tag codes a filter accepts (None: every tag)."""
    if tags is None or "*" in tags:
        return None
    return np.array([tag_hash(t) for t in tags], dtype=np.uint64)


def read_fresh(store: Store, topic: str, asks: Sequence[tuple[int, int, int]], codes: np.ndarray | None) -> list[Fresh]:
    """For each ``(queue_id, start, wanted)``: up to ``wanted`` deliverable entries."""
    out = []
    for qid, start, wanted in asks:
        scan = wanted if codes is None else max(wanted, SCAN_ENTRIES_MIN)
        first, entries = read_entries(store, topic, qid, start, scan)
        first = max(first, start)
        mask = real(entries)
        if codes is not None:
            mask &= np.isin(entries["tag"], codes)
        idx = np.flatnonzero(mask)[:wanted]
        end = first + (int(idx[-1]) + 1 if len(idx) == wanted and wanted else len(entries))
        out.append(
            Fresh(
                start,
                (idx + first).tolist(),
                entries["offset"][idx].tolist(),
                entries["size"][idx].tolist(),
                end,
            )
        )
    return out


def entry_of(store: Store, topic: str, qid: int, offset: int) -> tuple[int, int] | None:
    """(commit-log offset, size) of a queue's entry; None: gone (retention)."""
    first, entries = read_entries(store, topic, qid, offset, 1)
    if first != offset or not len(entries) or not real(entries)[0]:
        return None
    return int(entries["offset"][0]), int(entries["size"][0])


def read_spans(store: Store, topic: str, qid: int, offsets: Sequence[int]) -> list[list[Span] | None]:
    """The stored bytes of each record at these queue offsets (ascending), read per
    run of consecutive offsets; None for one that cannot be read (retention, damage)."""
    out: list[list[Span] | None] = []
    i = 0
    while i < len(offsets):
        j = i + 1
        while j < len(offsets) and offsets[j] == offsets[j - 1] + 1:
            j += 1
        res = store.read_raw(topic, qid, offsets[i], j - i, None, 1 << 62)
        if res.status is GetStatus.FOUND and res.count == j - i:
            out.append(res.spans)
            out.extend([] for _ in range(j - i - 1))  # the run's spans carry them all
        else:
            for off in offsets[i:j]:
                one = store.read_raw(topic, qid, off, 1, None, 1 << 62)
                out.append(one.spans if one.status is GetStatus.FOUND and one.count == 1 else None)
        i = j
    return out
