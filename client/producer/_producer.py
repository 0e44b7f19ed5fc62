"""The producer: sends messages to the queues of a topic, chosen round robin, by a
sharding key (one key, one queue, in order) or by a function; retries elsewhere, or on
the same queue when a replicated group's followers are behind (sync acks). Sends go
through the accumulator (``_accumulator``): concurrent sends to one broker share
requests."""

from __future__ import annotations

import contextlib
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime
from typing import AsyncIterator, Awaitable, Literal, Mapping, Sequence, Unpack

import trio

from clmq.common import Message
from clmq.protocol import RequestCode, encode_batch
from clmq.protocol.transport import ClientSecurity, RpcClient, background_nursery

from .._arguments import options_from, resolve_addrs, resolve_security
from .._routes import MessageQueue, Routes
from .._trace import TRACE_WRITER_OPTIONS, SendTracer, client_name, send_tracer
from ._accumulator import Accumulator
from ._batch import Batch
from ._checkback import start_check_back
from ._encode import PLAIN_CHECKED, MessageIds, encode_one, encode_plain
from ._future import (
    UNIQ_KEY,
    BatchTooLargeError,
    BufferFullError,
    DoneCallback,
    SendError,
    SendFuture,
    SendFutures,
    SendResult,
)
from ._many import submit_many
from ._options import ProducerOptions
from ._room import check_size, reserve
from ._scheduled import due_ms, send_scheduled, start_scheduled
from ._sender import send_to
from ._transaction import TransactionListener, TransactionResult, TransactionSend, send_in_transaction
from ._tries import AMBIGUOUS, RETRIABLE, SAME_QUEUE, QueueSelector, RetryPolicy, Targets, Tries, shard

__all__ = [
    "AMBIGUOUS",
    "RETRIABLE",
    "SAME_QUEUE",
    "UNIQ_KEY",
    "BatchTooLargeError",
    "BufferFullError",
    "Producer",
    "ProducerOptions",
    "QueueSelector",
    "SendError",
    "SendFuture",
    "SendFutures",
    "SendResult",
    "open_producer",
    "producer_context",
    "shard",
]

_NO_QUEUE = MessageQueue("", "", -1, "")  # a batch's queue before its first try found one


class Producer:
    """Use :func:`open_producer` (trio) or :class:`client.BlockingProducer`.

    Retries: a send is tried at least ``1 + retries`` times and, beyond that, until
    ``retry_budget_ms`` has passed since it was submitted (Kafka's
    ``delivery.timeout.ms``), waiting ``retry_backoff_ms`` before a retry, doubled each
    time up to ``retry_backoff_max_ms``. Default: ``retries`` 2 and a budget of 15 s;
    giving ``retries`` without ``retry_budget_ms`` keeps the count-only behaviour of
    earlier versions (budget 0). Only retriable failures are retried (see
    :meth:`send_batch`). ``unique_ids`` (default on) gives messages their
    ``UNIQ_KEY``: off, retries after an unknown outcome may store a batch twice.

    Batching (the accumulator): sends wait in per-queue buffers; one request to a
    broker carries every ready queue's batches of a topic, up to ``batch_max_bytes``
    (a larger batch goes alone), once that much is waiting or the oldest has waited
    ``linger_ms`` (0: at once, coalescing what arrives meanwhile), with at most
    ``max_in_flight`` requests per broker. Per queue, batches are stored in the order
    submitted, retries included: a queue with a batch in flight sends no other until
    its answer. ``buffer_max_bytes``: encoded bytes accepted and not yet answered; when
    full, ``buffer_full="block"`` waits up to ``buffer_block_max_ms`` for room, then
    raises :class:`BufferFullError` (``"raise"``: at once). A batch larger than
    ``buffer_max_bytes`` is refused at once (:class:`BatchTooLargeError`).
    """

    def __init__(
        self,
        rpc: RpcClient,
        routes: Routes,
        options: ProducerOptions | None = None,
        *,
        nursery: trio.Nursery | None = None,
    ) -> None:
        self.rpc = rpc
        self.routes = routes
        self.options = options = options or ProducerOptions()
        self.policy = options.retry_policy()
        self.targets = Targets(routes, self.policy)
        self.ids = MessageIds(options.unique_ids)
        self._scheduled: set[SendFuture] = set()  # scheduled sends not answered yet
        # Without a nursery (a Producer made by hand) only send_to and send_oneway work.
        self._acc = Accumulator(rpc, self.targets, self.policy, options, nursery) if nursery is not None else None
        self.tracer: SendTracer | None = None  # trace=True: records a `sent` event per message (docs/traces.md)

    async def send(
        self,
        topic: str,
        body: bytes,
        *,
        tags: str = "",
        keys: str = "",
        properties: Mapping[str, str] | None = None,
        sharding_key: str | None = None,
        selector: QueueSelector | None = None,
        delay_ms: float | None = None,
        deliver_at: int | datetime | None = None,
    ) -> SendResult:
        """Send one message; returns where it was stored (:meth:`submit`, then wait).

        ``delay_ms`` or ``deliver_at`` (epoch ms, or an aware datetime) schedule it: the
        broker stores it now and delivers it into the queue picked now once, at that
        time (within ``timer_tick_ms``), across broker restarts; the result's message
        id is then the scheduled copy's, for :meth:`Admin.cancel_message`."""
        fut = await self.submit(
            topic,
            body,
            tags=tags,
            keys=keys,
            properties=properties,
            sharding_key=sharding_key,
            selector=selector,
            delay_ms=delay_ms,
            deliver_at=deliver_at,
        )
        return await fut.wait()

    async def send_batch(
        self,
        topic: str,
        messages: Sequence[Message | bytes],
        *,
        sharding_key: str | None = None,
        selector: QueueSelector | None = None,
        delay_ms: float | None = None,
        deliver_at: int | datetime | None = None,
    ) -> SendResult:
        """Send messages as one batch to one queue (in order, stored together). The
        producer sets the messages' ``queue_id`` to the queue it picks, and gives each
        message without one a unique id, the property ``UNIQ_KEY``.

        Retries (see the class): a busy, failing or unreachable broker, or a stale
        route, elsewhere (fresh routes). After a failure whose outcome is unknown (the
        connection broke after sending, no answer in ``send_timeout_ms``,
        REPLICATION_TIMEOUT, NOT_LEADER), and after NOT_ENOUGH_REPLICAS, to *the same
        queue* (same group and queue id, its leader's address looked up again) while the
        routes still have that group: the batch keeps its place in the queue's order,
        and the retry is marked ``dedup`` so that the broker answers with the offsets of
        a first try that was in fact stored instead of storing it twice (within the
        broker's ``dedup_window_ms``). NOT_LEADER naming the new leader is retried there
        at once. A send that fails for good raises :class:`SendError` whose ``code`` is
        the last broker's error code (e.g. NOT_ENOUGH_REPLICAS). ``delay_ms`` /
        ``deliver_at``: every message of the batch is scheduled (see :meth:`send`)."""
        fut = await self.submit_batch(
            topic, messages, sharding_key=sharding_key, selector=selector, delay_ms=delay_ms, deliver_at=deliver_at
        )
        return await fut.wait()

    async def submit(
        self,
        topic: str,
        body: bytes,
        *,
        tags: str = "",
        keys: str = "",
        properties: Mapping[str, str] | None = None,
        sharding_key: str | None = None,
        selector: QueueSelector | None = None,
        callback: DoneCallback | None = None,
        delay_ms: float | None = None,
        deliver_at: int | datetime | None = None,
    ) -> SendFuture:
        """Buffer one message and return at once (waiting only for buffer room): the
        :class:`SendFuture` resolves once the broker answered (or the tries are spent).
        ``callback(future)`` is called then, on the producer's trio thread. Raises at
        once: :class:`BufferFullError`, :class:`BatchTooLargeError`, NoRouteError for an
        unknown topic, SendError for an error not worth a retry. ``delay_ms`` /
        ``deliver_at``: scheduled (see :meth:`send`), sent at once in a request of its own."""
        acc = self._acc
        if acc is None or acc.closing:
            acc = self._accumulator()  # raises why
        msg, uniq, plain = self.ids.message(topic, body, tags, keys, properties)
        due = due_ms(delay_ms, deliver_at)
        if due is not None:
            return self._schedule(acc, topic, [msg], uniq, due, sharding_key, selector, callback)
        mq = self.targets.pick_now(topic, msg, sharding_key, selector)
        tries = None
        if mq is None:
            mq, tries = await self.targets.first(topic, msg, sharding_key, selector)
        if mq is not None:
            msg.queue_id = mq.queue_id
        if plain and PLAIN_CHECKED:
            chunk = encode_plain(msg.queue_id, msg.born_timestamp_ms, uniq[0], body)
        else:
            chunk = encode_one(msg)
        size = len(chunk)
        if size > acc.size_max_bytes:
            check_size(acc, size)  # raises why
        if acc.buffered_bytes + size <= acc.buffer_max_bytes and not acc.closing:  # reserve_now, inline
            acc.buffered_bytes += size
        else:
            await reserve(acc, size)
        fut = SendFuture()
        if callback is not None:
            fut._callbacks = [callback]  # add_done_callback of a future not done (no call)
        if mq is None or topic in acc.unrouted:  # no queue now, or behind batches that had none
            batch = Batch(topic, msg, 1, uniq, chunk, fut, _NO_QUEUE, acc.gen, sharding_key, selector, True)
            batch.tries = tries or Tries(self.policy, batch.created)
            acc.add_retry(batch)
        elif acc.add_one(mq, msg, uniq, chunk, fut, sharding_key, selector, plain):
            await trio.lowlevel.checkpoint()  # a sender has a request to make
        if self.tracer is not None:
            self.tracer.watch(fut, (msg,))
        return fut

    async def submit_many(
        self,
        topic: str,
        bodies: Sequence[bytes],
        *,
        tags: str = "",
        keys: str = "",
        properties: Mapping[str, str] | None = None,
        sharding_key: str | None = None,
        selector: QueueSelector | None = None,
    ) -> SendFutures:
        """:meth:`submit` for many messages at once, for a fraction of its cost per
        message: round robin over the queues, to the sharding key's queue, or where
        ``selector`` puts each; in order per queue. Returns a :class:`SendFutures`
        (message ``i``'s future at ``[i]``; ``await wait()``: each message's result or
        error). Errors are results; bad input raises (see ``_many``)."""
        return await submit_many(self, topic, bodies, tags, keys, properties, sharding_key, selector)

    async def submit_batch(
        self,
        topic: str,
        messages: Sequence[Message | bytes],
        *,
        sharding_key: str | None = None,
        selector: QueueSelector | None = None,
        callback: DoneCallback | None = None,
        delay_ms: float | None = None,
        deliver_at: int | datetime | None = None,
    ) -> SendFuture:
        """:meth:`submit` for messages sent as one batch to one queue (see :meth:`send_batch`)."""
        acc = self._accumulator()
        msgs = [m if isinstance(m, Message) else Message(topic, 0, m) for m in messages]
        if not msgs:
            raise ValueError("send_batch needs at least one message")
        uniq = self.ids.identify(msgs)
        due = due_ms(delay_ms, deliver_at)
        if due is not None:
            return self._schedule(acc, topic, msgs, uniq, due, sharding_key, selector, callback)
        mq, tries = self.targets.pick_now(topic, msgs[0], sharding_key, selector), None
        if mq is None:
            mq, tries = await self.targets.first(topic, msgs[0], sharding_key, selector)
        qid = mq.queue_id if mq is not None else 0
        for m in msgs:
            m.queue_id = qid
        fut = SendFuture()
        batch = Batch(
            topic,
            msgs[0],
            len(msgs),
            uniq,
            encode_batch(msgs),
            fut,
            mq or _NO_QUEUE,
            acc.gen,
            sharding_key,
            selector,
            False,
        )
        fut = await _buffer(self.policy, acc, batch, mq, tries, callback)
        if self.tracer is not None:
            self.tracer.watch(fut, msgs)
        return fut

    def _schedule(
        self,
        acc: Accumulator,
        topic: str,
        msgs: list[Message],
        keys: Sequence[str],
        due: int,
        sharding_key: str | None,
        selector: QueueSelector | None,
        callback: DoneCallback | None,
    ) -> SendFuture:
        def send() -> Awaitable[SendResult]:
            return send_scheduled(self.send_to, self.targets, self.policy, topic, msgs, due, sharding_key, selector)

        fut = start_scheduled(acc.nursery, self._scheduled, keys, send, callback)
        if self.tracer is not None:  # `sent` names the scheduled copy (in %TIMER%)
            self.tracer.watch(fut, msgs, scheduled_at_ms=due)
        return fut

    def _accumulator(self) -> Accumulator:
        if self._acc is None:
            raise RuntimeError("this Producer has no nursery for its senders: open it with open_producer()")
        if self._acc.closing:
            raise SendError("producer closed")
        return self._acc

    async def flush(self) -> None:
        """Wait until every message submitted before the call is answered (stored, or
        failed for good); buffered messages are sent at once (no linger)."""
        if self._acc is not None:
            await self._acc.flush()
        for fut in list(self._scheduled):  # scheduled sends run on their own
            with contextlib.suppress(SendError):
                await fut.wait()

    async def aclose(self) -> None:
        """Flush (for at most the retry budget), then fail whatever is left with
        SendError("producer closed"); later submits are refused. ``open_producer`` does
        this on leaving."""
        if self._acc is not None:
            policy = self.policy
            bound_ms = policy.retry_budget_ms + (policy.retries + 1) * self.options.send_timeout_ms
            with trio.move_on_after(bound_ms / 1000):
                for fut in list(self._scheduled):
                    with contextlib.suppress(SendError):
                        await fut.wait()
            for fut in list(self._scheduled):
                fut._fail(SendError("producer closed"))
            await self._acc.aclose(bound_ms / 1000)

    async def send_in_transaction(self, topic: str, body: bytes, **how: Unpack[TransactionSend]) -> TransactionResult:
        """A transactional message: stored unseen, ``execute(message, arg)`` or the listener run, then ended."""
        return await send_in_transaction(self, self.options.transaction_listener, topic, body, **how)

    async def send_to(self, mq: MessageQueue, body: bytes, count: int, *, dedup: bool = False) -> SendResult:
        """Send an encoded batch (``encode_batch`` of messages whose ``queue_id`` is
        ``mq.queue_id``) to one queue at once: no accumulator, no retries. ``dedup``:
        the broker answers with the offsets of the same batch (by ``UNIQ_KEY``) if it
        has stored it already."""
        return await send_to(self.rpc, mq, body, self.options.send_timeout_ms, dedup)

    async def send_oneway(
        self, topic: str, body: bytes, *, tags: str = "", keys: str = "", sharding_key: str | None = None
    ) -> None:
        """Send without waiting for (or getting) an answer: fastest, no guarantee."""
        mq = await self.targets.pick(topic, Message(topic, 0, body, tags, keys), sharding_key, None, refresh=False)
        msg = Message(topic, mq.queue_id, body, tags, keys, born_timestamp_ms=int(time.time() * 1000))
        await self.rpc.oneway(mq.addr, RequestCode.SEND_MESSAGE, {"topic": topic}, encode_batch([msg]))


async def _buffer(
    policy: RetryPolicy,
    acc: Accumulator,
    batch: Batch,
    mq: MessageQueue | None,
    tries: Tries | None,
    callback: DoneCallback | None,
) -> SendFuture:
    """Reserve the batch's bytes, then queue it (or, without a queue now, retry it)."""
    check_size(acc, batch.size)
    if not acc.reserve_now(batch.size):
        await reserve(acc, batch.size)
        batch.gen = acc.gen  # a flush may have begun meanwhile
    fut = batch.futures[0]
    if callback is not None:
        fut.add_done_callback(callback)
    if mq is None or batch.topic in acc.unrouted:  # no queue now, or behind batches that had none
        batch.tries = tries or Tries(policy, batch.created)
        acc.add_retry(batch)
    elif acc.add(mq, batch):
        await trio.lowlevel.checkpoint()  # a sender has a request to make
    return fut


@asynccontextmanager
async def open_producer(
    namesrv_addrs: str | Sequence[str] | None = None,
    *,
    broker_addrs: str | Sequence[str] | None = None,
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
) -> AsyncIterator[Producer]:
    """A producer for trio code: ``async with open_producer("127.0.0.1:9876") as p:``.

    Addresses: name servers (``"h1:9876,h2:9876"`` or a list), or ``broker_addrs`` for a
    direct connection; neither: ``$CLMQ_NAMESRV``. The options are
    :class:`ProducerOptions` (see :class:`Producer`); a bad value is a ``ValueError``
    on entering. On leaving, buffered messages are sent (``aclose``: flushed, within
    the retry budget)."""
    options = options_from(ProducerOptions, locals())
    async with producer_context(namesrv_addrs, broker_addrs, options) as producer:
        yield producer


@asynccontextmanager
async def producer_context(
    namesrv_addrs: str | Sequence[str] | None, broker_addrs: str | Sequence[str] | None, options: ProducerOptions
) -> AsyncIterator[Producer]:
    """:func:`open_producer` with its options as one object (the asyncio and blocking
    producers check theirs before they start a loop)."""
    namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)
    security = resolve_security(options.security)
    async with background_nursery() as nursery:
        rpc = RpcClient(nursery, security=security)
        producer = None
        checks: trio.CancelScope | None = None  # the check-back (transactions)
        try:
            routes = Routes(rpc, namesrv, broker_addrs=brokers)
            producer = Producer(rpc, routes, options, nursery=nursery)
            checks = start_check_back(nursery, producer)  # with a transaction group and listener
            if options.trace:  # its records go through a producer of its own
                wrpc = RpcClient(nursery, security=security)  # a connection of its own: user sends never wait behind it
                writer_routes = Routes(wrpc, namesrv, broker_addrs=brokers)
                writer = Producer(wrpc, writer_routes, replace(options, **TRACE_WRITER_OPTIONS), nursery=nursery)
                producer.tracer = send_tracer(writer, nursery, options, client_name(producer))
            yield producer
        finally:
            if checks is not None:
                checks.cancel()
            try:
                if producer is not None:
                    await producer.aclose()
                    if producer.tracer is not None:
                        await producer.tracer.aclose()
            finally:
                await rpc.aclose()
                nursery.cancel_scope.cancel()
