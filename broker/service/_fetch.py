"""PULL_MESSAGES: one request reads many queues (Kafka's fetch), so that a consumer of
thousands of queues pays one round trip for many of them, not one per queue.

Queues are read in the order given, each up to ``max_per_queue`` messages, until the
request's ``max_messages`` or the broker's ``max_pull_bytes``; the rest are reported
``SKIPPED`` (the client asks again). If nothing is found the request waits (long
polling) until any of its queues gets entries or ``max_wait_ms`` passes. An offset the
log has assigned but the queue does not show yet (the dispatcher, or replication,
lags) is "nothing yet", never OFFSET_OVERFLOW (:class:`Visibility`).

The queues of one request are read together (:meth:`StorageEngine.read_raw_many`: their
records sorted by log position, one read per neighbourhood, answered as bytes; a queue
written alone in long runs is still sent with sendfile). The reads of one request run
in one worker thread (a hop per request, not per queue), among at most
``pull_read_threads`` (:class:`ReadThreads`, which every pull and look-up of the broker
shares): a slow disk read holds up that request, not the event loop.

A damaged record (:class:`CorruptRecordError`: it does not match its queue entry, or
its CRC) fails its queue only: the records before it are answered, then the queue's
row is CORRUPT with the error's text (file, offset, check) and never moves past it;
the other queues of the request are read as usual.

A leader with followers in sync adds ``suggest_follower: true`` to an answer that
leaves some queue more than ``follower_read_lag_messages`` behind its max offset
(:func:`suggest_follower`): the consumer reads that group from a follower for a while.
"""

from __future__ import annotations

from typing import Any, Callable

import trio

from clmq.broker.store import GetStatus, RawRead, Span, StorageEngine, Store
from clmq.common import CorruptRecordError
from clmq.protocol import ErrorCode, FetchAsk, FetchResult, Frame, PullStatus, RowError
from clmq.protocol.transport import Reply, RequestError, need

from ._context import BrokerContext
from ._read_threads import ColdReads
from ._read_threads import ReadThreads as ReadThreads  # re-exported: its old home


def parse_queues(fields: dict[str, Any]) -> list[FetchAsk]:
    try:
        return [FetchAsk.from_wire(row) for row in need(fields, "queues", list)]
    except RowError as e:
        raise RequestError(ErrorCode.MALFORMED_REQUEST, f"queues: {e}") from None


def joined_spans(spans: list[Span]) -> list[Span]:
    """The spans with each run of bytes spans joined into one (the transport sends each
    span on its own: one send per queue of a many-queue answer cost more than the copy)."""
    out: list[Span] = []
    run: list[bytes] = []
    for span in spans:
        if span.data is not None:
            run.append(span.data)
            continue
        if run:
            out.append(_joined(run))
            run = []
        out.append(span)
    if run:
        out.append(_joined(run))
    return out


def _joined(pieces: list[bytes]) -> Span:
    data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    return Span(None, 0, len(data), data)


def optional(fields: dict[str, Any], name: str, default: int) -> int:
    """A checked optional integer field (absent or nil: ``default``)."""
    value = fields.get(name)
    return default if value is None else int(value)


# A queue's read status as the wire says it (PULL_MESSAGE's status, a fetch row's first field).
WIRE_STATUS = {status: PullStatus[status.name] for status in GetStatus}


def suggest_follower(ctx: BrokerContext, behind: int | Callable[[], int]) -> bool:
    """Whether a pull answer leaving its reader ``behind`` messages short of a queue's
    max offset should tell it to read from a follower (RocketMQ's "suggest pulling from
    slave"): this broker leads, some follower is in sync (so it serves nearly all of
    it), and the reader is more than ``follower_read_lag_messages`` behind (0: never).
    Old data is cold: its disk reads would hold up the leader's producers. ``behind``
    may be a function, called only when the rest says yes."""
    lag_messages = ctx.config.follower_read_lag_messages
    leader = ctx.replica.leader
    if lag_messages <= 0 or leader is None or not leader.isr.followers_in_sync():
        return False
    return (behind() if callable(behind) else behind) > lag_messages


def max_behind(results: list[list[Any]]) -> Callable[[], int]:
    """How far the reader of a PULL_MESSAGES answer is behind, at most over its queues
    (a row: status, next_offset, count, bytes, max_offset; max_offset -1: not read)."""
    return lambda: max((row[4] - row[1] for row in results if row[4] >= 0), default=0)


class Visibility:
    """Tells an offset that is not visible *yet* from one that is past the queue's end.

    The store acknowledges a put once it is in the log; the dispatcher makes the queue
    entries afterwards (and only up to the log's confirmed offset, which replication
    holds back), so ``max_offset`` can be below queue offsets already assigned and
    acknowledged. A pull there must wait (NO_MESSAGE, then the long poll), not answer
    OFFSET_OVERFLOW: a consumer told "overflow" moves its offset back to the max and
    reads, and commits, again what it had. Only an offset past the next one the log
    will assign is an overflow.

    One per request: the log's table of next offsets is copied at most once (under the
    log's lock, so in the worker thread, never on the event loop).
    """

    def __init__(self, store: StorageEngine) -> None:
        self.store = store
        self._assigned: dict[tuple[str, int], int] | None = None

    def next_assigned(self, topic: str, queue_id: int) -> int:
        """The next queue offset the store will assign in the queue (at least its max)."""
        visible = self.store.max_offset(topic, queue_id)
        if not isinstance(self.store, Store):  # partition mode: a put is visible before it is acknowledged
            return visible
        if self._assigned is None:
            self._assigned = self.store.log.queue_offset_table()
        return max(visible, self._assigned.get((topic, queue_id), 0))

    def visible(self, topic: str, queue_id: int, offset: int, res: RawRead) -> RawRead:
        """``res`` (a read of the queue at ``offset``), OFFSET_OVERFLOW answered
        NO_MESSAGE (``next_offset`` the offset asked: nothing moves) if the offset is
        assigned but not yet dispatched."""
        if res.status is GetStatus.OFFSET_OVERFLOW and offset <= self.next_assigned(topic, queue_id):
            return RawRead(
                GetStatus.NO_MESSAGE, next_offset=offset, min_offset=res.min_offset, max_offset=res.max_offset
            )
        return res

    def read_to_damage(
        self, topic: str, queue_id: int, offset: int, limit: int, tags: list[str] | None, max_bytes: int
    ) -> RawRead | CorruptRecordError:
        """:meth:`StorageEngine.read_raw_to_damage`, seen through :meth:`visible`."""
        res = self.store.read_raw_to_damage(topic, queue_id, offset, limit, tags, max_bytes)
        return res if isinstance(res, CorruptRecordError) else self.visible(topic, queue_id, offset, res)


class Fetch:
    def __init__(self, ctx: BrokerContext, readers: ReadThreads) -> None:
        self.waiters = ctx.waiters
        self.store = ctx.store
        self.config = ctx.config
        self.readers = readers  # shared with the broker's other reads
        self.ctx = ctx
        cfg = ctx.config  # pulls of data not in the page cache go to their own threads
        self.cold = ColdReads(readers, cfg.cold_read_threads, cfg.cold_read_memory_queues, cfg.cold_read_distance_bytes)

    async def handle(self, frame: Frame, _peer: object) -> Reply:
        f = frame.fields
        asks = parse_queues(f)
        # Types and ranges were checked (protocol.check_request); limits are clamped to the broker's.
        total = max(1, min(optional(f, "max_messages", 1024), self.config.max_pull_messages))
        per_queue = max(1, optional(f, "max_per_queue", 256))
        wait_ms = min(optional(f, "max_wait_ms", 0), self.config.max_pull_wait_ms)
        max_bytes = max(1, min(optional(f, "max_bytes", self.config.max_pull_bytes), self.config.max_pull_bytes))
        results, spans, found = await self._read_in_thread(asks, total, per_queue, max_bytes)
        if not found and wait_ms:
            await self._wait_any(asks, wait_ms)
            results, spans, found = await self._read_in_thread(asks, total, per_queue, max_bytes)
        if found:
            traffic = self.ctx.traffic
            for ask, row in zip(asks, results):
                if row[2]:
                    traffic.add_out(ask.topic, row[2], row[3])
        fields: dict[str, Any] = {"results": results, "count": found}
        if suggest_follower(self.ctx, max_behind(results)):
            fields["suggest_follower"] = True
        return Reply(fields, spans=spans)

    async def _read_in_thread(
        self, asks: list[FetchAsk], total: int, per_queue: int, max_bytes: int
    ) -> tuple[list[list[Any]], list[Span], int]:
        try:
            return await self.cold.pull(self._read, asks, total, per_queue, max_bytes)
        except (
            OSError
        ) as e:  # a cold span could not be read (the file changed underneath): this pull fails, not the connection
            raise RequestError(ErrorCode.IO_ERROR, f"reading stored records: {e}") from e

    def _read(
        self, asks: list[FetchAsk], total: int, per_queue: int, max_bytes: int
    ) -> tuple[list[list[Any]], list[Span], int]:
        """Per queue a :class:`FetchResult` row (max offset -1 when SKIPPED: not looked
        at), the spans, and the count. The body stays within ``max_bytes``, except that
        a first record larger than it is answered alone (the reader must progress)."""
        results: list[list[Any]] = []
        spans: list[Span] = []
        found = 0
        visibility = Visibility(self.store)
        reads = self.store.read_raw_many(asks, total, per_queue, max_bytes)
        for (topic, qid, offset, _tags), res in zip(asks, reads):
            if res is None:
                results.append(FetchResult.row(PullStatus.SKIPPED, offset, 0, 0, -1))
            elif isinstance(res, CorruptRecordError):  # this queue stops here; the others are served
                results.append(
                    FetchResult.row(PullStatus.CORRUPT, offset, 0, 0, self.store.max_offset(topic, qid), str(res))
                )
            else:
                res = visibility.visible(topic, qid, offset, res)
                results.append(
                    FetchResult.row(WIRE_STATUS[res.status], res.next_offset, res.count, res.nbytes, res.max_offset)
                )
                spans += res.spans
                found += res.count
        return results, joined_spans(spans), found

    async def _wait_any(self, asks: list[FetchAsk], wait_ms: int) -> None:
        event = trio.Event()
        keys = [(topic, qid) for topic, qid, _o, _t in asks]
        waiters = self.waiters
        for key in keys:  # before the check: an arrival in between is not missed
            waiters.add(key, event)
        try:
            if any(self.store.queue_exists(t, q) and self.store.max_offset(t, q) > o for t, q, o, _ in asks):
                return
            with trio.move_on_after(wait_ms / 1000):
                await event.wait()
        finally:
            for key in keys:
                waiters.unregister(key, event)
