"""How a consumer reads its queues: per broker, a few PULL_MESSAGES requests in flight,
each covering many of the consumer's queues (Kafka's fetch), so that a consumer of
10,000 queues pays one round trip for up to ``fetch_queues`` of them.

A queue takes part once its start offset is known, and is in at most one request at a
time (its next offset depends on the last answer). Queues with nothing more to read
(empty at the look-up, an answer with nothing new, or one that read up to the queue's
max offset) are *idle*: they go into separate *watch* requests that wait on the broker
(long polling) until one of them gets messages; queues that turn idle while other
watches wait get a watch of their own. The others go into *data* requests
that never wait. Why two kinds: if a request mixing in idle queues waited, a few
requests of idle queues would take every slot while other queues still had messages,
and those would wait a whole ``pull_wait_ms`` (catching up ends unevenly).

A queue whose next record is damaged (a CORRUPT row) is neither skipped past nor asked
again at once: it is reported (one ERROR line per queue and offset, and the
consumer's ``errors``), paused, and asked again every ``damaged_queue_retry_ms`` in
case it is repaired; the other queues go on.

Replicated groups: the fetcher's loops are per group leader (``MessageQueue.addr``),
but each request goes where the consumer's :class:`ReadRouter` says, the leader or one
of its followers. A follower that fails a request, or cannot serve a queue as the
leader would (it does not hold the offset yet, or no longer; it does not know the
queue; its copy of a record is damaged), is avoided for ``follower_failure_backoff_ms``
and those queues are asked again from the leader, at the same offsets. A leader's
answer with ``suggest_follower`` (this consumer is far behind) moves the group's pulls
to a follower for ``follower_read_hold_ms``.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from clmq.common import Record, collector_paused
from clmq.protocol import FetchResult, ProtocolError, PullStatus, RequestCode, RowError, decode_records

from .._routes import MessageQueue, ReadRouter
from ._ready import Picked, ReadyQueues
from ._requests import NET_ERRORS, Requests
from ._start_offset import OffsetLookups
from ._state import Batch, ConsumerState, DamagedQueueError, QueueState

log = logging.getLogger("clmq.consumer")


class Fetcher:
    """Fetches the consumer's assigned queues into ``state.prefetch``: per broker a loop
    of data requests and one of watches, and the look-ups of new queues' offsets;
    requests go where ``reads`` says (the group's leader or a follower)."""

    def __init__(self, state: ConsumerState, requests: Requests, reads: ReadRouter, nursery: trio.Nursery) -> None:
        self.state = state
        self.options = state.options
        self.requests = requests
        self.reads = reads
        self._nursery = nursery
        self._loops: set[str] = set()
        self.ready = ReadyQueues(state)
        self.lookups = OffsetLookups(state, requests, self.ready)

    def add(self, mq: MessageQueue, st: QueueState) -> None:
        """Start reading ``mq``: look up its offset (unless ``st`` knows it: a queue
        that moved to its group's new leader), then include it in fetches."""
        self.add_many([(mq, st)])

    def add_many(self, queues: Picked) -> None:
        """:meth:`add` for each queue, the loops of their brokers woken once (a consumer
        takes 65,536 queues at its start)."""
        addrs: set[str] = set()
        for mq, st in queues:
            if st.offset is None:
                self.lookups.add(mq, st)
            else:
                self.ready.put(mq, st)
            addrs.add(mq.addr)
        for addr in addrs:
            if addr not in self._loops:
                self._loops.add(addr)
                self.lookups.open(addr)
                self._nursery.start_soon(self._loop, addr, False)
                self._nursery.start_soon(self._loop, addr, True)
                self._nursery.start_soon(self.lookups.lookup_loop, addr)
            self.lookups.wake(addr)
            self.ready.wake(addr)

    async def _loop(self, addr: str, idle: bool) -> None:
        """Data requests (``idle`` False) or watch requests to one broker, up to
        ``fetches_in_flight`` and ``watches_in_flight`` at a time. Queues that turn idle
        while watches are in flight get a watch of their own at once: waiting for a
        slot would leave their new messages unseen for up to ``pull_wait_ms``."""
        slots = trio.Semaphore(self.options.watches_in_flight if idle else self.options.fetches_in_flight)
        wait_ms = self.options.pull_wait_ms if idle else 0
        cap = self.options.watch_max_bytes if idle else self.options.fetch_max_bytes
        async with trio.open_nursery() as nursery:
            while True:
                await slots.acquire()
                while True:
                    event = self.ready.waiter(addr, idle)  # before picking: no lost wake-up
                    picked = self.ready.pick(addr, idle)
                    if picked:
                        break
                    await event.wait()
                # Picked first: a reservation held while waiting for queues would keep
                # watches from the budget. Watches reserve nothing: they wait up to
                # pull_wait_ms, and 64 of them holding reservations kept data out.
                max_bytes = cap if idle else await self.state.prefetch.reserve(cap)
                nursery.start_soon(self._fetch, addr, picked, slots, wait_ms, max_bytes)

    async def _fetch(
        self,
        addr: str,
        picked: Picked,
        slots: trio.Semaphore,
        wait_ms: int,
        max_bytes: int,
    ) -> None:
        skipped: set[MessageQueue] | None = None  # None: all of them, until an answer says otherwise
        try:
            fields = self._request_fields(picked, wait_ms, max_bytes)
            target = self.reads.target(picked[0][0])  # the group's leader (addr) or a follower
            try:
                reply = await self.requests.request(
                    target, RequestCode.PULL_MESSAGES, fields, wait_ms + self.options.request_timeout_ms
                )
            except NET_ERRORS as e:
                log.debug("consumer %s: fetch from %s failed: %s", self.state.client_id, target, e)
                if target == addr:  # the group's leader: it may have moved
                    self.state.rebalance_soon()
                    await trio.sleep(0.2)
                else:  # the leader serves meanwhile, at once
                    self._follower_failed(target, str(e))
                return
            results = _results(target, reply.fields.get("results"), len(picked))
            if target != addr:
                results = self._follower_misses(target, picked, results)
            elif reply.fields.get("suggest_follower") is True:
                self._hinted(picked[0][0])
            skipped = {mq for (mq, _st), r in zip(picked, results) if r.status is SKIPPED}
            body = reply.body
            if not wait_ms:  # watch answers are mostly idle queues: they say nothing of density
                self.ready.learn(addr, results, int(reply.fields.get("count", 0)))
            elif not self.state.prefetch.fits(len(body)):
                results, body = self._no_room(picked, results), b""
            self._deliver(addr, picked, results, body)
        finally:
            self.ready.put_back(picked, skipped)
            if not wait_ms:
                self.state.prefetch.release(max_bytes)
            slots.release()
            self.ready.wake(addr)

    def _request_fields(self, picked: Picked, wait_ms: int, max_bytes: int) -> dict[str, Any]:
        """A PULL_MESSAGES request's fields. FetchAsk.row's wire rows are built inline: a
        sparse fetch asks about 1,024 queues for a few messages each, and two calls per
        queue cost more than their decode. (A picked queue's offset is known: picking
        follows the look-up.)"""
        tags = {topic: flt.tags for topic, flt in self.state.filters.items()}
        with collector_paused():
            asks = [[mq.topic, mq.queue_id, st.offset, tags[mq.topic]] for mq, st in picked]
        return {
            "queues": asks,
            "max_messages": self.options.fetch_max_messages,
            "max_per_queue": self.options.pull_batch,
            "max_wait_ms": wait_ms,
            "max_bytes": max_bytes,
        }

    def _no_room(self, picked: Picked, results: list[FetchResult]) -> list[FetchResult]:
        """A watch answer with records while the prefetch buffer is full: its queues
        are not idle any more (data requests read them, at the same offsets, once
        there is room) and its records are dropped, so the bound holds."""
        out = list(results)
        for i, ((_mq, st), row) in enumerate(zip(picked, results)):
            if row.message_count or row.status in _READ:
                st.idle = False
                out[i] = FetchResult.skipped(st.known_offset())
        return out

    def _follower_failed(self, addr: str, why: str) -> None:
        log.info(
            "consumer %s: not pulling from follower %s for %d ms (reading from the leader): %s",
            self.state.client_id,
            addr,
            self.options.follower_failure_backoff_ms,
            why,
        )
        self.reads.failed(addr)

    def _follower_misses(self, addr: str, picked: Picked, results: list[FetchResult]) -> list[FetchResult]:
        """A follower's answer, with the queues it could not serve as the leader would
        turned SKIPPED (asked again, from the leader): an offset past what it holds (it
        lags, and the offset came from the leader), below its log start, a queue it does
        not know yet, a record damaged on its disk. Moving the offset to where the
        follower is would read again (or skip) what the leader has."""
        missed = [i for i, r in enumerate(results) if r.status in _FOLLOWER_MISSES]
        if not missed:
            return results
        mq, first = picked[missed[0]][0], results[missed[0]]
        self._follower_failed(
            addr,
            f"{mq.topic}/{mq.queue_id} at offset {picked[missed[0]][1].known_offset()}: "
            f"{first.status.value} {first.error}".rstrip(),
        )
        out = list(results)
        for i in missed:
            out[i] = results[i]._replace(status=PullStatus.SKIPPED, next_offset=picked[i][1].known_offset())
        return out

    def _hinted(self, mq: MessageQueue) -> None:
        """The leader says this consumer is far behind: read the group from a follower."""
        if not self.reads.reading_from_follower(mq.broker_name) and self.reads.hinted(mq.broker_name):
            log.info(
                "consumer %s: %s suggests reading from a follower: pulling %s from one for %d ms",
                self.state.client_id,
                mq.addr,
                mq.broker_name,
                self.options.follower_read_hold_ms,
            )

    def _deliver(self, addr: str, picked: Picked, results: list[FetchResult], body: bytes) -> None:
        # One decode for the whole answer: with thousands of queues each holds a few
        # records, and a decode call per queue would cost more than its records.
        with collector_paused():
            records = decode_records(body, f"fetch from {addr}") if body else []
            self._buffer(addr, picked, results, records)

    def _buffer(self, addr: str, picked: Picked, results: list[FetchResult], records: list[Record]) -> None:
        """Each queue's share of ``records`` buffered as its batch, its state moved on."""
        at = 0
        state = self.state
        put = state.prefetch.put
        for (mq, st), row in zip(picked, results):
            status, nxt, count = row.status, row.next_offset, row.message_count
            mine, at = records[at : at + count], at + count
            if state.assigned.get(mq) is not st or st.stopped:
                continue  # given up or stopped meanwhile (a stopped queue is read again from st.offset)
            if status is PullStatus.CORRUPT:
                self._damaged(mq, st, row)
                continue
            if status in _READ and mq in state.errors:
                log.info("consumer %s: %s/%d reads again", state.client_id, mq.topic, mq.queue_id)
                del state.errors[mq]
            if status is not PullStatus.SKIPPED:
                st.idle = status in _NOTHING_THERE or _caught_up(row)
            if status in _OUT_OF_RANGE:  # never for an offset assigned but not yet visible (the broker waits)
                log.warning(
                    "consumer %s: offset %d of %s/%d is %s; moving to %d",
                    state.client_id,
                    st.offset,
                    mq.topic,
                    mq.queue_id,
                    status.value.lower().replace("_", " "),
                    nxt,
                )
            elif status in _NOT_READ:
                continue
            if mine and not _in_place(mine, mq):
                raise ProtocolError(f"fetch from {addr}: records of {mq.topic}/{mq.queue_id} are out of place")
            flt = state.filters[mq.topic]
            if flt.tags is not None:  # the broker filtered by tag hash; collisions are dropped here
                mine = [r for r in mine if flt.matches(r.tags)]
            # No checkpoint per queue (an answer can hold a few messages of each of
            # thousands): its bytes were reserved before the request was sent.
            put(Batch(mq, st.generation, mine, nxt, row.nbytes))
            st.offset = nxt

    def _damaged(self, mq: MessageQueue, st: QueueState, row: FetchResult) -> None:
        """Report the damaged record (an ERROR line once per queue and offset), pause
        the queue, and ask again after ``damaged_queue_retry_ms``."""
        error = DamagedQueueError(mq, row.next_offset, row.error)
        known = self.state.errors.get(mq)
        if known is None or known.offset != error.offset:
            log.error(
                "consumer %s: not reading past a damaged record; asking again every %d ms: %s",
                self.state.client_id,
                self.options.damaged_queue_retry_ms,
                error,
            )
        self.state.errors[mq] = error
        st.offset, st.idle, st.paused = row.next_offset, False, True
        self._nursery.start_soon(self._resume_later, mq, st)

    async def _resume_later(self, mq: MessageQueue, st: QueueState) -> None:
        await trio.sleep(self.options.damaged_queue_retry_ms / 1000)
        st.paused = False
        if self.state.assigned.get(mq) is st and not st.stopped:
            self.ready.put(mq, st, idle=False)
            self.ready.wake(mq.addr)

    def resume(self, mq: MessageQueue, st: QueueState) -> None:
        """Start fetching a queue state that was made stopped and never given to
        :meth:`add` (a rewound queue waiting out a delay), from ``st.offset``. (A state
        that was fetched before may still be in a request: it is never resumed.)"""
        st.stopped = False
        if self.state.assigned.get(mq) is st:
            st.idle = False  # asked at once: a watch would wait for new messages only
            self.add(mq, st)


SKIPPED = PullStatus.SKIPPED
_NOTHING_THERE = frozenset({PullStatus.NO_MESSAGE, PullStatus.NO_QUEUE})
_OUT_OF_RANGE = frozenset({PullStatus.OFFSET_TOO_SMALL, PullStatus.OFFSET_OVERFLOW})
_NOT_READ = frozenset({PullStatus.NO_MESSAGE, PullStatus.SKIPPED, PullStatus.NO_QUEUE})
_READ = frozenset({PullStatus.FOUND, PullStatus.NO_MATCHED_MESSAGE})
# A follower's rows the leader may answer otherwise (see Fetcher._follower_misses).
_FOLLOWER_MISSES = frozenset(
    {PullStatus.OFFSET_TOO_SMALL, PullStatus.OFFSET_OVERFLOW, PullStatus.NO_QUEUE, PullStatus.CORRUPT}
)


def _in_place(records: list[Record], mq: MessageQueue) -> bool:
    """Whether the first and the last of a queue's records are of that queue (checked
    without a generator: a sparse answer holds 1,024 queues' records)."""
    first, last = records[0], records[-1]
    return first.topic == last.topic == mq.topic and first.queue_id == last.queue_id == mq.queue_id


def _caught_up(row: FetchResult) -> bool:
    """An answer with messages that read up to the queue's max offset (the broker's high
    watermark): the queue is watched next, not asked once more for nothing. For a
    consumer at the head of its queues this halves the requests per arrival."""
    return row.status in _READ and 0 <= row.max_offset <= row.next_offset


def _results(addr: str, rows: Any, asked: int) -> list[FetchResult]:
    """The typed rows of a fetch answer: one per queue asked, each well formed."""
    if not isinstance(rows, list) or len(rows) != asked:
        raise ProtocolError(f"fetch from {addr}: {asked} queues asked, the answer has no row for each")
    try:
        return [FetchResult.from_wire(row) for row in rows]
    except RowError as e:
        raise ProtocolError(f"fetch from {addr}: {e}") from None
