"""Reads in the partition-per-file mode (its :class:`~._reads.QueueSource`): a queue's
own log, looked up by its offset index and scanned forward, every record checked to be
the one asked for (:meth:`PartitionLog.records_from`)."""

from __future__ import annotations

from clmq.common import Record

from ._partition_state import PartitionState
from ._results import Span


class PartitionReads:
    """Reads of the partitions; readers see what was written (nothing to dispatch)."""

    def __init__(self, parts: PartitionState) -> None:
        self._parts = parts

    def min_offset(self, topic: str, queue_id: int) -> int:
        part = self._parts.partitions.get((topic, queue_id))
        return part.min_offset if part else 0

    def max_offset(self, topic: str, queue_id: int) -> int:
        part = self._parts.partitions.get((topic, queue_id))
        return part.next_offset if part else 0

    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        return self.min_offset(topic, queue_id), self.max_offset(topic, queue_id)

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        part = self._parts.partitions.get((topic, queue_id))
        return part.offset_for_timestamp(self._parts.files, timestamp_ms) if part else 0

    def records(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None
    ) -> tuple[list[Record], int]:
        """Records from ``offset`` on (tag-filtered) and the queue offset after the last one looked at."""
        part = self._parts.partitions[(topic, queue_id)]
        out: list[Record] = []
        limit = max_messages if tags is None else max(max_messages, self._parts.state.config.max_scan_entries)
        for rec, _raw in part.records_from(self._parts.files, offset, limit):
            offset = rec.queue_offset + 1
            if tags is None or rec.tags in tags:
                out.append(rec)
                if len(out) == max_messages:
                    break
        return out, offset

    def spans(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None, max_bytes: int
    ) -> tuple[list[Span], int, int]:
        """``(spans, record count, next queue offset)`` from ``offset`` on, within ``max_bytes``."""
        part = self._parts.partitions[(topic, queue_id)]
        spans: list[Span] = []
        total = 0
        limit = max_messages if tags is None else max(max_messages, self._parts.state.config.max_scan_entries)
        for rec, raw in part.records_from(self._parts.files, offset, limit):
            if spans and total + rec.size > max_bytes:
                break
            offset = rec.queue_offset + 1
            if tags is None or rec.tags in tags:
                spans.append(Span(None, rec.commitlog_offset, rec.size, raw))
                total += rec.size
                if len(spans) == max_messages:
                    break
        return spans, len(spans), offset
