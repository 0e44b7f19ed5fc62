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

import gc
import logging
from collections import OrderedDict, defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import trio

from clmq.common import ClientError, Record
from clmq.protocol import FetchAsk, FetchResult, Frame, ProtocolError, PullStatus, RequestCode, RowError, decode_records

from .._routes import MessageQueue, ReadRouter
from ._options import ConsumerOptions, TagFilter
from ._start_offset import retrying, start_offset, start_offset_now

log = logging.getLogger("clmq.consumer")

MIN_FETCH_QUEUES = 16  # a request covers at least this many queues (when it has them)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while an answer is decoded (and left as
    the application had it). Decoding makes thousands of records that cannot form
    cycles, and the collector, run every 700 new objects, kept scanning everything
    alive: the consumer's state for its queues and the records still buffered. With
    10,000 queues assigned that was a sixth of the consumer's CPU and the whole gap
    between its 1-queue and 10,000-queue rates (2.33 against 2.02 us per 1 KiB
    message). The objects are counted all the same: the collector runs once after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(slots=True)
class QueueState:
    """A queue assigned to this consumer; given up, it is no longer ``assigned[mq]``
    (every step that awaits checks that before using the answer)."""

    generation: int
    offset: int | None = None  # next offset to read; None until looked up
    idle: bool = False  # nothing more to read at the look-up or the last answer: watched, not fetched
    paused: bool = False  # its next record is damaged: asked again only after damaged_queue_retry_ms
    # Neither fetched nor handed out by receive() until Fetcher.resume (orderly: being
    # released, or waiting to redeliver a failed message in place).
    stopped: bool = False

    def known_offset(self) -> int:
        """The next offset, for a queue that is fetched (only once it is known)."""
        assert self.offset is not None, "a queue is fetched only after its start offset is looked up"
        return self.offset


class DamagedQueueError(ClientError):
    """A queue whose record at ``offset`` is damaged on its broker (the text is the
    broker's: file, log offset, which check failed). The consumer does not read past
    it; it asks again every ``damaged_queue_retry_ms``."""

    def __init__(self, queue: MessageQueue, offset: int, text: str) -> None:
        super().__init__(
            f"{queue.topic}/{queue.queue_id} on {queue.broker_name} ({queue.addr}), offset {offset}: {text}"
        )
        self.queue = queue
        self.offset = offset
        self.text = text


@dataclass(slots=True)
class Batch:
    mq: MessageQueue
    generation: int
    records: list[Record]
    next_offset: int
    nbytes: int = 0  # the records' size on the wire (what the prefetch bound counts)


class PrefetchBuffer:
    """Fetched batches not yet returned by ``receive()``, and the byte budget of the
    fetches: a request reserves the bytes its answer may bring (its ``max_bytes``)
    before it is sent, and gives the reservation back once its batches are buffered.
    Buffered and reserved bytes together stay within ``max_bytes``; when nothing is
    held, one request may reserve its whole cap, so that a message larger than the
    bound is still read (alone)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"prefetch_max_bytes={max_bytes}: at least 1")
        self.max_bytes = max_bytes
        self.batches: deque[Batch] = deque()
        self.buffered_bytes = 0
        self.reserved_bytes = 0
        self._arrived = trio.Event()
        self._room = trio.Event()

    def _grant(self, cap: int) -> int:
        held = self.buffered_bytes + self.reserved_bytes
        if self.max_bytes - held >= cap:
            return cap
        return min(cap, self.max_bytes) if held == 0 else 0

    async def reserve(self, cap: int) -> int:
        """Reserve up to ``cap`` bytes (waits for room); the bytes reserved."""
        while not (granted := self._grant(cap)):
            await self._room.wait()
        self.reserved_bytes += granted
        return granted

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more (an answer that reserved nothing) keep within the bound."""
        held = self.buffered_bytes + self.reserved_bytes
        return held == 0 or held + nbytes <= self.max_bytes

    def release(self, reserved: int) -> None:
        self.reserved_bytes -= reserved
        self._wake_room()

    def put(self, batch: Batch) -> None:
        self.batches.append(batch)
        self.buffered_bytes += batch.nbytes
        if not self._arrived.is_set():
            self._arrived.set()

    def pop(self) -> Batch:
        batch = self.batches.popleft()
        self.buffered_bytes -= batch.nbytes
        self._wake_room()
        return batch

    async def arrival(self) -> None:
        """Wait until some batch is buffered."""
        if not self.batches:
            if self._arrived.is_set():
                self._arrived = trio.Event()
            await self._arrived.wait()

    def _wake_room(self) -> None:
        room, self._room = self._room, trio.Event()  # waiters wait on the current one: none is left behind
        room.set()


class PendingBatches(list[Batch]):
    """The batches ``receive()`` returned that are not acknowledged yet, in order, and
    a wake-up for whoever waits for them to change (an orderly consumer releasing a
    queue waits until its batch being processed is acknowledged)."""

    def __init__(self) -> None:
        super().__init__()
        self._changed: trio.Event | None = None

    def take(self) -> list[Batch]:
        """All of them, leaving none pending (acknowledged)."""
        taken = list(self)
        self.clear()
        self.changed()
        return taken

    def changed(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_changed(self) -> None:
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    def of(self, mq: MessageQueue) -> bool:
        """Whether a batch of ``mq`` is pending."""
        return any(b.mq == mq for b in self)

    def drop(self, mq: MessageQueue) -> None:
        """Forget ``mq``'s batches: never acknowledged."""
        if self.of(mq):
            self[:] = [b for b in self if b.mq != mq]
            self.changed()

    def where(self, records: Sequence[Record], *, strict: bool = True) -> dict[int, MessageQueue]:
        """``id(record)`` -> its queue, for pending records. ``strict``: a record not
        pending is a ``ValueError``; else it is left out."""
        where = {id(r): batch.mq for batch in self for r in batch.records}
        if strict:
            for r in records:
                if id(r) not in where:
                    raise ValueError(
                        f"{r.topic}/{r.queue_id} offset {r.queue_offset} is not among the messages the "
                        "last receive() returned (or they were acknowledged since)"
                    )
        return {id(r): where[id(r)] for r in records if id(r) in where}


class FetchHost(Protocol):
    """What a fetcher needs of the consumer it reads for (the consumer provides it)."""

    options: ConsumerOptions
    group: str
    client_id: str
    assigned: dict[MessageQueue, QueueState]  # a queue given up is no longer in here
    filters: dict[str, TagFilter]
    processed: dict[MessageQueue, int]  # next offset to commit per queue
    errors: dict[MessageQueue, DamagedQueueError]  # queues stopped at a damaged record, now
    net_errors: tuple[type[BaseException], ...]
    reads: ReadRouter  # where pulls go: the group's leader (MessageQueue.addr) or a follower

    async def request(self, addr: str, code: int, fields: dict[str, Any], timeout_ms: float | None = None) -> Frame: ...

    prefetch: PrefetchBuffer  # batches for receive(); the byte budget of requests

    def route_failed(self, addr: str) -> None: ...


class Fetcher:
    def __init__(self, consumer: FetchHost, nursery: trio.Nursery) -> None:
        self.c = consumer
        self.options = consumer.options
        self._nursery = nursery
        self._loops: set[str] = set()
        self._wakeups: dict[tuple[str, bool], trio.Event] = {}  # (broker, idle)
        self._to_look_up: dict[str, list[tuple[MessageQueue, QueueState]]] = {}
        self._lookup_wakeups: dict[str, trio.Event] = {}
        self._density: dict[str, float] = {}  # per broker: messages per queue visited, recently
        # Queues ready to be asked about (offset known, in no request), per (broker, idle),
        # next first: picking costs what it takes, not a walk over 10,000 queues.
        self._ready: defaultdict[tuple[str, bool], OrderedDict[MessageQueue, QueueState]] = defaultdict(OrderedDict)

    def add(self, mq: MessageQueue, state: QueueState) -> None:
        """Start reading ``mq``: look up its offset (unless ``state`` knows it: a queue
        that moved to its group's new leader), then include it in fetches."""
        if state.offset is None:
            self._to_look_up.setdefault(mq.addr, []).append((mq, state))
        else:
            self._ready[(mq.addr, state.idle)][mq] = state
        if mq.addr not in self._loops:
            self._loops.add(mq.addr)
            self._lookup_wakeups[mq.addr] = trio.Event()
            self._nursery.start_soon(self._loop, mq.addr, False)
            self._nursery.start_soon(self._loop, mq.addr, True)
            self._nursery.start_soon(self._lookup_loop, mq.addr)
        self._lookup_wakeups[mq.addr].set()
        self.wake(mq.addr)

    def wake(self, addr: str) -> None:
        for idle in (False, True):
            event = self._wakeups.get((addr, idle))
            if event is not None:
                event.set()

    async def _lookup_loop(self, addr: str) -> None:
        """Start offsets of newly assigned queues, up to ``fetch_queues`` per request and
        ``fetches_in_flight`` requests at a time: a consumer of 10,000 queues asked for
        them one request after another, and its first fetch waited for the round trips."""
        slots = trio.Semaphore(self.options.fetches_in_flight)

        async def one(batch: list[tuple[MessageQueue, QueueState]]) -> None:
            try:
                await self._look_up(addr, batch)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            while True:
                await self._lookup_wakeups[addr].wait()
                self._lookup_wakeups[addr] = trio.Event()
                while self._to_look_up.get(addr):
                    pending = self._to_look_up[addr]
                    n = self.options.fetch_queues
                    batch, self._to_look_up[addr] = pending[:n], pending[n:]
                    batch = [(mq, st) for mq, st in batch if self.c.assigned.get(mq) is st]
                    if batch:
                        await slots.acquire()
                        nursery.start_soon(one, batch)

    async def _look_up(self, addr: str, batch: list[tuple[MessageQueue, QueueState]]) -> None:
        fields = {"group": self.c.group, "queues": [[mq.topic, mq.queue_id] for mq, _ in batch]}

        async def ask() -> Frame | None:
            if not any(self.c.assigned.get(mq) is st for mq, st in batch):
                return None  # given up meanwhile (e.g. moved to a new leader): stop asking this broker
            return await self.c.request(addr, RequestCode.QUERY_QUEUE_OFFSETS, fields)

        reply = await retrying(self.c, ask)
        if reply is None:
            return
        for (mq, st), row in zip(batch, reply.fields["offsets"]):
            if row is None or self.c.assigned.get(mq) is not st:
                continue  # the queue is gone (a rebalance will notice) or was given up
            start = start_offset_now(self.options, *row)  # the usual case: no request, no await
            st.offset = start if start is not None else await start_offset(self.c, mq, *row)
            self.c.processed.setdefault(mq, st.offset)
            # Nothing to read yet: straight to the watches. Asking first would cost a
            # round of asks that all come back empty (8,000 of them in the benchmark).
            # Beyond the max: a data ask, which answers at once either NO_MESSAGE (the
            # offset is assigned but not dispatched yet: then watched) or OFFSET_OVERFLOW
            # (past everything the log assigned: then moved back to the max).
            st.idle = st.offset == row[2]
            self._ready[(addr, st.idle)][mq] = st
        self.wake(addr)

    def _pick(self, addr: str, idle: bool) -> list[tuple[MessageQueue, QueueState]]:
        """The next queues to fetch (``idle``: to watch). A data request takes at most a
        share of the broker's queues, so that ``fetches_in_flight`` requests cover
        disjoint sets and overlap (the broker reads one while the client decodes
        another) instead of one request taking them all."""
        cap = self.options.fetch_queues
        if not idle:
            share = -(-len(self.c.assigned) // self.options.fetches_in_flight)  # all brokers': a cap, not a quota
            cap = min(cap, max(MIN_FETCH_QUEUES, share))
            density = self._density.get(addr, 0.0)
            if density > 0:  # ask about as many queues as the answer can hold messages of (twice, for the skew)
                cap = min(cap, max(MIN_FETCH_QUEUES, int(2 * self.options.fetch_max_messages / density)))
        ready = self._ready[(addr, idle)]
        picked: list[tuple[MessageQueue, QueueState]] = []
        while ready and len(picked) < cap:
            mq, st = ready.popitem(last=False)
            if self.c.assigned.get(mq) is st and not st.stopped:  # else given up or stopped meanwhile: forget it
                picked.append((mq, st))
        return picked

    def _put_back(self, picked: list[tuple[MessageQueue, QueueState]], skipped: set[MessageQueue]) -> None:
        """Queues an answer read go to the back of their line (idle or not, as it said);
        those it did not reach (or all, if the request failed) keep their place in front."""
        for mq, st in reversed(picked):
            if mq in skipped and self.c.assigned.get(mq) is st:
                ready = self._ready[(mq.addr, st.idle)]
                ready[mq] = st
                ready.move_to_end(mq, last=False)
        for mq, st in picked:
            if mq not in skipped and self.c.assigned.get(mq) is st and not st.paused and not st.stopped:
                self._ready[(mq.addr, st.idle)][mq] = st

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
                    self._wakeups[(addr, idle)] = event = trio.Event()  # before picking: no lost wake-up
                    picked = self._pick(addr, idle)
                    if picked:
                        break
                    await event.wait()
                # Picked first: a reservation held while waiting for queues would keep
                # watches from the budget. Watches reserve nothing: they wait up to
                # pull_wait_ms, and 64 of them holding reservations kept data out.
                max_bytes = cap if idle else await self.c.prefetch.reserve(cap)
                nursery.start_soon(self._fetch, addr, picked, slots, wait_ms, max_bytes)

    async def _fetch(
        self,
        addr: str,
        picked: list[tuple[MessageQueue, QueueState]],
        slots: trio.Semaphore,
        wait_ms: int,
        max_bytes: int,
    ) -> None:
        skipped = {mq for mq, _st in picked}  # until an answer says otherwise
        try:
            filters = self.c.filters
            asks = [FetchAsk.row(mq.topic, mq.queue_id, st.known_offset(), filters[mq.topic].tags) for mq, st in picked]
            fields = {
                "queues": asks,
                "max_messages": self.options.fetch_max_messages,
                "max_per_queue": self.options.pull_batch,
                "max_wait_ms": wait_ms,
                "max_bytes": max_bytes,
            }
            target = self.c.reads.target(picked[0][0])  # the group's leader (addr) or a follower
            try:
                reply = await self.c.request(
                    target, RequestCode.PULL_MESSAGES, fields, wait_ms + self.options.request_timeout_ms
                )
            except self.c.net_errors as e:
                log.debug("consumer %s: fetch from %s failed: %s", self.c.client_id, target, e)
                if target == addr:  # the group's leader: it may have moved
                    self.c.route_failed(addr)
                    await trio.sleep(0.2)
                else:  # the leader serves meanwhile, at once
                    self._follower_failed(target, str(e))
                return
            results = _results(target, reply.fields.get("results"), len(picked))
            if target != addr:
                results = self._follower_misses(target, picked, results)
            elif reply.fields.get("suggest_follower") is True:
                self._hinted(picked[0][0])
            skipped = {mq for (mq, _st), r in zip(picked, results) if r.status is PullStatus.SKIPPED}
            body = reply.body
            if not wait_ms:  # watch answers are mostly idle queues: they say nothing of density
                self._learn(addr, results, int(reply.fields.get("count", 0)))
            elif not self.c.prefetch.fits(len(body)):
                results, body = self._no_room(picked, results), b""
            self._deliver(addr, picked, results, body)
        finally:
            self._put_back(picked, skipped)
            if not wait_ms:
                self.c.prefetch.release(max_bytes)
            slots.release()
            self.wake(addr)

    def _no_room(self, picked: list[tuple[MessageQueue, QueueState]], results: list[FetchResult]) -> list[FetchResult]:
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
            self.c.client_id,
            addr,
            self.options.follower_failure_backoff_ms,
            why,
        )
        self.c.reads.failed(addr)

    def _follower_misses(
        self, addr: str, picked: list[tuple[MessageQueue, QueueState]], results: list[FetchResult]
    ) -> list[FetchResult]:
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
        if not self.c.reads.reading_from_follower(mq.broker_name) and self.c.reads.hinted(mq.broker_name):
            log.info(
                "consumer %s: %s suggests reading from a follower: pulling %s from one for %d ms",
                self.c.client_id,
                mq.addr,
                mq.broker_name,
                self.options.follower_read_hold_ms,
            )

    def _learn(self, addr: str, results: list[FetchResult], found: int) -> None:
        """Messages per queue the broker got to in data answers (an average over recent
        ones). Asking many more queues than an answer can fill makes both sides walk
        asks that come back SKIPPED."""
        visited = sum(1 for r in results if r.status is not PullStatus.SKIPPED)
        if visited:
            sample = found / visited
            self._density[addr] = 0.7 * self._density.get(addr, sample) + 0.3 * sample

    def _deliver(
        self, addr: str, picked: list[tuple[MessageQueue, QueueState]], results: list[FetchResult], body: bytes
    ) -> None:
        # One decode for the whole answer: with thousands of queues each holds a few
        # records, and a decode call per queue would cost more than its records.
        with collector_paused():
            records = decode_records(body, f"fetch from {addr}") if body else []
        at = 0
        put = self.c.prefetch.put
        for (mq, st), row in zip(picked, results):
            status, nxt, count = row.status, row.next_offset, row.message_count
            mine, at = records[at : at + count], at + count
            if self.c.assigned.get(mq) is not st or st.stopped:
                continue  # given up or stopped meanwhile (a stopped queue is read again from st.offset)
            if status is PullStatus.CORRUPT:
                self._damaged(mq, st, row)
                continue
            if status in _READ and mq in self.c.errors:
                log.info("consumer %s: %s/%d reads again", self.c.client_id, mq.topic, mq.queue_id)
                del self.c.errors[mq]
            if status is not PullStatus.SKIPPED:
                st.idle = status in _NOTHING_THERE or _caught_up(row)
            if status in _OUT_OF_RANGE:  # never for an offset assigned but not yet visible (the broker waits)
                log.warning(
                    "consumer %s: offset %d of %s/%d is %s; moving to %d",
                    self.c.client_id,
                    st.offset,
                    mq.topic,
                    mq.queue_id,
                    status.value.lower().replace("_", " "),
                    nxt,
                )
            elif status in _NOT_READ:
                continue
            if any(r.topic != mq.topic or r.queue_id != mq.queue_id for r in mine[:1] + mine[-1:]):
                raise ProtocolError(f"fetch from {addr}: records of {mq.topic}/{mq.queue_id} are out of place")
            flt = self.c.filters[mq.topic]
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
        known = self.c.errors.get(mq)
        if known is None or known.offset != error.offset:
            log.error(
                "consumer %s: not reading past a damaged record; asking again every %d ms: %s",
                self.c.client_id,
                self.options.damaged_queue_retry_ms,
                error,
            )
        self.c.errors[mq] = error
        st.offset, st.idle, st.paused = row.next_offset, False, True
        self._nursery.start_soon(self._resume_later, mq, st)

    async def _resume_later(self, mq: MessageQueue, st: QueueState) -> None:
        await trio.sleep(self.options.damaged_queue_retry_ms / 1000)
        st.paused = False
        if self.c.assigned.get(mq) is st and not st.stopped:
            self._ready[(mq.addr, False)][mq] = st
            self.wake(mq.addr)

    def resume(self, mq: MessageQueue, st: QueueState) -> None:
        """Start fetching a queue state that was made stopped and never given to
        :meth:`add` (a rewound queue waiting out a delay), from ``st.offset``. (A state
        that was fetched before may still be in a request: it is never resumed.)"""
        st.stopped = False
        if self.c.assigned.get(mq) is st:
            st.idle = False  # asked at once: a watch would wait for new messages only
            self.add(mq, st)


_NOTHING_THERE = frozenset({PullStatus.NO_MESSAGE, PullStatus.NO_QUEUE})
_OUT_OF_RANGE = frozenset({PullStatus.OFFSET_TOO_SMALL, PullStatus.OFFSET_OVERFLOW})
_NOT_READ = frozenset({PullStatus.NO_MESSAGE, PullStatus.SKIPPED, PullStatus.NO_QUEUE})
_READ = frozenset({PullStatus.FOUND, PullStatus.NO_MATCHED_MESSAGE})
# A follower's rows the leader may answer otherwise (see Fetcher._follower_misses).
_FOLLOWER_MISSES = frozenset(
    {PullStatus.OFFSET_TOO_SMALL, PullStatus.OFFSET_OVERFLOW, PullStatus.NO_QUEUE, PullStatus.CORRUPT}
)


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
