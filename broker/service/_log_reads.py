"""Bulk reads of the CommitLog for parallel readers (the Spark connector's network mode).

``GET_LOG_LAYOUT`` gives a snapshot: the log's extent that is durable, dispatched and
confirmed, every segment with its boundary index, and the topics. ``READ_LOG`` then
serves raw bytes of one segment below that snapshot's end, with ``sendfile`` like pulls:
the reader walks and checks the records itself, so the broker does no per-record work.
"""

from __future__ import annotations

import trio

from clmq.broker.store import Span, Store
from clmq.commitlog import CommitLog
from clmq.protocol import ErrorCode, Frame
from clmq.protocol.auth import Operation, ResourceType
from clmq.protocol.transport import Peer, Reply, RequestError, need

from ._context import BrokerContext
from ._fetch import ReadThreads

MAX_READ_LOG_BYTES = 16 << 20  # one READ_LOG answer at most (the broker's max_pull_bytes caps it too)


class LogReads:
    def __init__(self, ctx: BrokerContext, readers: ReadThreads) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.config = ctx.config
        self.readers = readers  # the pulls' worker threads (offsets may be read from disk)

    def _store(self) -> Store:
        if not isinstance(self.store, Store):
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                f"this broker stores in {self.config.storage_mode} mode: it has no CommitLog to read "
                "in ranges; read its queues with PULL_MESSAGE",
            )
        return self.store

    def _log(self) -> CommitLog:
        return self._store().log

    def snapshot_end(self) -> int:
        """Bytes below this are durable, dispatched to the queues and confirmed."""
        log = self._log()
        return min(log.durable_offset, self._store().dispatcher.dispatched_offset, log.confirmed_offset)

    def _may_read_the_log(self, peer: Peer, what: str) -> None:
        """The raw log holds every topic: READ on each one (a DENY on one holds)."""
        topics = self.store.topics.all()
        self.ctx.security.check(peer, [(Operation.READ, ResourceType.TOPIC, t) for t in topics], what)

    async def layout(self, frame: Frame, peer: Peer) -> Reply:
        log = self._log()
        self._may_read_the_log(peer, "GET_LOG_LAYOUT")
        end = self.snapshot_end()
        segments = []
        for base, size, _path in log.segments():
            if base >= end:
                break
            data_end = min(base + size, end)
            starts = [base] + [b for b in log.boundaries(base) if base < b < data_end]
            segments.append([base, data_end, starts])
        topics = self.store.topics.all()

        def count() -> int:  # min offsets may read queue files: in a worker thread
            return sum(
                max(0, self.store.max_offset(t, q) - self.store.min_offset(t, q))
                for t, n in topics.items()
                for q in range(n)
            )

        counts = await self.readers.in_thread(count)
        return Reply(
            {
                "min_offset": log.min_offset,
                "end_offset": end,
                "segments": segments,
                "topics": topics,
                "message_count": counts,
                "storage_mode": self.config.storage_mode,
            }
        )

    async def read_log(self, frame: Frame, peer: Peer) -> Reply:
        """Raw bytes ``[offset, offset + max_bytes)`` of one segment, cut at the snapshot
        end the reader names (never past what is durable now)."""
        log = self._log()
        self._may_read_the_log(peer, "READ_LOG")
        f = frame.fields
        offset, max_bytes, end = need(f, "offset", int), need(f, "max_bytes", int), need(f, "end_offset", int)
        end = min(end, self.snapshot_end())
        n = max(0, min(max_bytes, MAX_READ_LOG_BYTES, self.config.max_pull_bytes * 2, end - offset))
        for base, size, path in log.segments():
            if base <= offset < base + size:
                n = min(n, base + size - offset)
                await trio.lowlevel.checkpoint()
                return Reply({"offset": offset, "length": n}, spans=[Span(str(path), offset - base, n)] if n else [])
        raise RequestError(
            ErrorCode.NOT_FOUND,
            f"offset {offset} is not in the log ({log.min_offset}..{log.write_offset}); retention may have removed it",
        )
