"""Where a consumer starts reading a queue it was given: the group's committed offset
(clustering), else ``start_from``: ``earliest``, ``latest`` or a timestamp in ms, which
the queue's broker searches (SEARCH_OFFSET). :class:`OffsetLookups` asks a broker for
many queues' offsets at once (QUERY_QUEUE_OFFSETS)."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, TypeVar

import trio

from clmq.common import collector_paused
from clmq.protocol import Frame, RequestCode

from .._routes import MessageQueue
from ._options import ConsumerOptions
from ._ready import Picked, ReadyQueues
from ._requests import NET_ERRORS, Requests
from ._state import ConsumerState, QueueState

log = logging.getLogger("clmq.consumer")

T = TypeVar("T")
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 2.0  # back-off of a look-up that failed


async def retrying(state: ConsumerState, fn: Callable[[], Awaitable[T]]) -> T:
    """``fn()``, again after each network failure (growing back-off) until it answers."""
    delay = RETRY_FIRST_S
    while True:
        try:
            return await fn()
        except NET_ERRORS as e:
            log.debug("consumer %s: %s; retrying in %.2f s", state.client_id, e, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)


def start_offset_now(options: ConsumerOptions, committed: int, lo: int, hi: int) -> int | None:
    """:func:`start_offset` when it needs no request (all but timestamps), else None: a
    consumer of 10,000 queues calls it for each, and an await apiece adds up.
    ``committed``: the group's offset (-1: none); ``lo``/``hi``: the queue's min/max."""
    if options.mode == "clustering" and committed >= 0:
        return committed
    start = options.start_from
    if isinstance(start, int) or (isinstance(start, str) and start.isdigit()):
        return None
    return hi if start == "latest" else lo


async def start_offset(requests: Requests, mq: MessageQueue, committed: int, lo: int, hi: int) -> int:
    """Where to start reading ``mq``: :func:`start_offset_now`, else the offset of the
    first message stored at or after the ``start_from`` timestamp."""
    state = requests.state
    now = start_offset_now(state.options, committed, lo, hi)
    if now is not None:
        return now
    q = {"topic": mq.topic, "queue_id": mq.queue_id, "timestamp_ms": int(state.options.start_from)}
    reply = await retrying(state, lambda: requests.request(mq.addr, RequestCode.SEARCH_OFFSET, q))
    offset: int = reply.fields["offset"]
    return offset


class OffsetLookups:
    """Start offsets of newly assigned queues, per broker, up to ``fetch_queues`` per
    request and ``fetches_in_flight`` requests at a time: a consumer of 10,000 queues
    asked for them one request after another, and its first fetch waited for the round
    trips. A queue whose offset is known is ready (``ready``) for the fetcher."""

    def __init__(self, state: ConsumerState, requests: Requests, ready: ReadyQueues) -> None:
        self.state = state
        self.options = state.options
        self.requests = requests
        self.ready = ready
        self._to_look_up: dict[str, Picked] = {}
        self._wakeups: dict[str, trio.Event] = {}

    def add(self, mq: MessageQueue, st: QueueState) -> None:
        """Look up where ``mq`` starts (once its broker's loop runs: :meth:`lookup_loop`)."""
        self._to_look_up.setdefault(mq.addr, []).append((mq, st))

    def open(self, addr: str) -> None:
        """Before :meth:`lookup_loop` for ``addr`` starts."""
        self._wakeups[addr] = trio.Event()

    def wake(self, addr: str) -> None:
        self._wakeups[addr].set()

    async def lookup_loop(self, addr: str) -> None:
        """Forever: the look-ups of broker ``addr``'s new queues."""
        slots = trio.Semaphore(self.options.fetches_in_flight)
        assigned = self.state.assigned

        async def one(batch: Picked) -> None:
            try:
                await self._look_up(addr, batch)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            while True:
                await self._wakeups[addr].wait()
                self._wakeups[addr] = trio.Event()
                while self._to_look_up.get(addr):
                    pending = self._to_look_up[addr]
                    n = self.options.fetch_queues
                    batch, self._to_look_up[addr] = pending[:n], pending[n:]
                    batch = [(mq, st) for mq, st in batch if assigned.get(mq) is st]
                    if batch:
                        await slots.acquire()
                        nursery.start_soon(one, batch)

    async def _look_up(self, addr: str, batch: Picked) -> None:
        state, assigned = self.state, self.state.assigned
        fields = {"group": state.group, "queues": [[mq.topic, mq.queue_id] for mq, _ in batch]}

        async def ask() -> Frame | None:
            if not any(assigned.get(mq) is st for mq, st in batch):
                return None  # given up meanwhile (e.g. moved to a new leader): stop asking this broker
            return await self.requests.request(addr, RequestCode.QUERY_QUEUE_OFFSETS, fields)

        reply = await retrying(state, ask)
        if reply is None:
            return
        searched: list[tuple[MessageQueue, QueueState, list[int]]] = []  # start_from a timestamp: a request each
        with collector_paused():  # a state set and a line entry per queue, up to fetch_queues of them
            for (mq, st), row in zip(batch, reply.fields["offsets"]):
                if row is None or assigned.get(mq) is not st:
                    continue  # the queue is gone (a rebalance will notice) or was given up
                start = start_offset_now(self.options, *row)  # the usual case: no request, no await
                if start is None:
                    searched.append((mq, st, row))
                else:
                    self._start(mq, st, start, row[2])
        for mq, st, row in searched:
            start = await start_offset(self.requests, mq, *row)
            if assigned.get(mq) is st:
                self._start(mq, st, start, row[2])
        self.ready.wake(addr)

    def _start(self, mq: MessageQueue, st: QueueState, offset: int, max_offset: int) -> None:
        """``mq`` starts at ``offset``: processed up to it, and ready to be read."""
        st.offset = offset
        self.state.processed.setdefault(mq, offset)
        # Nothing to read yet: straight to the watches. Asking first would cost a
        # round of asks that all come back empty (8,000 of them in the benchmark).
        # Beyond the max: a data ask, which answers at once either NO_MESSAGE (the
        # offset is assigned but not dispatched yet: then watched) or OFFSET_OVERFLOW
        # (past everything the log assigned: then moved back to the max).
        st.idle = offset == max_offset
        self.ready.put(mq, st)
