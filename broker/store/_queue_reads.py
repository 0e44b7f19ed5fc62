"""The CommitLog mode's reads of a queue (its :class:`~._reads.QueueSource`): entries
looked up in the consume queue, picked (retention, holes, tags, limits), and the
records they name read through the :class:`EntryReader`, which checks each one is the
record its entry names. A read that meets damage marks the queue for rebuild at the
next open (:meth:`LogParts.mark_for_rebuild`) and raises :class:`CorruptRecordError`."""

from __future__ import annotations

import struct
from typing import Callable, TypeVar

import numpy as np

from clmq.common import OFF_STORE_TS, CorruptRecordError, Record
from clmq.consumequeue import ENTRY_DTYPE, tag_hash

from ._log_parts import LogParts
from ._results import Span

QUEUE_BYTES_CHUNK_ENTRIES = 65_536  # index entries read at once when a queue's bytes are summed

T = TypeVar("T")


class QueueReads:
    """Reads of the CommitLog mode's queues (see the module docstring)."""

    def __init__(self, parts: LogParts) -> None:
        self._parts = parts

    def _marking(self, topic: str, queue_id: int, read: Callable[[], T]) -> T:
        """``read()``; damage it meets marks the queue for rebuild, then is raised."""
        try:
            return read()
        except CorruptRecordError as e:
            self._parts.mark_for_rebuild(topic, queue_id, e)
            raise

    def min_offset(self, topic: str, queue_id: int) -> int:
        return self.bounds(topic, queue_id)[0]

    def max_offset(self, topic: str, queue_id: int) -> int:
        """One past the last dispatched message of the queue."""
        return self._parts.queues.queue(topic, queue_id).next_offset

    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        # Without _marking's closure: every read asks it (a many-queue read, per queue).
        try:
            return self._parts.queues.queue(topic, queue_id).bounds(self._parts.log.min_offset)
        except CorruptRecordError as e:
            self._parts.mark_for_rebuild(topic, queue_id, e)
            raise

    def queue_bytes(self, topic: str, queue_id: int, max_entries: int) -> int | None:
        """Bytes of the records a queue still holds (its entries' sizes summed); None
        when it holds more than ``max_entries`` (summing would read too much index)."""
        lo, hi = self.bounds(topic, queue_id)
        if hi - lo > max_entries:
            return None
        return self._marking(topic, queue_id, lambda: self._sum_sizes(topic, queue_id, lo, hi))

    def _sum_sizes(self, topic: str, queue_id: int, lo: int, hi: int) -> int:
        cq = self._parts.queues.queue(topic, queue_id)
        total, offset = 0, lo
        while offset < hi:
            at, raw = cq.read_entries(offset, min(QUEUE_BYTES_CHUNK_ENTRIES, hi - offset))
            if not raw:
                break
            entries = np.frombuffer(raw, ENTRY_DTYPE)
            total += int(entries["size"].sum(dtype=np.uint64))  # a hole marker has size 0
            offset = at + len(entries)
        return total

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        """The first queue offset stored at or after ``timestamp_ms`` (max offset if none)."""
        cq = self._parts.queues.queue(topic, queue_id)
        commitlog = self._parts.log
        log_min = commitlog.min_offset

        def stored_at_or_after(entry: tuple[int, int, int]) -> bool:
            if entry[0] < log_min:
                return False
            raw = commitlog.read_bytes(entry[0] + OFF_STORE_TS, 8)
            return raw is not None and struct.unpack("<Q", raw)[0] >= timestamp_ms

        return self._marking(topic, queue_id, lambda: cq.search(stored_at_or_after))

    def records(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None
    ) -> tuple[list[Record], int]:
        """Records from ``offset`` on (tag-filtered) and the queue offset after the last one looked at."""
        parts = self._parts
        scan = max_messages if tags is None else max(max_messages, parts.state.config.max_scan_entries)

        def read() -> tuple[list[Record], int]:
            cq = parts.queues.queue(topic, queue_id)
            at, raw = cq.read_entries(offset, scan)
            picked, qoffs, next_offset = select_entries(
                parts.log.min_offset, str(cq.directory), at, raw, max_messages, tags
            )
            return parts.entries.records(picked, qoffs, topic, queue_id), next_offset

        records, next_offset = self._marking(topic, queue_id, read)
        return [r for r in records if tags is None or r.tags in tags], next_offset

    def spans(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None, max_bytes: int
    ) -> tuple[list[Span], int, int]:
        """``(spans, record count, next queue offset)`` from ``offset`` on, within ``max_bytes``."""
        parts = self._parts
        scan = max_messages if tags is None else max(max_messages, parts.state.config.max_scan_entries)

        def read() -> tuple[list[Span], int, int]:
            cq = parts.queues.queue(topic, queue_id)
            at, raw = cq.read_entries(offset, scan)
            picked, qoffs, next_offset = select_entries(
                parts.log.min_offset, str(cq.directory), at, raw, max_messages, tags, max_bytes
            )
            found, count = parts.entries.spans(picked, qoffs, topic.encode(), queue_id)
            return [Span(*span) for span in found], count, next_offset

        return self._marking(topic, queue_id, read)


def select_entries(
    log_min: int,
    where: str,
    at: int,
    raw: bytes,
    max_messages: int,
    tag_set: set[str] | None,
    max_bytes: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The entries to read from ``raw`` (entries from queue offset ``at`` of the
    queue in directory ``where``), their queue offsets, and the queue offset after
    the last one looked at. Entries below ``log_min`` fell out of retention."""
    entries = np.frombuffer(raw, ENTRY_DTYPE)
    live = entries["offset"] >= log_min
    mask = entries["size"] > 0  # size 0: a hole marker
    if not live.all():  # below the log's start: retention, which only ever takes a queue's head
        _retained_prefix(entries, mask, live, at, where, log_min)
        mask &= live
    if tag_set is not None:
        mask &= np.isin(entries["tag"], np.array([tag_hash(t) for t in tag_set], dtype=np.uint64))
    idx = np.flatnonzero(mask)[:max_messages]
    full = len(idx) == max_messages
    if max_bytes is not None and len(idx):
        cum = np.cumsum(entries["size"][idx].astype(np.int64))
        keep = max(1, int(np.searchsorted(cum, max_bytes, side="right")))  # the first record always
        full, idx = full or keep < len(idx), idx[:keep]
    next_offset = at + (int(idx[-1]) + 1 if full else len(entries))
    return entries[idx], idx + at, next_offset


def _retained_prefix(
    entries: np.ndarray, real: np.ndarray, live: np.ndarray, at: int, where: str, log_min: int
) -> None:
    """Entries pointing below the log's start must be a prefix (retention deletes the
    oldest records first); one after a live entry is damage, not retention."""
    first_live = np.flatnonzero(real & live)
    if not len(first_live):
        return
    late = np.flatnonzero(real & ~live)
    late = late[late > first_live[0]]
    if len(late):
        i = int(late[0])
        raise CorruptRecordError(
            where,
            at + i,
            "consume queue entry",
            f"a commit-log offset >= {log_min} (the log's start)",
            str(int(entries["offset"][i])),
        )
