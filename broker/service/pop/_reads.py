"""Reads POP makes (in worker threads): the next entries of queues, with the tag
filter, and the records of deliveries as stored (spans, for the answer)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from clmq.broker.store import GetStatus, Span, Store
from clmq.common import HEADER_SIZE, OFF_TOPIC_LEN, RECORD_MAGIC, CorruptRecordError
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


INLINE_MAX_BYTES = 1 << 20  # a pop answer up to this many record bytes is read and sent as one buffer
_HEAD = struct.Struct("<II4xQQI")  # total size, magic, (crc), commit-log offset, queue offset, queue id
_TOPIC_LEN = struct.Struct("<H")


def read_inline(store: Store, topic: str, qid: int, where: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
    """The stored bytes of each record ``(queue offset, commit-log offset, size)``
    (ascending), read per log-contiguous run with one read, each checked to be the
    record its entry names (size, magic, offsets, queue, topic); None for one that
    is not (retention, damage: it is left out of the answer)."""
    name = topic.encode()
    out: list[bytes | None] = []
    i = 0
    while i < len(where):
        j = i + 1
        while j < len(where) and where[j][1] == where[j - 1][1] + where[j - 1][2]:
            j += 1
        start = where[i][1]
        data = _read(store, start, where[j - 1][1] + where[j - 1][2] - start)
        if data is None and j - i > 1:
            j = i + 1  # across a segment's end: record by record
            data = _read(store, start, where[i][2])
        for q, off, size in where[i:j]:
            p = off - start
            ok = data is not None and _is_record(data, p, size, off, q, qid, name)
            out.append(bytes(data[p : p + size]) if ok and data is not None else None)
        i = j
    return out


def _read(store: Store, offset: int, size: int) -> bytes | None:
    try:
        return store.log.read_bytes(offset, size)
    except CorruptRecordError:
        return None


def _is_record(data: bytes, p: int, size: int, offset: int, queue_offset: int, qid: int, topic: bytes) -> bool:
    if p + HEADER_SIZE + len(topic) > len(data) or p + size > len(data):
        return False
    if _HEAD.unpack_from(data, p) != (size, RECORD_MAGIC, offset, queue_offset, qid):
        return False
    if _TOPIC_LEN.unpack_from(data, p + OFF_TOPIC_LEN)[0] != len(topic):
        return False
    return data[p + HEADER_SIZE : p + HEADER_SIZE + len(topic)] == topic
