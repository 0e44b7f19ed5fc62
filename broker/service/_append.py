"""The append lane: produce requests from every connection, appended in arrival order,
several per store call.

Why: one store call per request costs a thread hop and a ``pwrite`` per request, and
work on the event loop's thread holds up every other connection. The lane takes the
raw request bodies in order, and one worker thread appends all that are waiting (up to
``max_group_bytes``) with one ``put_packed``: the bodies are packed messages, turned
into records without being decoded into message objects. A request whose messages are
bad gets its own error; the others are not affected.

A group of at most ``inline_max_bytes`` is appended on the event loop instead: storing
a few small messages takes about 0.1 ms, less than the two thread hops it would cost
(each waits for the GIL), and that is most of a light load's produce latency.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import deque
from typing import Callable, Sequence

import trio

from clmq.broker.store import PutResult, PutStatus, StorageEngine
from clmq.common import Host, Message, PackedMessages, ServiceError

_BAD_INPUT = {
    PutStatus.MESSAGE_TOO_LARGE,
    PutStatus.INVALID_MESSAGE,
    PutStatus.INVALID_TOPIC,
    PutStatus.UNKNOWN_TOPIC,
    PutStatus.INVALID_QUEUE_ID,
    PutStatus.MALFORMED_BATCH,
}


log = logging.getLogger("clmq.broker")


class BusyError(ServiceError):
    """More produce bytes are waiting than ``max_inflight_produce_bytes`` allows."""


class PendingPut:
    """One produce request in the lane: its result once appended. ``done`` (a trio
    Event) is made only when someone waits on it: most puts are answered through
    :meth:`add_done_callback`, and an Event per request costs as much as its answer."""

    __slots__ = ("_event", "body", "born_host", "callbacks", "finished", "messages", "result", "topic")

    def __init__(self, topic: str, body: bytes, born_host: Host, messages: Sequence[Message] | None = None) -> None:
        self.topic = topic
        self.body = body
        # The broker's own appends (timer deliveries, retries): message objects, which
        # keep what a producer's packed batch cannot carry (reconsume_times, born hosts).
        self.messages = messages
        self.born_host = born_host
        self.result: PutResult | None = None
        self.finished = False
        self.callbacks: list[Callable[[PendingPut], None]] | None = None
        self._event: trio.Event | None = None

    @property
    def done(self) -> trio.Event:
        """Set once the put has its result."""
        if self._event is None:
            self._event = trio.Event()
            if self.finished:
                self._event.set()
        return self._event

    def add_done_callback(self, fn: Callable[[PendingPut], None]) -> None:
        """Call ``fn(put)`` on the event loop once the put has its result (at once if it
        has): a waiter without a task of its own (see ``Later.subscribe``)."""
        if self.finished:
            fn(self)
        elif self.callbacks is None:
            self.callbacks = [fn]
        else:
            self.callbacks.append(fn)

    def _complete(self) -> None:
        self.finished = True
        if self._event is not None:
            self._event.set()
        callbacks, self.callbacks = self.callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # one waiter's bug must not keep the others (or the lane) from going on
                log.exception("a produce completion callback failed")


class AppendLane:
    def __init__(
        self,
        store: StorageEngine,
        max_inflight_bytes: int,
        max_group_bytes: int = 4 << 20,
        inline_max_bytes: int = 64 << 10,
    ) -> None:
        self.store = store
        self.inline_max_bytes = inline_max_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.max_group_bytes = max_group_bytes
        self._queue: deque[PendingPut] = deque()
        self._queued_bytes = 0
        self._wakeup = trio.Event()
        self._drained = trio.Event()  # set whenever nothing is queued or being appended
        self.stopped = False  # the lane's task ended: puts are answered STORE_CLOSED at once
        self.durable = DurableWaiters(store)  # sync flush: answers wait here for their group commit

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def submit(self, topic: str, body: bytes, born_host: Host, messages: Sequence[Message] | None = None) -> PendingPut:
        """Queue a request (synchronous, so callers keep their order); raises BusyError.
        ``messages``: the broker's own, as objects (``body`` is then their encoding, for
        the byte count)."""
        if self._queued_bytes and self._queued_bytes + len(body) > self.max_inflight_bytes:
            raise BusyError(
                f"broker busy: {self._queued_bytes:,} bytes waiting to be stored, "
                f"max_inflight_produce_bytes={self.max_inflight_bytes:,}; retry later"
            )
        put = PendingPut(topic, body, born_host, messages)
        if self.stopped:  # the lane's task ended: nobody would ever append it
            put.result = PutResult(PutStatus.STORE_CLOSED, "the broker is stopping: not appended")
            put._complete()
            return put
        self._queue.append(put)
        self._queued_bytes += len(body)
        self._wakeup.set()
        return put

    async def wait_idle(self) -> None:
        """Return once nothing is queued or being appended (a leader stepping down lets
        the appends it accepted finish before its log may be cut)."""
        while self._queued_bytes:
            await self._drained.wait()

    async def append_loop(self) -> None:
        """The lane's task: forever take what is waiting and append it. When it stops
        (cancelled: the broker stops), what it never took is answered at once."""
        try:
            await self._append_forever()
        finally:
            self._stop()

    def _stop(self) -> None:
        """Answer STORE_CLOSED to every put waiting, and to any submitted from now on:
        a waiter must never wait for a lane that is gone (the POP service waits shielded)."""
        self.stopped = True
        while self._queue:
            put = self._queue.popleft()
            self._queued_bytes -= len(put.body)
            put.result = PutResult(PutStatus.STORE_CLOSED, "the broker is stopping: not appended")
            put._complete()
        self._drained.set()

    async def _append_forever(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            while self._queue:
                group, size = self._take()
                try:
                    if size <= self.inline_max_bytes:
                        self._append_group(group)
                        await trio.lowlevel.checkpoint()
                    else:
                        await trio.to_thread.run_sync(self._append_group, group)
                finally:
                    for put in group:
                        self._queued_bytes -= len(put.body)
                        if put.result is None:
                            put.result = PutResult(PutStatus.IO_ERROR, "the append was interrupted")
                        put._complete()
                    if not self._queued_bytes:
                        self._drained.set()
                        self._drained = trio.Event()

    def _take(self) -> tuple[list[PendingPut], int]:
        """The next group, in arrival order: producers' puts up to ``max_group_bytes``
        together, or one of the broker's own (timer deliveries, retries) alone, so that
        those never take group commit from the producers' puts around them."""
        group = [self._queue.popleft()]
        size = len(group[0].body)
        if group[0].messages is not None:
            return group, size
        while (
            self._queue and self._queue[0].messages is None and size + len(self._queue[0].body) <= self.max_group_bytes
        ):
            put = self._queue.popleft()
            group.append(put)
            size += len(put.body)
        return group, size

    def _append_group(self, group: list[PendingPut]) -> None:
        """Append every request's messages together (in a worker thread, or on the event
        loop for a small group)."""
        messages = group[0].messages
        if messages is not None:  # the broker's own append (as Message objects): always alone
            group[0].result = self.store.put_batch(messages, wait_durable=False)
            return
        batches = [PackedMessages(put.topic, put.body, put.born_host) for put in group]
        result = self.store.put_packed(batches, wait_durable=False)
        if result.status in _BAD_INPUT and len(group) > 1:  # someone's bad messages: each on its own
            for put, batch in zip(group, batches):
                put.result = self.store.put_packed([batch], wait_durable=False)
        elif result.ok:
            for put, own in zip(group, result.split()):
                put.result = own
        else:
            for put in group:
                put.result = result


class _Callback:
    """Sync-flush waiters without a task: each ``fn(durable)`` once released or timed
    out. The answers of one append group wait for the same end offset: they share one
    entry (its heap places and deadline are the first one's, taken in the same step)."""

    __slots__ = ("deadline", "done", "end_offset", "fns")

    def __init__(self, end_offset: int, deadline: float, fn: Callable[[bool], None]) -> None:
        self.end_offset = end_offset
        self.deadline = deadline
        self.fns = [fn]
        self.done = False


class DurableWaiters:
    """Sync flush: requests waiting until their bytes are fsynced (group commit), woken
    together. Why: a store callback and a hop onto the event loop per request (each hop
    writes the loop's wake-up socket) cost more than the request's append; here one
    callback is registered at a time, for the lowest offset waited for, and each group
    commit that reaches it wakes every waiter it covers with one hop. A waiter is a
    task (:meth:`wait`) or a callback (:meth:`call_when_durable`: no task per request;
    its timeouts need :meth:`timeout_loop`)."""

    def __init__(self, store: StorageEngine) -> None:
        self.store = store
        self._heap: list[tuple[int, int, trio.Event | _Callback]] = []
        self._seq = itertools.count()
        self._armed = False  # a store callback is registered (for the lowest offset then waited for)
        self._token: trio.lowlevel.TrioToken | None = None
        self._timed: list[tuple[float, int, _Callback]] = []  # callbacks by deadline (a heap)
        self._timer_at = math.inf  # when timeout_loop() wakes next
        self._timer_wake = trio.Event()
        self._last: _Callback | None = None  # the callback entry made last (more of its group may join it)

    def _durable(self, end_offset: int) -> bool:
        return self.store.failure is None and self.store.durable_offset >= end_offset

    async def wait(self, end_offset: int, timeout_s: float) -> bool:
        """Whether everything below ``end_offset`` is durable within ``timeout_s``
        (False as well when the store failed: see ``store.failure``)."""
        if self._durable(end_offset):
            return True
        event = trio.Event()
        heapq.heappush(self._heap, (end_offset, next(self._seq), event))
        self._arm()
        with trio.move_on_after(timeout_s):
            await event.wait()
        return event.is_set() and self._durable(end_offset)

    def call_when_durable(self, end_offset: int, timeout_s: float, fn: Callable[[bool], None]) -> None:
        """:meth:`wait` without a task: ``fn(durable)`` is called once on the event loop
        (at once if durable now) with what :meth:`wait` would return."""
        if self._durable(end_offset):
            fn(True)
            return
        deadline = trio.current_time() + timeout_s
        last = self._last
        if last is not None and last.end_offset == end_offset and not last.done and last.deadline <= deadline:
            last.fns.append(fn)  # the rest of an append group: its deadline, never later than asked
            return
        self._last = entry = _Callback(end_offset, deadline, fn)
        seq = next(self._seq)
        heapq.heappush(self._heap, (end_offset, seq, entry))
        timed = self._timed
        while timed and timed[0][2].done:  # answered ones leave from the front
            heapq.heappop(timed)
        heapq.heappush(timed, (entry.deadline, seq, entry))
        # Rare: the same timeout for all, timeout_loop() sleeps until an earlier one.
        if entry.deadline < self._timer_at:
            self._timer_wake.set()
        self._arm()

    async def timeout_loop(self) -> None:
        """The timeouts of :meth:`call_when_durable` (a task for as long as the lane runs)."""
        timed = self._timed
        while True:
            now = trio.current_time()
            while timed and (timed[0][2].done or timed[0][0] <= now):
                _call(heapq.heappop(timed)[2], False)
            self._timer_at = timed[0][0] if timed else math.inf
            self._timer_wake = trio.Event()
            with trio.move_on_at(self._timer_at):
                await self._timer_wake.wait()

    def _arm(self) -> None:
        if self._armed or not self._heap:
            return
        self._armed = True
        if self._token is None:
            self._token = trio.lowlevel.current_trio_token()
        token = self._token

        def durable() -> None:  # on the flusher thread (or at once, on failure or if already durable)
            try:
                token.run_sync_soon(self._release)
            except trio.RunFinishedError:
                pass

        self.store.on_durable(self._heap[0][0], durable)

    def _release(self) -> None:
        """Wake every waiter the durable offset covers (all of them if the store
        failed), then register for the lowest one left."""
        self._armed = False
        reached = self.store.durable_offset
        failed = self.store.failure is not None
        while self._heap and (failed or self._heap[0][0] <= reached):
            waiter = heapq.heappop(self._heap)[2]
            if isinstance(waiter, _Callback):
                _call(waiter, not failed)
            else:
                waiter.set()
        self._arm()


def _call(entry: _Callback, durable: bool) -> None:
    """A callback waiter's outcome, once (a timed-out one may still sit in the heap)."""
    if entry.done:
        return
    entry.done = True
    for fn in entry.fns:
        try:
            fn(durable)
        except Exception:  # one waiter's bug must not keep the others from being answered
            log.exception("a sync-flush completion callback failed")
