"""Blocking facades for plain synchronous Python: the trio clients run in a
background thread with their own event loop; each call waits for its result."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import queue
import threading
import warnings
import weakref
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Sequence, TypeVar

import trio

from clmq.common import Message, Record
from clmq.protocol.transport import ClientSecurity

from ._admin import Admin, open_admin
from ._arguments import options_from, resolve_addrs, resolve_security
from ._asyncio import ClientClosedError
from ._routes import MessageQueue
from .consumer import (
    Consumer,
    ConsumerOptions,
    ConsumeStatus,
    DamagedQueueError,
    Round,
    SendBackResult,
    check_limit,
    consumer_context,
    judge_sync,
)
from .pop import (
    DEFAULT_RETRY_DELAYS_MS,
    Budget,
    PopConsumer,
    PopConsumerOptions,
    PopStats,
    failed_part,
    pop_consumer_context,
)
from .producer import (
    Producer,
    ProducerOptions,
    SendError,
    SendFutures,
    SendResult,
    TransactionListener,
    TransactionResult,
    check_many_input,
    in_threads,
    producer_context,
    transact_in_thread,
)

T = TypeVar("T")
log = logging.getLogger("clmq.producer")


class _Portal:
    """A trio event loop in a daemon thread, holding one async context open."""

    def __init__(self, context: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
        self._ready: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue()
        self._stop: trio.Event | None = None
        # A daemon thread: a client left open does not keep the interpreter alive (a
        # BlockingProducer's finalizer closes it at exit, flushing what it holds).
        self.thread = threading.Thread(target=trio.run, args=(self._main, context), daemon=True, name="clmq-client")
        self.thread.start()
        value, error = self._ready.get()
        if error is not None:
            self.thread.join()
            raise error
        self.value = value

    async def _main(self, context: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with context() as value:
                self._ready.put((value, None))
                await self._stop.wait()
        except BaseException as e:
            if self._ready.empty():
                self._ready.put((None, e))
            else:
                raise

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        return trio.from_thread.run(functools.partial(fn, *args, **kwargs), trio_token=self.token)

    def close(self) -> None:
        if self.thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
            self.thread.join()


SendCallback = Callable[["concurrent.futures.Future[SendResult]"], object]
# A message handed over costs its body and about this much more (topic, options, future).
HANDOFF_OVERHEAD_BYTES = 256
DEFAULT_HANDOFF_MAX_BYTES = 4 << 20


def _size(what: Any) -> int:
    if isinstance(what, (bytes, bytearray)):
        return HANDOFF_OVERHEAD_BYTES + len(what)
    return HANDOFF_OVERHEAD_BYTES + sum(len(m.body) if isinstance(m, Message) else len(m) for m in what)


def _messages(method: str, what: Any) -> int:
    """How many messages a handed-over call carries (each one counted: never silent)."""
    return len(what) if method == "submit_many" else 1


_Item = tuple[str, str, Any, dict[str, Any], "concurrent.futures.Future[SendResult]", int]


class _ThreadHandoff:
    """Messages submitted by the application's threads, waiting for the client thread's
    pump to hand them to :meth:`Producer.submit` in order. Why: a call into the client
    thread costs two thread switches (~0.1-0.2 ms, ten times the producer's own work);
    through this queue, a run of messages costs one wake-up. At most ``max_bytes``
    (bodies and ~256 bytes each) wait; beyond that ``put`` blocks (back-pressure)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"handoff_max_bytes={max_bytes}: must be positive")
        self.max_bytes = max_bytes
        self.changed = threading.Condition()  # guards what follows; notified as the pump frees room
        self.items: collections.deque[_Item] = collections.deque()
        self.bytes = 0
        self._pumping = False
        self.closed = False
        self._work = trio.Event()
        self.producer: Producer | None = None  # set with the token, in the client thread, before the pump starts
        self.token: trio.lowlevel.TrioToken | None = None
        # Counts for a producer left open (_left_open): put() adds to submitted (under the
        # lock), the client thread alone to answered and failed.
        self.submitted = 0
        self.answered = 0
        self.failed = 0
        self.last_error: BaseException | None = None

    def put(self, method: str, topic: str, what: Any, kwargs: dict[str, Any]) -> concurrent.futures.Future[SendResult]:
        size = _size(what)
        out: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        out.set_running_or_notify_cancel()  # running already: it cannot be cancelled
        with self.changed:
            while self.bytes and self.bytes + size > self.max_bytes:  # one oversized message alone is let through
                self.changed.wait()
            if self.closed:
                raise ClientClosedError("the producer is closed")
            self.items.append((method, topic, what, kwargs, out, size))
            self.bytes += size
            self.submitted += _messages(method, what)  # a call: its messages
            wake, self._pumping = not self._pumping, True
        if wake:
            assert self.token is not None
            self.token.run_sync_soon(self._wake)
        return out

    def _wake(self) -> None:
        self._work.set()

    def drain(self) -> None:
        """Block until every message put before is handed to the producer."""
        with self.changed:
            while self.items:
                self.changed.wait()

    async def pump(self) -> None:
        """The client thread's side: hands every waiting message over, in order."""
        try:
            while True:
                await self._work.wait()
                self._work = trio.Event()
                while True:
                    with self.changed:
                        if not self.items:
                            self._pumping = False
                            break
                        item = self.items[0]
                    await self._hand_over(*item)
                    with self.changed:
                        self.bytes -= self.items.popleft()[-1]
                        self.changed.notify_all()
        finally:  # the producer closes: what is left was never buffered (none after a drain)
            with self.changed:
                self.closed = True
                for item in self.items:
                    closed = ClientClosedError("the producer closed before the message was buffered")
                    self._settle(item[4], error=closed, count=_messages(item[0], item[2]))
                self.items.clear()
                self.bytes = 0
                self.changed.notify_all()

    async def _hand_over(
        self,
        method: str,
        topic: str,
        what: Any,
        kwargs: dict[str, Any],
        out: concurrent.futures.Future[SendResult],
        size: int,
    ) -> None:
        try:
            fut = await getattr(self.producer, method)(topic, what, **kwargs)
        except Exception as e:  # refused at once (BufferFullError, NoRouteError, bad input)
            self._settle(out, error=e, count=_messages(method, what))
        else:
            fut.add_done_callback(functools.partial(self._answered, out))  # on the client thread

    def _answered(self, out: concurrent.futures.Future[SendResult], fut: Any) -> None:
        """Copy a ``SendFuture``'s outcome to a ``concurrent.futures.Future`` (a
        ``SendFutures``: each of its messages counted, its failures among them)."""
        error = fut.exception()
        if isinstance(fut, SendFutures):
            results = fut.result()
            failures = [r for r in results if isinstance(r, SendError)]
            self.answered += len(results)
            self.failed += len(failures)
            if failures:
                self.last_error = failures[-1]
            out.set_result(results)  # type: ignore[arg-type]  # submit_many's future: the list
            return
        self._settle(out, None if error is not None else fut.result(), error)

    def _settle(
        self,
        out: concurrent.futures.Future[SendResult],
        result: SendResult | None = None,
        error: BaseException | None = None,
        count: int = 1,
    ) -> None:
        """The outcome of ``count`` messages (one future), counted (client thread only)."""
        self.answered += count
        if error is None:
            assert result is not None
            out.set_result(result)
            return
        self.failed += count
        self.last_error = error
        out.set_exception(error)

    def unanswered(self) -> int:
        """Messages submitted and not answered yet (a snapshot, from any thread)."""
        return self.submitted - self.answered


def _close(handoff: _ThreadHandoff, portal: _Portal) -> None:
    """Hand every message submitted over, then close the producer (which flushes)."""
    handoff.drain()
    portal.close()


def _left_open(handoff: _ThreadHandoff, portal: _Portal) -> None:
    """A :class:`BlockingProducer` collected or left open at interpreter exit (its
    ``weakref.finalize``; atexit runs it while the daemon client thread still runs):
    close it as ``close()`` would, flushing within the retry budget, and say what could
    not be sent. Never silent: buffered messages are sent or counted in a warning."""
    if threading.current_thread() is portal.thread:
        # Collected on its own client thread (a callback dropped the last reference):
        # that thread cannot wait for itself, another one closes it (not a daemon: the
        # interpreter waits for it at exit).
        threading.Thread(target=_left_open, args=(handoff, portal), name="clmq-producer-close").start()
        return
    pending, failed_before = handoff.unanswered(), handoff.failed
    _close(handoff, portal)
    lost = handoff.failed - failed_before
    if lost:
        log.warning(
            "a BlockingProducer was left open: %d of the %d messages it still held could not be sent (%s); "
            "close() it, or use 'with', to see each message's outcome",
            lost,
            pending,
            handoff.last_error,
        )
    warnings.warn(
        f"a BlockingProducer was left open (closed by its finalizer: {pending - lost} of {pending} messages "
        "it still held sent)",
        ResourceWarning,
        stacklevel=1,
    )


class BlockingProducer:
    """``BlockingProducer("127.0.0.1:9876").send("topic", b"body")``: :func:`open_producer`'s
    arguments (addresses, then :class:`ProducerOptions` by keyword, e.g. ``linger_ms``) and
    ``handoff_max_bytes``; see :class:`Producer`. Close it (``close()`` or ``with``): one
    left open is closed when it is garbage-collected or at interpreter exit, sending
    what it holds within its retry budget, and a warning (logger ``clmq.producer``)
    counts the messages that could not be sent.

    :meth:`submit` returns a ``concurrent.futures.Future`` once the message is queued
    for the client thread, without waiting for it; a refusal there
    (:class:`BufferFullError`, :class:`NoRouteError`, bad input) fails that future.
    ``handoff_max_bytes`` (bodies and ~256 bytes each) may wait to be handed over;
    beyond that ``submit`` blocks (back-pressure from the producer's buffer).
    :meth:`send` and :meth:`send_batch` take the same path (sends and submits keep their
    order) and wait for the result."""

    def __init__(
        self,
        namesrv_addrs: str | Sequence[str] | None = None,
        *,
        broker_addrs: str | Sequence[str] | None = None,
        handoff_max_bytes: int = DEFAULT_HANDOFF_MAX_BYTES,
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
    ) -> None:
        transaction_listener = in_threads(transaction_listener)  # checks run in worker threads
        options = options_from(ProducerOptions, locals())
        namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # errors here, before the thread starts
        resolve_security(security)  # errors here, before the thread starts
        handoff = self._handoff = _ThreadHandoff(handoff_max_bytes)

        @asynccontextmanager
        async def producer_and_pump() -> AsyncIterator[Producer]:  # holds no reference to self (finalizer)
            async with producer_context(namesrv, brokers, options) as producer, trio.open_nursery() as nursery:
                handoff.producer, handoff.token = producer, trio.lowlevel.current_trio_token()
                nursery.start_soon(handoff.pump)
                yield producer
                nursery.cancel_scope.cancel()  # drained by now (close): nothing is dropped

        self._portal = _Portal(producer_and_pump)
        self.producer: Producer = self._portal.value
        # Never closed: flushed when collected or at interpreter exit, or a warning names what was lost.
        self._finalizer = weakref.finalize(self, _left_open, handoff, self._portal)

    def send(self, topic: str, body: bytes, **kwargs: Any) -> SendResult:
        """:meth:`Producer.send`: one message; returns where it was stored."""
        return self._handoff.put("submit", topic, body, kwargs).result()

    def send_in_transaction(self, topic: str, body: bytes, **kwargs: Any) -> TransactionResult:
        """:meth:`Producer.send_in_transaction`; ``execute`` (or the listener's) runs in this thread."""
        return transact_in_thread(self._portal.call, self.producer, topic, body, kwargs)

    def send_batch(self, topic: str, messages: list[Any], **kwargs: Any) -> SendResult:
        """:meth:`Producer.send_batch`: messages to one queue, in order, as one batch."""
        return self._handoff.put("submit_batch", topic, messages, kwargs).result()

    def send_oneway(self, topic: str, body: bytes, **kwargs: Any) -> None:
        """:meth:`Producer.send_oneway`: no answer waited for, no guarantee."""
        self._portal.call(self.producer.send_oneway, topic, body, **kwargs)

    def submit(
        self, topic: str, body: bytes, *, callback: SendCallback | None = None, **kwargs: Any
    ) -> concurrent.futures.Future[SendResult]:
        """:meth:`Producer.submit` (errors: see the class). The future's
        ``result(timeout)`` is the :class:`SendResult` or raises :class:`SendError`.
        ``callback(future)`` and the future's done callbacks run on the client's thread:
        keep them short and do not call this producer from them (it would wait for
        itself)."""
        out = self._handoff.put("submit", topic, body, kwargs)
        if callback is not None:
            out.add_done_callback(callback)
        return out

    def submit_batch(
        self, topic: str, messages: list[Any], *, callback: SendCallback | None = None, **kwargs: Any
    ) -> concurrent.futures.Future[SendResult]:
        """:meth:`Producer.submit_batch`: :meth:`submit` for a batch to one queue."""
        out = self._handoff.put("submit_batch", topic, messages, kwargs)
        if callback is not None:
            out.add_done_callback(callback)
        return out

    def submit_many(
        self, topic: str, bodies: Sequence[bytes], **kwargs: Any
    ) -> concurrent.futures.Future[list[SendResult | SendError]]:
        """:meth:`Producer.submit_many`: one future for the call, whose ``result()`` is
        each message's :class:`SendResult` or :class:`SendError`, in order, once every
        message is done. Bad input raises TypeError here; an unknown topic fails the future."""
        items = check_many_input(topic, bodies)
        return self._handoff.put("submit_many", topic, items, kwargs)  # type: ignore[return-value]

    def flush(self) -> None:
        """:meth:`Producer.flush`: until every message submitted before is answered
        (stored or failed for good)."""
        self._handoff.drain()
        self._portal.call(self.producer.flush)

    def close(self) -> None:
        """Hand every message submitted over, then close the producer (which flushes,
        within the retry budget, then fails what is left: see each future)."""
        self._finalizer.detach()
        _close(self._handoff, self._portal)

    def __enter__(self) -> BlockingProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockingConsumer:
    """``poll()`` returns the next batch (acknowledging the previous); see :class:`Consumer`."""

    def __init__(
        self,
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
    ) -> None:
        options = options_from(ConsumerOptions, locals())
        namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # errors here, before the thread starts
        resolve_security(security)  # errors here, before the thread starts
        self._portal = _Portal(lambda: consumer_context(namesrv, brokers, group, subscriptions, options))
        self.consumer: Consumer = self._portal.value

    def poll(self, timeout_s: float = 1.0) -> list[Record]:
        """The next batch, or [] if none came within ``timeout_s``."""

        async def receive() -> list[Record]:
            with trio.move_on_after(timeout_s):
                return await self.consumer.receive()
            return []

        return self._portal.call(receive)

    @property
    def errors(self) -> dict[MessageQueue, DamagedQueueError]:
        """A copy of :attr:`Consumer.errors`: the queues stopped at a damaged record."""

        async def copy() -> dict[MessageQueue, DamagedQueueError]:
            return dict(self.consumer.errors)

        return self._portal.call(copy)

    def commit(self) -> None:
        self.consumer.ack()
        self._portal.call(self.consumer.commit)

    def nack(self, records: Sequence[Record], delay_ms: int | None = None) -> list[SendBackResult]:
        """:meth:`Consumer.nack`: ``records`` (from the last :meth:`poll`) failed:
        delivered again later (orderly: in place); raises :class:`SendBackError`."""
        return self._portal.call(self.consumer.nack, records, delay_ms)

    reconsume_later = nack

    def run(
        self,
        handler: Callable[[Record], ConsumeStatus | None],
        *,
        max_messages: int | None = None,
        poll_timeout_s: float = 1.0,
    ) -> int:
        """:meth:`Consumer.run` with a plain ``handler(record)`` called in this thread
        (returning ``ConsumeStatus`` or None; an exception is RECONSUME_LATER). Returns
        the number of messages handled, after ``max_messages`` (None: runs until
        interrupted, e.g. by Ctrl-C: what was not handled then is delivered again)."""
        check_limit(max_messages)
        redelivery = self.consumer.redelivery
        handled = 0
        while max_messages is None or handled < max_messages:
            records = self.poll(poll_timeout_s)
            if not records:
                continue
            limit = None if max_messages is None else max_messages - handled
            rnd: Round = self._portal.call(self._sync, redelivery.round, records, limit)
            try:
                for r in rnd.todo():
                    rnd.done(r, judge_sync(handler, r))
            except BaseException:
                self._portal.call(self._sync, redelivery.abandon, rnd)
                raise
            handled += rnd.handled
            self._portal.call(redelivery.settle, rnd)
        return handled

    @staticmethod
    async def _sync(fn: Callable[..., T], *args: Any) -> T:
        """A plain call run in the client's thread (it reads the consumer's state)."""
        return fn(*args)

    def close(self) -> None:
        self._portal.close()

    def __enter__(self) -> BlockingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockingPopConsumer:
    """The :class:`PopConsumer` for plain synchronous Python (a trio loop in a thread):
    ``receive()``, ``ack``, ``nack``, ``extend``, ``run(handler)``; see :func:`open_pop_consumer`."""

    def __init__(
        self,
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
    ) -> None:
        options = options_from(PopConsumerOptions, locals())
        namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # errors here, before the thread starts
        resolve_security(security)  # errors here, before the thread starts
        self._portal = _Portal(lambda: pop_consumer_context(namesrv, brokers, group, subscriptions, options))
        self.consumer: PopConsumer = self._portal.value

    def receive(self, timeout_s: float = 1.0) -> list[Record]:
        """:meth:`PopConsumer.receive`, or [] if nothing came within ``timeout_s``."""
        return self._take(self.consumer.receive, timeout_s)

    poll = receive

    def _take(self, fn: Callable[[], Awaitable[list[Record]]], timeout_s: float) -> list[Record]:
        async def take() -> list[Record]:
            with trio.move_on_after(timeout_s):
                return await fn()
            return []

        return self._portal.call(take)

    def ack(self, records: Sequence[Record]) -> list[str]:
        """:meth:`PopConsumer.ack`: a status per record (``ok``, ``expired``, ...)."""
        return self._portal.call(self.consumer.ack, records)

    def nack(self, records: Sequence[Record], delay_ms: int | None = None) -> list[str]:
        """:meth:`PopConsumer.nack`: delivered again after ``delay_ms`` (None: the back-off)."""
        return self._portal.call(self.consumer.nack, records, delay_ms)

    def extend(self, records: Sequence[Record], invisible_time_ms: int) -> list[str]:
        """:meth:`PopConsumer.extend`: kept with this member ``invisible_time_ms`` from now."""
        return self._portal.call(self.consumer.extend, records, invisible_time_ms)

    @property
    def stats(self) -> PopStats:
        """:attr:`PopConsumer.stats` (counts: acked, ack_expired, ...)."""
        return self.consumer.stats

    def run(
        self,
        handler: Callable[[Record], ConsumeStatus | None],
        *,
        max_messages: int | None = None,
        poll_timeout_s: float = 1.0,
    ) -> int:
        """:meth:`PopConsumer.run` with a plain ``handler(record)`` called in a pool of
        ``handler_concurrency`` threads (returning ``ConsumeStatus`` or None; an exception
        is RECONSUME_LATER). Returns the number of messages handled, after
        ``max_messages`` (None: runs until interrupted)."""
        check_limit(max_messages)
        c = self.consumer
        slots = threading.Semaphore(c.options.handler_concurrency)
        budget, changed, futures = Budget(max_messages), threading.Condition(), []

        def work(lane: list[Record]) -> None:
            n = 0
            try:
                for i, record in enumerate(lane):
                    n = i + 1
                    if judge_sync(handler, record):
                        self.ack([record])
                        continue
                    orderly = c.options.orderly
                    self.nack(failed_part(lane, i, orderly), c.delay_of(record) if orderly else None)
                    return
            finally:
                with changed:
                    budget.done(len(lane), n)
                    changed.notify_all()
                slots.release()

        with concurrent.futures.ThreadPoolExecutor(c.options.handler_concurrency, "clmq-pop-handler") as pool:
            while True:
                slots.acquire()
                with changed:
                    changed.wait_for(lambda: not budget.full() or budget.finished())
                    if budget.finished():
                        break
                lane = self._take(c.take_lane, poll_timeout_s)
                if not lane:
                    slots.release()
                    continue
                with changed:
                    lane, extra = budget.take(lane)
                if extra:
                    self._portal.call(c.release, extra)
                futures.append(pool.submit(work, lane))
        for f in futures:
            f.result()  # a handler's BaseException (judge_sync keeps Exceptions) comes out here
        return budget.handled

    def close(self) -> None:
        self._portal.close()

    def __enter__(self) -> BlockingPopConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockingAdmin:
    """The :class:`Admin` calls, blocking: ``BlockingAdmin(ns).create_topic("t", 8)``."""

    def __init__(
        self,
        namesrv_addrs: str | Sequence[str] | None = None,
        *,
        broker_addrs: str | Sequence[str] | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # a string or a list, or $CLMQ_NAMESRV
        resolved = resolve_security(security)  # errors here, before the thread starts
        self._portal = _Portal(lambda: open_admin(namesrv, broker_addrs=brokers or None, security=resolved))
        self.admin: Admin = self._portal.value

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.admin, name)
        return lambda *a, **k: self._portal.call(fn, *a, **k)

    def close(self) -> None:
        self._portal.close()

    def __enter__(self) -> BlockingAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
