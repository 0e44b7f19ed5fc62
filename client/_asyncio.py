"""The clients for asyncio programs: ``open_asyncio_producer``, ``open_asyncio_consumer``
and ``open_asyncio_admin``, the trio clients run in trio's *guest mode* inside the
program's asyncio loop.

Why guest mode: trio runs on the asyncio loop's own thread (its ticks are asyncio
callbacks), so a call costs one hand-over to trio and one asyncio future, not a thread
switch with the GIL passed back and forth; only trio's wait for I/O runs in a helper
thread, as guest mode does. One trio run serves every asyncio client of a loop (trio
allows one guest run per host loop); it starts with the first client and ends when the
last one closes. Calls made concurrently by many asyncio tasks are handed to trio
together (one wake-up for all of them).

Every call runs as a trio task of its own; its result or exception (the same classes
as with trio: :class:`SendError`, :class:`RpcError`, :class:`NoRouteError`, ...) comes
back through an asyncio future. An asyncio task cancelled while it awaits a call
cancels that call's trio task.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Literal, Sequence, TypeVar

import outcome
import trio

from clmq.common import ClientError, Message, Record
from clmq.protocol.auth import AclBinding, AclFilter
from clmq.protocol.transport import ClientSecurity

from ._admin import Admin, open_admin
from ._admin_index import IndexLookup
from ._admin_reads import CancelResult, DeadLetter, ResendResult
from ._admin_trace import MessageTrace
from ._arguments import options_from, resolve_addrs, resolve_security
from ._routes import MessageQueue
from .consumer import (
    Consumer,
    ConsumerOptions,
    DamagedQueueError,
    Handler,
    SendBackResult,
    check_limit,
    consumer_context,
    judge,
)
from .pop import (
    DEFAULT_RETRY_DELAYS_MS,
    Budget,
    PopConsumer,
    PopConsumerOptions,
    PopStats,
    handle_lane,
    pop_consumer_context,
)
from .producer import (
    Producer,
    ProducerOptions,
    SendError,
    SendResult,
    TransactionListener,
    TransactionResult,
    check_many_input,
    on_asyncio,
    producer_context,
    transact_on_loop,
)

T = TypeVar("T")

SendCallback = Callable[["asyncio.Future[SendResult]"], object]


class ClientClosedError(ClientError):
    """A call still running when its client (or the loop's trio run) closed."""


class _GuestRun:
    """One trio guest run inside an asyncio loop, shared by that loop's clients."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.users = 0
        self._started: asyncio.Future[None] = loop.create_future()
        self._done: asyncio.Future[None] = loop.create_future()
        self._stop = trio.Event()
        self._jobs: collections.deque[Callable[[], Awaitable[object]]] = collections.deque()
        self._poked = False
        self._nursery: trio.Nursery | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        trio.lowlevel.start_guest_run(
            self._main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=self._finished,
            host_uses_signal_set_wakeup_fd=True,  # asyncio owns the wake-up fd for signals
        )

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if not self._started.done():
                self._started.set_result(None)
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _finished(self, result: outcome.Outcome[None]) -> None:
        _RUNS.pop(self.loop, None)
        error = result.error if isinstance(result, outcome.Error) else None
        for fut in (self._started, self._done):
            if not fut.done():
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)

    async def started(self) -> None:
        await asyncio.shield(self._started)

    async def stop(self) -> None:
        """End the trio run (every client of it closed) and wait until it has."""
        self.run_soon(self._stop.set)
        await self.finished()

    async def finished(self) -> None:
        await asyncio.shield(self._done)

    def run_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` in trio's context (not in a task) soon; callable from the loop."""
        assert self.token is not None
        self.token.run_sync_soon(fn)

    def spawn(self, job: Callable[[], Awaitable[object]]) -> None:
        """Start ``job`` as a trio task; jobs handed over meanwhile share one wake-up."""
        self._jobs.append(job)
        if not self._poked:
            self._poked = True
            self.run_soon(self._start_jobs)

    def _start_jobs(self) -> None:
        self._poked = False
        assert self._nursery is not None
        while self._jobs:
            self._nursery.start_soon(self._jobs.popleft())

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Await ``fn()`` in trio and return its result here; cancelling the awaiting
        asyncio task cancels the trio task."""
        fut: asyncio.Future[T] = self.loop.create_future()
        scope = trio.CancelScope()

        async def job() -> None:
            try:
                with scope:
                    value = await fn()
                    if not fut.done():
                        fut.set_result(value)
            except BaseException as e:
                if not fut.done():
                    fut.set_exception(
                        ClientClosedError("the client closed during the call") if isinstance(e, trio.Cancelled) else e
                    )
                if not isinstance(e, Exception):
                    raise  # trio.Cancelled (the run is ending), KeyboardInterrupt, ...
            if not fut.done():  # the scope was cancelled from asyncio
                fut.cancel()

        self.spawn(job)
        try:
            return await fut
        except asyncio.CancelledError:
            self.run_soon(scope.cancel)
            raise


_RUNS: dict[asyncio.AbstractEventLoop, _GuestRun] = {}
_STOPPING: dict[asyncio.AbstractEventLoop, _GuestRun] = {}


async def _acquire() -> _GuestRun:
    loop = asyncio.get_running_loop()
    while loop in _STOPPING:  # the last client just closed: let that run end first
        await _STOPPING[loop].finished()
    run = _RUNS.get(loop)
    if run is None:
        run = _RUNS[loop] = _GuestRun(loop)
    run.users += 1
    try:
        await run.started()
    except BaseException:
        await _release(run)
        raise
    return run


async def _release(run: _GuestRun) -> None:
    run.users -= 1
    if run.users == 0 and _RUNS.get(run.loop) is run:
        _RUNS.pop(run.loop)
        _STOPPING[run.loop] = run
        try:
            await run.stop()
        finally:
            _STOPPING.pop(run.loop, None)


@asynccontextmanager
async def _held(context: Callable[[], AbstractAsyncContextManager[T]]) -> AsyncIterator[tuple[_GuestRun, T]]:
    """Open ``context()`` in the loop's trio run and keep it open while the block runs."""
    run = await _acquire()
    try:
        opened: asyncio.Future[T] = run.loop.create_future()
        closed: asyncio.Future[None] = run.loop.create_future()
        leave = trio.Event()
        run.spawn(functools.partial(_hold, context, opened, closed, leave))
        try:
            value = await asyncio.shield(opened)
        except asyncio.CancelledError:
            run.run_soon(leave.set)
            await asyncio.shield(closed)
            raise
        try:
            yield run, value
        finally:
            run.run_soon(leave.set)
            await asyncio.shield(closed)
    finally:
        await _release(run)


async def _hold(
    context: Callable[[], AbstractAsyncContextManager[T]],
    opened: asyncio.Future[T],
    closed: asyncio.Future[None],
    leave: trio.Event,
) -> None:
    """The trio side of :func:`_held`: open, report, wait to leave, close, report. A
    failure to open goes to ``opened``, a failure to close to ``closed``."""
    error: BaseException | None = None
    try:
        async with context() as value:
            opened.set_result(value)
            await leave.wait()
    except BaseException as e:
        error = ClientClosedError("the trio run ended") if isinstance(e, trio.Cancelled) else e
        if not isinstance(e, Exception):
            _settle_hold(opened, closed, error)
            raise  # trio.Cancelled (the run is ending), KeyboardInterrupt, ...
    _settle_hold(opened, closed, error)


def _settle_hold(opened: asyncio.Future[Any], closed: asyncio.Future[None], error: BaseException | None) -> None:
    target = closed if opened.done() else opened
    if error is not None:
        target.set_exception(error)
    if not closed.done():
        closed.set_result(None)


def _settle(out: asyncio.Future[SendResult], fut: Any) -> None:
    """Copy a trio-side ``SendFuture``'s outcome to an asyncio future (both live on the
    loop's thread in guest mode, so this runs there)."""
    if out.done():  # the asyncio side cancelled its future: nothing to tell
        return
    error = fut.exception()
    if error is not None:
        out.set_exception(error)
    else:
        out.set_result(fut.result())


# A message handed over costs its body and about this much more (topic, options, future).
_HANDOFF_OVERHEAD_BYTES = 256


class _Handoff:
    """Messages submitted on the asyncio side, waiting for the trio side's pump to
    hand them to :meth:`Producer.submit` in order. Why: a call into trio costs a wake-up
    of trio's I/O thread and of the asyncio loop (~0.2 ms, more than the producer's own
    work); submitted through this queue, a whole run of messages costs one. Bounded by
    ``max_bytes``: a pump blocked by a full producer buffer makes ``submit`` wait."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"handoff_max_bytes={max_bytes}: must be positive")
        self.max_bytes = max_bytes
        self.run: _GuestRun | None = None  # set once the producer is open (before any put)
        self.producer: Producer | None = None  # set on the trio side before the pump starts
        self.items: collections.deque[tuple[str, str, Any, dict[str, Any], asyncio.Future[SendResult], int]] = (
            collections.deque()
        )
        self.bytes = 0
        self.room = asyncio.Event()  # set by the pump as it frees room
        self.drained = asyncio.Event()  # set while nothing waits for the pump
        self.drained.set()
        self._work = trio.Event()
        self._pumping = False

    async def put(self, method: str, topic: str, what: Any, kwargs: dict[str, Any]) -> asyncio.Future[SendResult]:
        size = _HANDOFF_OVERHEAD_BYTES + (len(what) if isinstance(what, (bytes, bytearray)) else _batch_bytes(what))
        while self.bytes and self.bytes + size > self.max_bytes:  # one oversized message alone is let through
            self.room.clear()
            await self.room.wait()
        assert self.run is not None
        out: asyncio.Future[SendResult] = self.run.loop.create_future()
        self.items.append((method, topic, what, kwargs, out, size))
        self.bytes += size
        self.drained.clear()
        if not self._pumping:
            self._pumping = True
            self.run.run_soon(self._work.set)
        return out

    async def pump(self) -> None:
        """The trio side: hands every waiting message to the producer, in order."""
        try:
            while True:
                await self._work.wait()
                self._work = trio.Event()
                while self.items:
                    await self._hand_over(*self.items[0])
                    self.bytes -= self.items.popleft()[-1]
                    self.room.set()  # cheap without waiters; a waiter checks its own size
                self._pumping = False
                self.drained.set()
        finally:  # cancelled (the producer closes): whatever is left was never buffered
            for item in self.items:
                if not item[4].done():
                    item[4].set_exception(ClientClosedError("the producer closed before the message was buffered"))
            self.drained.set()

    async def _hand_over(
        self, method: str, topic: str, what: Any, kwargs: dict[str, Any], out: asyncio.Future[SendResult], size: int
    ) -> None:
        if out.cancelled():  # cancelled before it reached the producer: not sent
            return
        try:
            fut = await getattr(self.producer, method)(topic, what, **kwargs)
        except Exception as e:  # refused at once (BufferFullError, NoRouteError, bad input)
            if not out.done():
                out.set_exception(e)
        else:
            fut.add_done_callback(functools.partial(_settle, out))  # on trio's (= the loop's) thread


def _batch_bytes(messages: Sequence[Message | bytes]) -> int:
    return sum(len(m.body) if isinstance(m, Message) else len(m) for m in messages)


class AsyncioProducer:
    """The :class:`Producer` for asyncio code; use :func:`open_asyncio_producer`.

    :meth:`submit` returns an ``asyncio.Future`` (its done callbacks run on the asyncio
    loop) as soon as the message is queued for the trio side, without waiting for it;
    a failure to buffer it there (:class:`BufferFullError` with ``buffer_full="raise"``
    or after ``buffer_block_max_ms``, :class:`NoRouteError`, bad input) fails that
    future instead of being raised by ``submit`` (Kafka's producer does the same). At
    most ``handoff_max_bytes`` (bodies and ~256 bytes each) wait to be handed
    over; beyond that ``submit`` waits (back-pressure from the producer's buffer).
    :meth:`send` and :meth:`send_batch` take the same path (so sends and submits keep
    their order) and await the future. Cancelling a task that awaits :meth:`send`
    cancels the send only if the message was not yet handed to the producer; once it
    was, it may still be stored (as with Kafka's producer).
    """

    def __init__(self, run: _GuestRun, producer: Producer, handoff: _Handoff) -> None:
        self._run = run
        self._handoff = handoff
        self.producer = producer  # the trio object: only for code running in the trio run

    async def send(self, topic: str, body: bytes, **kwargs: Any) -> SendResult:
        """:meth:`Producer.send`: one message; returns where it was stored."""
        return await (await self._handoff.put("submit", topic, body, kwargs))

    async def send_batch(self, topic: str, messages: Sequence[Message | bytes], **kwargs: Any) -> SendResult:
        """:meth:`Producer.send_batch`: messages to one queue, in order, as one batch."""
        return await (await self._handoff.put("submit_batch", topic, messages, kwargs))

    async def send_oneway(self, topic: str, body: bytes, **kwargs: Any) -> None:
        """:meth:`Producer.send_oneway`: no answer waited for, no guarantee."""
        await self._run.call(functools.partial(self.producer.send_oneway, topic, body, **kwargs))

    async def submit(
        self, topic: str, body: bytes, *, callback: SendCallback | None = None, **kwargs: Any
    ) -> asyncio.Future[SendResult]:
        """:meth:`Producer.submit` (see the class for errors): the future resolves to
        the message's :class:`SendResult` or fails with :class:`SendError`;
        ``callback(future)`` runs on the asyncio loop once it is done."""
        out = await self._handoff.put("submit", topic, body, kwargs)
        if callback is not None:
            out.add_done_callback(callback)
        return out

    async def submit_batch(
        self, topic: str, messages: Sequence[Message | bytes], *, callback: SendCallback | None = None, **kwargs: Any
    ) -> asyncio.Future[SendResult]:
        """:meth:`Producer.submit_batch`: :meth:`submit` for a batch to one queue."""
        out = await self._handoff.put("submit_batch", topic, messages, kwargs)
        if callback is not None:
            out.add_done_callback(callback)
        return out

    async def submit_many(
        self, topic: str, bodies: Sequence[bytes], **kwargs: Any
    ) -> asyncio.Future[list[SendResult | SendError]]:
        """:meth:`Producer.submit_many`: one future for the call, resolved once every
        message is done to each message's :class:`SendResult` or :class:`SendError`, in
        order. Bad input raises TypeError here; an unknown topic fails the future."""
        items = check_many_input(topic, bodies)
        return await self._handoff.put("submit_many", topic, items, kwargs)  # type: ignore[return-value]

    async def flush(self) -> None:
        """:meth:`Producer.flush`: until every message submitted before is answered
        (stored or failed for good)."""
        await self._handoff.drained.wait()
        await self._run.call(self.producer.flush)

    async def send_in_transaction(self, topic: str, body: bytes, **kwargs: Any) -> TransactionResult:
        """:meth:`Producer.send_in_transaction`; ``execute`` (or the listener's) runs on this loop."""
        return await transact_on_loop(self._run.call, self.producer, topic, body, kwargs)


class AsyncioConsumer:
    """The :class:`Consumer` for asyncio code; use :func:`open_asyncio_consumer`."""

    def __init__(self, run: _GuestRun, consumer: Consumer) -> None:
        self._run = run
        self.consumer = consumer  # the trio object: only for code running in the trio run
        self._kept: list[Record] | None = None  # received for a task that was cancelled meanwhile

    async def receive(self) -> list[Record]:
        """:meth:`Consumer.receive`: the next batch (waits for one); acknowledges the
        previous batch. Cancelled (e.g. by ``asyncio.timeout``), it loses nothing: a
        batch that arrived just as the task was cancelled is returned by the next call
        (and not acknowledged before)."""
        if self._kept is not None:
            batch, self._kept = self._kept, None
            return batch
        got: list[list[Record]] = []

        async def receive() -> list[Record]:
            got.append(await self.consumer.receive())  # no checkpoint between this and the answer
            return got[0]

        try:
            return await self._run.call(receive)
        except asyncio.CancelledError:
            if got:  # received in trio, not delivered here: the consumer holds it as the pending batch
                self._kept = got[0]
            raise

    # Plain methods run here directly: trio runs on this thread, never at the same time.
    def ack(self, records: Sequence[Record] | None = None) -> None:
        """:meth:`Consumer.ack`: the batch last received is processed (or, with
        ``records``, only those and the ones before them in their queue)."""
        if self._kept is None:  # a kept batch was never returned: not processed
            self.consumer.ack(records)

    def assignment(self) -> list[MessageQueue]:
        """:meth:`Consumer.assignment`: the queues this member reads now."""
        return self.consumer.assignment()

    @property
    def errors(self) -> dict[MessageQueue, DamagedQueueError]:
        """A copy of :attr:`Consumer.errors`: the queues stopped at a damaged record."""
        return dict(self.consumer.errors)

    async def commit(self) -> None:
        """:meth:`Consumer.commit`: commit processed offsets now."""
        await self._run.call(self.consumer.commit)

    async def nack(self, records: Sequence[Record], delay_ms: int | None = None) -> list[SendBackResult]:
        """:meth:`Consumer.nack`: ``records`` (from the last :meth:`receive`) failed:
        delivered again later (orderly: in place); raises :class:`SendBackError`."""
        return await self._run.call(functools.partial(self.consumer.nack, records, delay_ms))

    reconsume_later = nack

    async def run(self, handler: Handler, *, max_messages: int | None = None) -> int:
        """:meth:`Consumer.run`: ``handler(record)`` (plain or a coroutine function,
        run on this asyncio loop) returns ``ConsumeStatus`` or None; an exception is
        RECONSUME_LATER. Returns the number of messages handled, after
        ``max_messages`` (None: runs until cancelled; what was not handled then is
        delivered again)."""
        check_limit(max_messages)
        redelivery = self.consumer.redelivery
        handled = 0
        while max_messages is None or handled < max_messages:
            records = await self.receive()
            # Plain calls here: trio runs on this thread, never at the same time.
            rnd = redelivery.round(records, None if max_messages is None else max_messages - handled)
            try:
                for r in rnd.todo():
                    rnd.done(r, await judge(handler, r))
            except BaseException:
                redelivery.abandon(rnd)
                raise
            handled += rnd.handled
            await self._run.call(functools.partial(redelivery.settle, rnd))
        return handled


class AsyncioPopConsumer:
    """The :class:`PopConsumer` for asyncio code; use :func:`open_asyncio_pop_consumer`."""

    def __init__(self, run: _GuestRun, consumer: PopConsumer) -> None:
        self._run = run
        self.consumer = consumer  # the trio object: only for code running in the trio run
        self._kept: list[Record] | None = None  # received for a task that was cancelled meanwhile

    async def receive(self) -> list[Record]:
        """:meth:`PopConsumer.receive`: the next messages (waits for some). Cancelled, it
        loses nothing: messages that arrived just as the task was cancelled are returned
        by the next call."""
        if self._kept is not None:
            kept, self._kept = self._kept, None
            return kept
        got: list[list[Record]] = []

        async def receive() -> list[Record]:
            got.append(await self.consumer.receive())  # no checkpoint between this and the answer
            return got[0]

        try:
            return await self._run.call(receive)
        except asyncio.CancelledError:
            if got:
                self._kept = got[0]
            raise

    async def ack(self, records: Sequence[Record]) -> list[str]:
        """:meth:`PopConsumer.ack`: a status per record (``ok``, ``expired``, ...)."""
        return await self._run.call(functools.partial(self.consumer.ack, records))

    async def nack(self, records: Sequence[Record], delay_ms: int | None = None) -> list[str]:
        """:meth:`PopConsumer.nack`: delivered again after ``delay_ms`` (None: the back-off)."""
        return await self._run.call(functools.partial(self.consumer.nack, records, delay_ms))

    async def extend(self, records: Sequence[Record], invisible_time_ms: int) -> list[str]:
        """:meth:`PopConsumer.extend`: kept with this member ``invisible_time_ms`` from now."""
        return await self._run.call(functools.partial(self.consumer.extend, records, invisible_time_ms))

    @property
    def stats(self) -> PopStats:
        """:attr:`PopConsumer.stats` (counts: acked, ack_expired, ...)."""
        return self.consumer.stats

    async def run(self, handler: Handler, *, max_messages: int | None = None) -> int:
        """:meth:`PopConsumer.run`: ``handler(record)`` (plain or a coroutine function, run
        on this asyncio loop, up to ``handler_concurrency`` at once) returns
        ``ConsumeStatus`` or None; an exception is RECONSUME_LATER. Returns the number
        of messages handled, after ``max_messages`` (None: runs until cancelled)."""
        check_limit(max_messages)
        c, call = self.consumer, self._run.call
        slots, tasks, budget = asyncio.Semaphore(c.options.handler_concurrency), set(), Budget(max_messages)
        lane_done = asyncio.Event()

        async def ack(records: Sequence[Record]) -> object:
            return await call(functools.partial(c.ack, records))

        async def nack(records: Sequence[Record], delay_ms: int | None) -> object:
            return await call(functools.partial(c.nack, records, delay_ms))

        async def work(lane: list[Record]) -> None:
            n = 0
            try:
                judge_one = functools.partial(judge, handler)
                n = await handle_lane(lane, judge_one, ack, nack, orderly=c.options.orderly, delay_of=c.delay_of)
            finally:
                budget.done(len(lane), n)
                slots.release()
                lane_done.set()

        try:
            while not budget.finished():
                await slots.acquire()
                while budget.full() and not budget.finished():
                    lane_done.clear()
                    await lane_done.wait()
                if budget.finished():
                    break
                lane, extra = budget.take(await call(c.take_lane))
                if extra:
                    await call(functools.partial(c.release, extra))
                task = asyncio.ensure_future(work(lane))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return budget.handled


class AsyncioAdmin:
    """The :class:`Admin` calls for asyncio code; use :func:`open_asyncio_admin`."""

    def __init__(self, run: _GuestRun, admin: Admin) -> None:
        self._run = run
        self.admin = admin  # the trio object: only for code running in the trio run

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        return await self._run.call(functools.partial(fn, *args, **kwargs))

    async def brokers(self) -> list[dict[str, Any]]:
        """:meth:`Admin.brokers`."""
        return await self._call(self.admin.brokers)

    async def leaders(self) -> list[dict[str, Any]]:
        """:meth:`Admin.leaders`."""
        return await self._call(self.admin.leaders)

    async def replica_status(self, addr: str) -> dict[str, Any]:
        """:meth:`Admin.replica_status`."""
        return await self._call(self.admin.replica_status, addr)

    async def promote(self, addr: str, *, force: bool = False) -> int:
        """:meth:`Admin.promote`."""
        return await self._call(self.admin.promote, addr, force=force)

    async def create_topic(self, topic: str, queue_count: int, on: list[str] | None = None) -> list[str]:
        """:meth:`Admin.create_topic`."""
        return await self._call(self.admin.create_topic, topic, queue_count, on)

    async def delete_topic(self, topic: str) -> list[str]:
        """:meth:`Admin.delete_topic`."""
        return await self._call(self.admin.delete_topic, topic)

    async def list_topics(self, *, include_system: bool = False) -> dict[str, dict[str, int]]:
        """:meth:`Admin.list_topics`."""
        return await self._call(self.admin.list_topics, include_system=include_system)

    async def describe_topic(self, topic: str) -> list[dict[str, Any]]:
        """:meth:`Admin.describe_topic`."""
        return await self._call(self.admin.describe_topic, topic)

    async def find_by_key(self, topic: str, key: str, **kwargs: Any) -> IndexLookup:
        """:meth:`Admin.find_by_key` (``since_ms``, ``until_ms``, ``max_results``)."""
        return await self._call(self.admin.find_by_key, topic, key, **kwargs)

    async def trace(self, msg_id: str | None = None, **kwargs: Any) -> MessageTrace:
        """:meth:`Admin.trace` (``key``, ``topic``, ``since_ms``, ``until_ms``, ``max_events``)."""
        return await self._call(self.admin.trace, msg_id, **kwargs)

    async def list_groups(self, *, include_system: bool = False) -> list[str]:
        """:meth:`Admin.list_groups`."""
        return await self._call(self.admin.list_groups, include_system=include_system)

    async def describe_group(self, group: str) -> dict[str, Any]:
        """:meth:`Admin.describe_group`."""
        return await self._call(self.admin.describe_group, group)

    async def cancel_message(self, msg_id: str) -> CancelResult:
        """:meth:`Admin.cancel_message`."""
        return await self._call(self.admin.cancel_message, msg_id)

    async def list_transactions(self, group: str | None = None) -> Any:
        """:meth:`Admin.list_transactions`."""
        return await self._call(self.admin.list_transactions, group)

    async def transaction(self, msg_id: str) -> Any:
        """:meth:`Admin.transaction`."""
        return await self._call(self.admin.transaction, msg_id)

    async def dead_letters(self, group: str, *, max_messages: int = 100, start: int = 0) -> list[DeadLetter]:
        """:meth:`Admin.dead_letters`."""
        return await self._call(self.admin.dead_letters, group, max_messages=max_messages, start=start)

    async def dead_letter_counts(self, group: str | None = None) -> list[dict[str, Any]]:
        """:meth:`Admin.dead_letter_counts`."""
        return await self._call(self.admin.dead_letter_counts, group)

    async def resend_dead_letters(
        self, group: str, *, offsets: list[int] | None = None, resend_all: bool = False
    ) -> ResendResult:
        """:meth:`Admin.resend_dead_letters`."""
        return await self._call(self.admin.resend_dead_letters, group, offsets=offsets, resend_all=resend_all)

    async def add_user(self, user: str, password: str, **options: Any) -> list[str]:
        """:meth:`Admin.add_user` (``mechanisms``, ``iterations``)."""
        return await self._call(self.admin.add_user, user, password, **options)

    async def delete_user(self, user: str) -> list[str]:
        """:meth:`Admin.delete_user`."""
        return await self._call(self.admin.delete_user, user)

    async def list_users(self) -> dict[str, list[str]]:
        """:meth:`Admin.list_users`."""
        return await self._call(self.admin.list_users)

    async def create_acls(self, bindings: Iterable[AclBinding]) -> list[str]:
        """:meth:`Admin.create_acls`."""
        return await self._call(self.admin.create_acls, list(bindings))

    async def describe_acls(self, match: AclFilter | None = None) -> list[AclBinding]:
        """:meth:`Admin.describe_acls`."""
        return await self._call(self.admin.describe_acls, match)

    async def delete_acls(self, match: AclFilter | None = None) -> list[AclBinding]:
        """:meth:`Admin.delete_acls`."""
        return await self._call(self.admin.delete_acls, match)


@asynccontextmanager
async def open_asyncio_producer(
    namesrv_addrs: str | Sequence[str] | None = None,
    *,
    broker_addrs: str | Sequence[str] | None = None,
    handoff_max_bytes: int = 4 << 20,
    send_timeout_ms: int = 3000,
    retries: int | None = None,
    fault_backoff_ms: int = 3000,
    replication_retry_backoff_ms: int = 200,
    retry_budget_ms: int | None = None,
    retry_backoff_ms: int = 50,
    retry_backoff_max_ms: int = 500,
    unique_ids: bool = True,
    linger_ms: int = 0,
    batch_max_bytes: int = 1 << 20,
    max_in_flight: int = 5,
    buffer_max_bytes: int = 64 << 20,
    buffer_full: Literal["block", "raise"] = "block",
    buffer_block_max_ms: int = 60_000,
    security: ClientSecurity | None = None,
    transaction_group: str | None = None,
    transaction_listener: TransactionListener | None = None,
    transaction_check_concurrency: int = 4,
    transaction_check_timeout_ms: int = 5_000,
    trace: bool = False,
    trace_buffer_max_events: int = 8192,
    trace_flush_interval_ms: int = 200,
) -> AsyncIterator[AsyncioProducer]:
    """A producer for asyncio code, with :func:`open_producer`'s arguments:
    ``async with open_asyncio_producer("127.0.0.1:9876") as p: await p.send("t", b"x")``.
    ``handoff_max_bytes``: see :class:`AsyncioProducer`. On leaving, every
    message submitted is handed over, then the producer closes (which flushes)."""
    transaction_listener = on_asyncio(transaction_listener)  # checks run on this loop
    options = options_from(ProducerOptions, locals())
    namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # errors before trio starts
    resolve_security(security)  # errors before trio starts
    handoff = _Handoff(handoff_max_bytes)

    @asynccontextmanager
    async def producer_and_pump() -> AsyncIterator[Producer]:
        async with producer_context(namesrv, brokers, options) as producer, trio.open_nursery() as nursery:
            handoff.producer = producer
            nursery.start_soon(handoff.pump)
            yield producer
            nursery.cancel_scope.cancel()  # drained by now (below): nothing is dropped

    async with _held(producer_and_pump) as (run, producer):
        handoff.run = run
        try:
            yield AsyncioProducer(run, producer, handoff)
        finally:
            await handoff.drained.wait()


@asynccontextmanager
async def open_asyncio_consumer(
    namesrv_addrs: str | Sequence[str] | None,
    group: str,
    subscriptions: dict[str, str],
    *,
    broker_addrs: str | Sequence[str] | None = None,
    mode: Literal["clustering", "broadcasting"] = "clustering",
    start_from: Literal["earliest", "latest"] | int = "earliest",
    client_id: str = "",
    pull_batch: int = 1024,
    pull_wait_ms: int = 15_000,
    fetch_queues: int = 1024,
    fetch_max_messages: int = 4096,
    fetch_max_bytes: int = 4 << 20,
    watch_max_bytes: int = 64 << 10,
    fetches_in_flight: int = 4,
    watches_in_flight: int = 64,
    prefetch_max_bytes: int = 32 << 20,
    receive_max_messages: int = 4096,
    heartbeat_interval_ms: int = 1000,
    rebalance_interval_ms: int = 2000,
    commit_interval_ms: int = 1000,
    buffered_batches: int = 0,
    request_timeout_ms: int = 3000,
    retry_budget_ms: int = 15_000,
    damaged_queue_retry_ms: int = 10_000,
    read_from_followers: bool = False,
    follower_read_hold_ms: int = 30_000,
    follower_failure_backoff_ms: int = 5_000,
    max_reconsume_times: int | None = None,
    retry_delays_ms: tuple[int, ...] | None = None,
    orderly: bool = False,
    lock_retry_ms: int = 500,
    lock_renew_interval_ms: int = 10_000,
    orderly_retry_delay_ms: int = 1000,
    security: ClientSecurity | None = None,
    trace: bool = False,
    trace_buffer_max_events: int = 8192,
    trace_flush_interval_ms: int = 200,
) -> AsyncIterator[AsyncioConsumer]:
    """A started consumer for asyncio code, with :func:`open_consumer`'s arguments."""
    options = options_from(ConsumerOptions, locals())
    namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # errors before trio starts
    resolve_security(security)  # errors before trio starts
    opener = functools.partial(consumer_context, namesrv, brokers, group, subscriptions, options)
    async with _held(opener) as (run, consumer):
        yield AsyncioConsumer(run, consumer)


@asynccontextmanager
async def open_asyncio_pop_consumer(
    namesrv_addrs: str | Sequence[str] | None,
    group: str,
    subscriptions: dict[str, str],
    *,
    broker_addrs: str | Sequence[str] | None = None,
    invisible_time_ms: int = 30_000,
    max_messages: int = 32,
    pops_in_flight: int = 2,
    pop_wait_ms: int = 15_000,
    prefetch_max_messages: int = 64,
    pop_max_bytes: int | None = None,
    receive_max_messages: int = 32,
    orderly: bool = False,
    max_reconsume_times: int | None = None,
    retry_delays_ms: tuple[int, ...] = DEFAULT_RETRY_DELAYS_MS,
    start_from: Literal["earliest", "latest"] = "earliest",
    client_id: str = "",
    handler_concurrency: int = 8,
    request_timeout_ms: int = 3000,
    retry_budget_ms: int = 15_000,
    route_refresh_interval_ms: int = 10_000,
    max_backoff_ms: int = 2_000,
    release_on_close: bool = True,
    security: ClientSecurity | None = None,
) -> AsyncIterator[AsyncioPopConsumer]:
    """A started POP consumer for asyncio code, with :func:`open_pop_consumer`'s arguments."""
    options = options_from(PopConsumerOptions, locals())
    namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # errors before trio starts
    resolve_security(security)  # errors before trio starts
    opener = functools.partial(pop_consumer_context, namesrv, brokers, group, subscriptions, options)
    async with _held(opener) as (run, consumer):
        yield AsyncioPopConsumer(run, consumer)


@asynccontextmanager
async def open_asyncio_admin(
    namesrv_addrs: str | Sequence[str] | None = None,
    *,
    broker_addrs: str | Sequence[str] | None = None,
    security: ClientSecurity | None = None,
) -> AsyncIterator[AsyncioAdmin]:
    """The admin client for asyncio code, with :func:`open_admin`'s arguments (and, as the
    other clients, addresses as a string or a list, or ``$CLMQ_NAMESRV``)."""
    namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)
    resolved = resolve_security(security)  # errors before trio starts
    async with _held(lambda: open_admin(namesrv, broker_addrs=brokers or None, security=resolved)) as (run, admin):
        yield AsyncioAdmin(run, admin)
