"""A read of many queues at once in the CommitLog mode (the broker's PULL_MESSAGES):
every queue's entries picked within the request's bounds first, a chunk of queues at a
time with array operations, then all their records read together
(:meth:`EntryReader.spans_many`: sorted by log position, one pread per neighbourhood,
headers checked with array operations). The answers are exactly those of reading the
queues one by one (:meth:`Reads.read_raw_many`; ``tests/test_read_many.py``)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from clmq.common import CorruptRecordError
from clmq.consumequeue import ENTRY_DTYPE, ENTRY_SIZE, FileSpan

from ._log_parts import LogParts
from ._queue_reads import select_entries
from ._reads import Limits, ManyRead, ReadAsk, Reads, check_get_args, read_one_of_many
from ._results import GetStatus, RawRead, Span


def read_many(parts: LogParts, reads: Reads, asks: Sequence[ReadAsk], limits: Limits) -> list[ManyRead]:
    """:meth:`Reads.read_raw_many`, the records of all queues read together. A queue
    whose entries or records are not what they should be (damage, retention meanwhile,
    a segment end) is read alone as by :meth:`Reads.read_raw`, and the queues after it
    are picked again from there: the answers are the per-queue loop's."""
    out: list[ManyRead] = []
    found = nbytes = 0
    while len(out) < len(asks):
        steps, end_found, end_nbytes = _plan_many(parts, reads, asks, len(out), found, nbytes, limits)
        got = iter(parts.entries.spans_many([st.read.pick for st in steps if isinstance(st.read, _Planned)]))
        found, nbytes = end_found, end_nbytes
        for st in steps:
            res = st.read.result(next(got)) if isinstance(st.read, _Planned) else st.read
            if isinstance(st.read, _Planned) and res is None:  # read alone below, from the counts before it
                found, nbytes = st.found, st.nbytes
                break
            out.append(res)
        if len(out) < len(asks):
            res, found, nbytes = read_one_of_many(reads.read_raw, asks[len(out)], found, nbytes, limits)
            out.append(res)
    return out


@dataclass(slots=True)
class _Planned:
    """A queue of a many-queue read whose entries are picked: its records to read."""

    pick: tuple[np.ndarray, np.ndarray, bytes, int]  # entries, their queue offsets, topic, queue id
    next_offset: int
    bounds: tuple[int, int]
    nbytes: int

    def result(self, got: tuple[list[FileSpan | bytes], int] | None) -> RawRead | None:
        """Its :class:`RawRead` from what :meth:`EntryReader.spans_many` read; None
        when that was not every record picked (the queue is then read alone)."""
        if got is None or got[1] != len(self.pick[0]):
            return None
        spans = [Span(None, 0, len(s), s) if isinstance(s, bytes) else Span(*s) for s in got[0]]
        return RawRead(GetStatus.FOUND, spans, got[1], self.next_offset, *self.bounds)


@dataclass(slots=True)
class _Step:
    """An ask's place in a many-queue read: the counts before it, and its read."""

    found: int
    nbytes: int
    read: ManyRead | _Planned


PLAN_CHUNK_ASKS = 256  # asks whose entries are fetched before their picks are worked out together


@dataclass(slots=True)
class _Head:
    """An ask whose queue holds entries at its offset: those entries (``raw`` from queue
    offset ``at``, up to the request's per-queue limit) and its queue's bounds."""

    ask: ReadAsk
    tag_set: set[str] | None
    at: int
    raw: bytes
    bounds: tuple[int, int]


def _heads(
    parts: LogParts, reads: Reads, asks: Sequence[ReadAsk], per_queue: int
) -> tuple[list[RawRead | _Head], bool]:
    """Each ask's early answer (no such queue, an offset outside it) or its entries, in
    order; whether it stopped before an ask whose look-up failed (read that one alone)."""
    out: list[RawRead | _Head] = []
    for ask in asks:
        topic, queue_id, offset, tags = ask
        tag_set = check_get_args(topic, queue_id, offset, per_queue, tags, 1)
        try:
            early, lo, hi = reads.check_get(topic, queue_id, offset)
            if early is not None:
                out.append(RawRead(early[0], next_offset=early[1], min_offset=lo, max_offset=hi))
                continue
            scan = per_queue if tag_set is None else max(per_queue, parts.state.config.max_scan_entries)
            at, raw = parts.queues.queue(topic, queue_id).read_entries(offset, scan)
        except CorruptRecordError:
            return out, True
        out.append(_Head(ask, tag_set, at, raw, (lo, hi)))
    return out, False


def _plan_many(
    parts: LogParts, reads: Reads, asks: Sequence[ReadAsk], begin: int, found: int, nbytes: int, limits: Limits
) -> tuple[list[_Step], int, int]:
    """The asks from ``begin`` on picked in order within the bounds ``limits`` (max
    messages, per queue, max bytes) as :func:`~._reads.read_one_of_many` would, and the
    counts after them. It stops before an ask whose picking failed (read it alone).
    Entries are looked at a chunk of asks at a time, with array operations over all of
    them: per queue they cost more than its records' reading did."""
    max_messages, max_per_queue, max_bytes = limits
    steps: list[_Step] = []
    i = begin
    while i < len(asks):
        if found >= max_messages or nbytes >= max_bytes:
            steps += [_Step(found, nbytes, None) for _ in range(i, len(asks))]
            break
        heads, stopped = _heads(parts, reads, asks[i : i + PLAN_CHUNK_ASKS], max_per_queue)
        picker = _Picker(parts, heads, limits)
        for head in heads:
            step = picker.step(head, found, nbytes)
            if step is None:  # its picking failed: read it alone
                return steps, found, nbytes
            steps.append(step)
            found, nbytes = picker.found, picker.nbytes
        i += len(heads)
        if stopped:
            break
    return steps, found, nbytes


class _Picker:
    """Works out the picks of a chunk of heads in order (the counts run on from one to
    the next). A queue whose entries are all live records and is read without a tag
    filter (the usual one) is picked from arrays made once for the chunk; others as by
    :func:`~._queue_reads.select_entries`."""

    def __init__(self, parts: LogParts, heads: list[RawRead | _Head], limits: Limits) -> None:
        self.parts, self.limits = parts, limits
        self.found = self.nbytes = 0
        raws = [h.raw for h in heads if isinstance(h, _Head)]
        self.entries = np.frombuffer(b"".join(raws), ENTRY_DTYPE)
        sizes = self.entries["size"].astype(np.int64)
        odd = (sizes == 0) | (self.entries["offset"] < parts.log.min_offset)  # holes, retention
        self.cum = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self.odd = np.concatenate([[0], np.cumsum(odd)]).tolist()
        self.starts = iter(itertools.accumulate((len(r) // ENTRY_SIZE for r in raws), initial=0))

    def step(self, head: RawRead | _Head, found: int, nbytes: int) -> _Step | None:
        """The head's step after ``found`` records of ``nbytes``; None if picking failed."""
        max_messages, max_per_queue, max_bytes = self.limits
        self.found, self.nbytes = found, nbytes
        base = next(self.starts) if isinstance(head, _Head) else 0
        if found >= max_messages or nbytes >= max_bytes:
            return _Step(found, nbytes, None)
        if isinstance(head, RawRead):
            return _Step(found, nbytes, head)
        limit, room = min(max_per_queue, max_messages - found), max_bytes - nbytes
        n = len(head.raw) // ENTRY_SIZE
        try:
            read = (
                self._simple(head, base, n, limit, room) if self._plain(head, base, n) else self._any(head, limit, room)
            )
        except CorruptRecordError:
            return None
        if isinstance(read, _Planned):
            if nbytes and nbytes + read.nbytes > max_bytes:  # its first record alone is past the bound: next time
                self.nbytes = max_bytes
                return _Step(found, nbytes, None)
            self.found, self.nbytes = found + len(read.pick[0]), nbytes + read.nbytes
        return _Step(found, nbytes, read)

    def _plain(self, head: _Head, base: int, n: int) -> bool:
        return head.tag_set is None and n > 0 and self.odd[base + n] == self.odd[base]

    def _simple(self, head: _Head, base: int, n: int, limit: int, room: int) -> _Planned:
        """:func:`~._queue_reads.select_entries` for entries that are all live records, no tag filter."""
        k = min(limit, n)
        cum = self.cum
        keep = max(1, bisect.bisect_right(cum, cum[base] + room, base + 1, base + k + 1) - base - 1)
        full = k == limit or keep < k
        topic, queue_id, _offset, _tags = head.ask
        picked = self.entries[base : base + keep]
        qoffs = np.arange(head.at, head.at + keep, dtype=np.int64)
        return _Planned(
            (picked, qoffs, topic.encode(), queue_id),
            head.at + (keep if full else n),
            head.bounds,
            cum[base + keep] - cum[base],
        )

    def _any(self, head: _Head, limit: int, room: int) -> RawRead | _Planned:
        """The pick of :func:`~._queue_reads.select_entries` (the entries the per-queue read would scan)."""
        topic, queue_id, _offset, _tags = head.ask
        scan = limit if head.tag_set is None else max(limit, self.parts.state.config.max_scan_entries)
        cq = self.parts.queues.queue(topic, queue_id)
        raw = head.raw[: scan * ENTRY_SIZE]
        picked, qoffs, next_offset = select_entries(
            self.parts.log.min_offset, str(cq.directory), head.at, raw, limit, head.tag_set, room
        )
        if not len(picked):
            return RawRead(GetStatus.NO_MATCHED_MESSAGE, [], 0, next_offset, *head.bounds)
        return _Planned((picked, qoffs, topic.encode(), queue_id), next_offset, head.bounds, int(picked["size"].sum()))
