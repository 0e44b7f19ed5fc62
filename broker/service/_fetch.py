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
shares): a slow disk read holds up that request, not the event loop. Except a small
pull of fresh records (a consumer at the head of a few queues, asking from where the
last answer left them at their end: :class:`FreshPositions`), which is read on the
event loop: its hop to a thread and back cost more than its read.

A damaged record (:class:`CorruptRecordError`: it does not match its queue entry, or
its CRC) fails its queue only: the records before it are answered, then the queue's
row is CORRUPT with the error's text (file, offset, check) and never moves past it;
the other queues of the request are read as usual.

A leader with followers in sync adds ``suggest_follower: true`` to an answer that
leaves some queue more than ``follower_read_lag_messages`` behind its max offset
(:func:`suggest_follower`): the consumer reads that group from a follower for a while.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import trio

from clmq.broker.store import GetStatus, RawRead, Span, StorageEngine, Store
from clmq.commitlog import pages_missing, read_exactly
from clmq.common import CorruptRecordError
from clmq.protocol import ErrorCode, FetchAsk, FetchResult, Frame, PullStatus, RowError
from clmq.protocol.transport import Reply, RequestError, need

from ._context import BrokerContext
from ._read_threads import ColdReads, FreshPositions, Pull
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


_Read = RawRead | CorruptRecordError | None  # a queue's read in a many-queue read (None: not read)

# A watch not read (every queue at its end): no rows, no spans, a count of -1.
WATCH_NOT_READ: Pull = ([], [], -1)
# A pull of at most this many queues, each at most this many messages behind its end,
# all asked from positions recent answers left at their end (:class:`FreshPositions`),
# is read on the event loop, one queue after another, its records copied into the
# answer (at most INLINE_MAX_BYTES, but a first record larger than that).
INLINE_MAX_QUEUES = 16
INLINE_MAX_BEHIND = 64
INLINE_MAX_BYTES = 256 << 10
# An inline read lets other tasks run once it has held the event loop this long (after
# the queue it is reading): a produce request waits for at most about this much of it.
INLINE_SLICE_S = 0.0003


class Fetch:
    def __init__(self, ctx: BrokerContext, readers: ReadThreads) -> None:
        self.waiters = ctx.waiters
        self.store = ctx.store
        self.config = ctx.config
        self.readers = readers  # shared with the broker's other reads
        self.ctx = ctx
        cfg = ctx.config  # pulls of data not in the page cache go to their own threads
        self.cold = ColdReads(readers, cfg.cold_read_threads, cfg.cold_read_memory_queues, cfg.cold_read_distance_bytes)
        self.fresh = FreshPositions()
        # A long poll about to wait ends the dispatcher's pause between rounds: what was
        # appended since its last round is dispatched (and wakes the poll) at once.
        self._hurry: Callable[[], None] | None = ctx.store.dispatcher.hurry if isinstance(ctx.store, Store) else None

    async def handle(self, frame: Frame, _peer: object) -> Reply:
        f = frame.fields
        asks = parse_queues(f)
        # Types and ranges were checked (protocol.check_request); limits are clamped to the broker's.
        total = max(1, min(optional(f, "max_messages", 1024), self.config.max_pull_messages))
        per_queue = max(1, optional(f, "max_per_queue", 256))
        wait_ms = min(optional(f, "max_wait_ms", 0), self.config.max_pull_wait_ms)
        max_bytes = max(1, min(optional(f, "max_bytes", self.config.max_pull_bytes), self.config.max_pull_bytes))
        if wait_ms:
            results, spans, found = await self._watch(asks, total, per_queue, max_bytes, wait_ms)
        else:
            results, spans, found = await self._read_in_thread(asks, total, per_queue, max_bytes)
        if found:
            self._count_out(asks, results)
        fields: dict[str, Any] = {"results": results, "count": found}
        if suggest_follower(self.ctx, max_behind(results)):
            fields["suggest_follower"] = True
        return Reply(fields, spans=spans)

    def _count_out(self, asks: list[FetchAsk], results: list[list[Any]]) -> None:
        """The traffic counters, once per topic (a sparse fetch reads 1,024 queues of one)."""
        per_topic: dict[str, list[int]] = {}
        for ask, row in zip(asks, results):
            if row[2]:
                sums = per_topic.get(ask[0])
                if sums is None:
                    per_topic[ask[0]] = [row[2], row[3]]
                else:
                    sums[0] += row[2]
                    sums[1] += row[3]
        for topic, (messages, nbytes) in per_topic.items():
            self.ctx.traffic.add_out(topic, messages, nbytes)

    async def _read_in_thread(
        self, asks: list[FetchAsk], total: int, per_queue: int, max_bytes: int, watch: bool = False
    ) -> Pull:
        """The pull's read: in a read thread, or on the event loop when it is small and
        fresh (:meth:`_read_inline`). A small pull's answer that leaves queues at
        their end remembers those positions."""
        small = len(asks) <= INLINE_MAX_QUEUES
        try:
            if small and self.fresh.all_fresh(asks, trio.current_time()) and self._near_end(asks):
                pull = await self._read_inline(asks, total, per_queue, max_bytes, watch)
            else:
                pull = await self.cold.pull(self._read, asks, total, per_queue, max_bytes, watch)
        except (
            OSError
        ) as e:  # a cold span could not be read (the file changed underneath): this pull fails, not the connection
            raise RequestError(ErrorCode.IO_ERROR, f"reading stored records: {e}") from e
        if small:  # a watch not read: every queue at its end, so its position stays fresh
            self.fresh.note(asks, _at_end_rows(asks) if pull[2] < 0 else pull[0], trio.current_time())
        return pull

    def _near_end(self, asks: list[FetchAsk]) -> bool:
        """Whether every ask is at most INLINE_MAX_BEHIND messages below its queue's
        end and not past it (an offset not yet visible is read in a thread: telling it
        from an overflow copies the log's table of offsets)."""
        store = self.store
        return all(0 <= store.max_offset(t, q) - o <= INLINE_MAX_BEHIND for t, q, o, _tags in asks)

    async def _read_inline(self, asks: list[FetchAsk], total: int, per_queue: int, max_bytes: int, watch: bool) -> Pull:
        """A small pull of fresh records (:class:`FreshPositions`), read on the event
        loop one queue after another (a many-queue read's array set-up costs ~150 us
        whatever it reads, one queue's read of a few records ~35 us), letting other
        tasks run whenever it has held the loop for INLINE_SLICE_S (8 queues of a few
        records each took ~0.4 ms at 10k msgs/s; a checkpoint after every queue cost
        the answer as much as the thread hop, as the loop's other tasks ran each
        time); the records are copied into one piece of the answer when their pages
        are cached (one send; else the transport's checks apply to the file spans, as
        for any pull)."""
        self.readers.stats.inline_pulls += 1
        if watch and self._all_at_end(asks):
            self.readers.stats.unread_watches += 1
            return WATCH_NOT_READ
        reads: list[_Read] = []
        found = nbytes = 0
        read = self.store.read_one_of_many
        slice_end = time.perf_counter() + INLINE_SLICE_S
        for ask in asks:
            res, found, nbytes = read(ask, found, nbytes, total, per_queue, min(max_bytes, INLINE_MAX_BYTES))
            reads.append(res)
            if time.perf_counter() > slice_end:
                await trio.lowlevel.checkpoint()
                slice_end = time.perf_counter() + INLINE_SLICE_S
        rows, spans, found = self._answer(asks, reads)
        return rows, _cached_bytes(spans), found

    def _all_at_end(self, asks: list[FetchAsk]) -> bool:
        """Whether every ask names an existing queue at exactly its max offset: a read
        would answer NO_MESSAGE for each and change nothing. Anything else (an offset
        below or past the end, a queue not there) is read, as before."""
        store = self.store
        return all(store.queue_exists(t, q) and store.max_offset(t, q) == o for t, q, o, _tags in asks)

    def _read(
        self,
        asks: list[FetchAsk],
        total: int,
        per_queue: int,
        max_bytes: int,
        watch: bool = False,
    ) -> Pull:
        """Per queue a :class:`FetchResult` row (max offset -1 when SKIPPED: not looked
        at), the spans, and the count. The body stays within ``max_bytes``, except that
        a first record larger than it is answered alone (the reader must progress).
        ``watch`` (a request that may wait): :data:`WATCH_NOT_READ` when every queue is
        at its end (a consumer's idle queues), read after the wait instead: reading
        64 watches of 1,024 caught-up queues cost as much as reading their messages."""
        if watch and self._all_at_end(asks):
            self.readers.stats.unread_watches += 1
            return WATCH_NOT_READ
        return self._answer(asks, self.store.read_raw_many(asks, total, per_queue, max_bytes))

    def _answer(self, asks: list[FetchAsk], reads: list[_Read]) -> Pull:
        """The rows, spans and count of a pull from its queues' reads."""
        results: list[list[Any]] = []
        spans: list[Span] = []
        found = 0
        visibility = Visibility(self.store)
        for (topic, qid, offset, _tags), res in zip(asks, reads):
            if res is None:
                results.append(FetchResult.row(PullStatus.SKIPPED, offset, 0, 0, -1))
            elif isinstance(res, CorruptRecordError):  # this queue stops here; the others are served
                results.append(
                    FetchResult.row(PullStatus.CORRUPT, offset, 0, 0, self.store.max_offset(topic, qid), str(res))
                )
            else:
                if res.status is GetStatus.OFFSET_OVERFLOW:  # only that one may be "not yet visible"
                    res = visibility.visible(topic, qid, offset, res)
                results.append(
                    FetchResult.row(WIRE_STATUS[res.status], res.next_offset, res.count, res.nbytes, res.max_offset)
                )
                spans += res.spans
                found += res.count
        return results, joined_spans(spans), found

    async def _watch(self, asks: list[FetchAsk], total: int, per_queue: int, max_bytes: int, wait_ms: int) -> Pull:
        """A pull that may wait (long polling). Its queues are watched before anything
        is looked at, so that every arrival from then on wakes it. A pull of queues all
        at their end (a consumer's idle queues) is not read before the wait, nor looked
        at again: 64 watches of 1,024 caught-up queues cost the broker as much as
        reading their messages had. One that read nothing else looks once more whether
        some queue holds more (beyond a tag filter, below the queue's start) and reads
        again at once if so, as before."""
        event = trio.Event()
        keys = [(topic, qid) for topic, qid, _o, _t in asks]
        waiters = self.waiters
        for key in keys:
            waiters.add(key, event)
        try:
            pull = await self._read_in_thread(asks, total, per_queue, max_bytes, True)
            if pull[2] > 0:
                return pull
            store = self.store
            if pull[2] < 0 or not any(store.queue_exists(t, q) and store.max_offset(t, q) > o for t, q, o, _ in asks):
                if self._hurry is not None and not event.is_set():
                    self._hurry()
                with trio.move_on_after(wait_ms / 1000):
                    await event.wait()
        finally:
            for key in keys:
                waiters.unregister(key, event)
        return await self._read_in_thread(asks, total, per_queue, max_bytes)


def _cached_bytes(spans: list[Span]) -> list[Span]:
    """``spans`` (file spans of a few small records) as one bytes span, read from the
    page cache; unchanged if any page is not cached (the transport then reads those in
    a thread: the disk is never read on the event loop)."""
    if not spans or all(s.data is not None for s in spans):
        return spans
    pieces: list[bytes] = []
    fds: dict[str, int] = {}
    try:
        for s in spans:
            if s.data is not None or s.path is None:
                pieces.append(s.data or b"")
                continue
            fd = fds.get(s.path)
            if fd is None:
                fd = fds[s.path] = os.open(s.path, os.O_RDONLY)
            if pages_missing(fd, s.position, s.length) is not False:
                return spans
            pieces.append(read_exactly(fd, s.position, s.length, s.path))
    finally:
        for fd in fds.values():
            os.close(fd)
    return [_joined(pieces)]


def _at_end_rows(asks: list[FetchAsk]) -> list[list[Any]]:
    """The rows of queues each at its end at the offset asked (a watch not read)."""
    return [FetchResult.row(PullStatus.NO_MESSAGE, o, 0, 0, o) for _t, _q, o, _tags in asks]
