"""The consumer: a member of a consumer group, pulling the queues it is assigned.

- Clustering mode: the group's queues are split over its members by every member
  alike (:func:`allocate_averagely` over sorted members and queues), re-run when
  members or routes change; offsets are committed to the brokers.
- Broadcasting mode: every member reads every queue; offsets stay with the member.
- At least once: a batch's offsets are committed only after it was processed, which
  is when the next :meth:`Consumer.receive` is called (or :meth:`Consumer.ack`, which
  can also acknowledge part of a batch), or when the ``async with`` block ends
  normally. A block left by an exception (Ctrl-C included) does not acknowledge what
  the last receive returned: it is delivered again.
- A queue whose next record is damaged on its broker is not read past: it is listed
  in :attr:`Consumer.errors` (and logged once), paused and asked again every
  ``damaged_queue_retry_ms``; the other queues are consumed as usual.
- Replicated groups: commits, heartbeats and offset look-ups go to each group's leader
  (:attr:`MessageQueue.addr`). Pulls go there too, unless ``read_from_followers`` is
  set or the leader hinted that this consumer is far behind (then for
  ``follower_read_hold_ms``): those pulls go to one of the group's followers, which
  serve up to the confirmed offset, and fall back to the leader while it fails
  (:class:`ReadRouter`).
- Redelivery (clustering mode): :meth:`Consumer.nack` hands failed messages back to
  their broker (CONSUMER_SEND_BACK), which redelivers them to this group through
  ``%RETRY%<group>`` after a back-off (a consumer subscribes to it by itself), or puts
  them in ``%DLQ%<group>`` once they failed ``max_reconsume_times`` times.
  :meth:`Consumer.run` calls a handler per message and does the rest.
- Orderly (``orderly=True``): a queue is read only while this member holds its lock
  on the group's leader (``_orderly.py``), so that no two members process it at once,
  even while the group rebalances; a failed message is retried in place, its queue
  waiting behind it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable, Literal, Sequence

import trio

from clmq.common import Record, collector_paused, retry_topic
from clmq.protocol import RequestCode
from clmq.protocol.transport import ClientSecurity, RpcClient, background_nursery

from .._arguments import options_from, resolve_addrs, resolve_security
from .._routes import MessageQueue, ReadRouter, Routes
from .._trace import TRACE_WRITER_OPTIONS, consume_tracer
from ..producer import Producer, ProducerOptions
from ._commits import Commits
from ._fetcher import Fetcher
from ._membership import Membership
from ._options import ConsumerOptions, TagFilter
from ._orderly import QueueLocks
from ._redelivery import Handler, Redelivery, SendBackResult
from ._requests import NET_ERRORS, Requests
from ._state import ConsumerState, QueueState

log = logging.getLogger("clmq.consumer")


class Consumer:
    """Use :func:`open_consumer` (trio) or :class:`client.BlockingConsumer`."""

    def __init__(
        self, rpc: RpcClient, routes: Routes, group: str, subscriptions: dict[str, str], options: ConsumerOptions
    ) -> None:
        self.rpc, self.routes, self.group, self.options = rpc, routes, group, options
        self.filters = {topic: TagFilter(expr) for topic, expr in subscriptions.items()}
        # Messages this group failed on come back through its retry topic (not to an
        # orderly consumer: it retries in place). It exists from the group's first send-back.
        self.retry_topic = retry_topic(group) if options.mode == "clustering" and not options.orderly else None
        if self.retry_topic is not None:
            self.filters.setdefault(self.retry_topic, TagFilter("*"))
        self.client_id = options.client_id or f"{socket.gethostname()}@{os.getpid()}@{id(self):x}"
        # What the parts below share (none of them holds a reference to the consumer).
        self.state = state = ConsumerState(group, self.client_id, options, self.filters, self.retry_topic)
        self.assigned, self.processed, self.errors = state.assigned, state.processed, state.errors
        self.prefetch, self.pending = state.prefetch, state.pending
        self._generation = 0
        self.requests = Requests(rpc, routes, state)
        self.commits = Commits(state, self.requests)
        self._fetcher: Fetcher | None = None
        self.reads = ReadRouter(
            routes,
            always=options.read_from_followers,
            hold_ms=options.follower_read_hold_ms,
            failure_backoff_ms=options.follower_failure_backoff_ms,
            seed=self.client_id,
        )
        # Orderly: the queue locks (None otherwise).
        self.locks = (
            QueueLocks(
                state, self.requests, self.commits, take=self.take_queue, stop=self.stop_queue, drop=self.drop_queue
            )
            if options.orderly
            else None
        )
        self.redelivery = Redelivery(state, self.requests, self.locks, self.receive, self.ack, self.rewind)
        self.membership = Membership(state, self.requests, routes, current=self.current, apply_share=self.apply_share)
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ public
    async def receive(self) -> list[Record]:
        """The next messages (waits for some): everything buffered, across queues, up
        to ``receive_max_messages`` (a queue's batch is not split), each queue's in
        order. Acknowledges what the previous call returned."""
        while True:
            with collector_paused():  # a batch per queue, and a commit entry: 1,024 per answer when sparse
                self.ack()  # the previous call's (or batches with nothing to process: filtered out)
                records = self._take()
            if records:
                return records
            await self.prefetch.arrival()

    def _take(self) -> list[Record]:
        """Buffered batches up to ``receive_max_messages``, made pending."""
        limit, buffer, assigned, pending = self.options.receive_max_messages, self.prefetch, self.assigned, self.pending
        locks, now = self.locks, trio.current_time()
        lists: list[list[Record]] = []
        n = 0
        while buffer.batches:
            size = len(buffer.batches[0].records)
            if n and n + size > limit:
                break
            batch = buffer.pop()
            current = assigned.get(batch.mq)
            if current is None or current.generation != batch.generation or current.stopped:
                continue  # pulled before a rebalance took the queue away: its new owner reads it
            if locks is not None:
                if not locks.holds(batch.mq, now):  # its lease may have ended: stop, unacknowledged
                    locks.lapse(batch.mq, "its lease ended before a renewal was granted")
                    continue
                self.redelivery.mark_attempt(batch)
            pending.append(batch)
            if size:
                lists.append(batch.records)
                n += size
                if self.state.tracer is not None:
                    self.state.tracer.delivered(batch.mq, batch.records)
        if len(lists) == 1:
            return lists[0]
        return [r for records in lists for r in records]

    def ack(self, records: Sequence[Record] | None = None) -> None:
        """Mark the messages last returned by :meth:`receive` as processed: all of
        them, or (``records``) only those and the ones before them in their queue.
        Either way the rest of what receive returned is no longer pending: call it
        with ``records`` when you stop part-way through (Ctrl-C, a count reached), and
        what was not processed is delivered again to the group's next reader."""
        if not self.pending:
            return
        pending = self.pending.take()
        assigned, processed = self.assigned, self.processed
        upto = None if records is None else _last_offsets(records)
        if self.state.tracer is not None:  # the batches of queues still this consumer's
            still = [b for b in pending if (q := assigned.get(b.mq)) is not None and q.generation == b.generation]
            self.state.tracer.acked_batches(still, upto)
        for batch in pending:  # a queue's batches in order: its last one wins
            current = assigned.get(batch.mq)
            if current is None or current.generation != batch.generation:
                continue
            if upto is None:
                processed[batch.mq] = batch.next_offset
            elif (batch.mq.topic, batch.mq.queue_id) in upto and batch.records:
                last = upto[batch.mq.topic, batch.mq.queue_id]
                if last >= batch.records[-1].queue_offset:  # all of this batch (and what its filter skipped)
                    processed[batch.mq] = batch.next_offset
                elif last >= batch.records[0].queue_offset:  # part of it
                    processed[batch.mq] = last + 1

    async def nack(self, records: Sequence[Record], delay_ms: int | None = None) -> list[SendBackResult]:
        """``records`` (of what the last :meth:`receive` returned) failed: deliver them to
        the group again later (clustering mode only, else ``ValueError``). Each goes
        back to its broker, which redelivers it through ``%RETRY%<group>`` after
        ``delay_ms`` (default: ``retry_delays_ms`` for its attempt, else the broker's
        back-off), or moves it to ``%DLQ%<group>`` once it failed
        ``max_reconsume_times`` times; sent back, it counts as processed. Returns a
        :class:`SendBackResult` per record. :class:`SendBackError`: some were not sent
        back within ``retry_budget_ms``; their queues are read again from the first.
        Orderly: retried in place, see :class:`Redelivery`."""
        return await self.redelivery.nack(records, delay_ms)

    reconsume_later = nack

    async def run(self, handler: Handler, *, max_messages: int | None = None) -> int:
        """Receive and hand each message to ``handler(record)`` (plain or async), which
        returns ``ConsumeStatus.SUCCESS`` (or None) or ``ConsumeStatus.RECONSUME_LATER``;
        an exception counts as RECONSUME_LATER (logged with its traceback). Failed
        messages are :meth:`nack`-ed (orderly: a queue stops at its failed message,
        retried in place, the ones before it acknowledged), the rest acknowledged.
        Returns the number of messages handled, after ``max_messages`` (None: runs
        until cancelled); messages received beyond it are delivered again. In
        broadcasting mode failures are logged and not retried."""
        return await self.redelivery.handle_rounds(handler, max_messages)

    def rewind(self, mq: MessageQueue, offset: int, delay_s: float = 0.0) -> None:
        """Read ``mq`` again from ``offset`` (after ``delay_s``): processed up to it, its
        pending and buffered batches dropped (not acknowledged)."""
        state = self.assigned.get(mq)
        if state is None:
            return
        self.pending.drop(mq)
        self.processed[mq] = offset
        if self.locks is not None and mq in self.locks.releasing:
            return  # being released: committed at the offset, never read again here
        self._generation += 1
        new = self.assigned[mq] = QueueState(self._generation, offset, stopped=True)
        assert self._fetcher is not None and self._nursery is not None
        if delay_s > 0:
            self._nursery.start_soon(self._resume_after, mq, new, delay_s)
        else:
            self._fetcher.resume(mq, new)

    async def _resume_after(self, mq: MessageQueue, state: QueueState, delay_s: float) -> None:
        await trio.sleep(delay_s)
        if self._fetcher is not None and not (self.locks is not None and mq in self.locks.releasing):
            self._fetcher.resume(mq, state)

    def assignment(self) -> list[MessageQueue]:
        return sorted(self.assigned)

    async def commit(self) -> None:
        """Commit processed offsets to the brokers now (clustering mode)."""
        if self.options.mode == "clustering":
            await self.commits.commit_changed()

    # ------------------------------------------------------------- background
    async def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._fetcher = Fetcher(self.state, self.requests, self.reads, nursery)
        if self.locks is not None:
            self.locks.start(nursery)
        await self.membership.heartbeat()
        await self.membership.rebalance()
        nursery.start_soon(self._every, self.options.heartbeat_interval_ms, self.membership.heartbeat)
        nursery.start_soon(self.membership.rebalance_loop)
        nursery.start_soon(self._every, self.options.commit_interval_ms, self.commit)

    async def _close(self, *, ack_pending: bool = True) -> None:
        """Commit and leave the group. ``ack_pending`` false (the block was left by an
        exception, e.g. Ctrl-C): what receive returned last is not acknowledged."""
        if ack_pending:
            self.ack()
        with trio.CancelScope(shield=True), trio.move_on_after(3):
            await self.commit()
            for addr in await self.membership.broker_addrs():
                try:
                    await self.requests.request(addr, RequestCode.UNREGISTER_CLIENT, {"client_id": self.client_id})
                except NET_ERRORS:
                    pass

    async def _every(self, interval_ms: int, fn: Callable[[], Awaitable[object]]) -> None:
        while True:
            await trio.sleep(interval_ms / 1000)
            await fn()

    async def apply_share(self, wanted: set[MessageQueue]) -> None:
        """Read the queues of this member's share (:class:`Membership`): queues whose
        group has a new leader move, the others are released or taken (orderly: locked
        first, released once their batch is acknowledged)."""
        if self.locks is not None:
            self.locks.rebalance(wanted)
            return
        if self.assigned.keys() == wanted:  # the usual round: nothing to do for 65,536 queues
            return
        for old, new in _moved(set(self.assigned), wanted).items():
            self._move(old, new)
        for mq in [mq for mq in self.assigned if mq not in wanted]:
            await self._revoke(mq)
        with collector_paused():  # a state, a look-up and a log line per queue: 65,536 at a start
            self._assign_all(sorted(wanted - set(self.assigned)))

    def current(self) -> set[MessageQueue]:
        """The queues this member reads or (orderly) wants to."""
        return set(self.assigned) | (self.locks.wanted if self.locks is not None else set())

    def stop_queue(self, mq: MessageQueue) -> None:
        """Neither fetch ``mq`` nor hand it out from now on (orderly: being released)."""
        state = self.assigned.get(mq)
        if state is not None:
            state.stopped = True

    async def commit_queue(self, mq: MessageQueue) -> None:
        """Commit ``mq``'s processed offset now (if it moved)."""
        await self.commits.commit_queue(mq)

    def take_queue(self, mq: MessageQueue) -> None:
        """Orderly: the queue's lock was granted: read it from the committed offset."""
        self._assign(mq)

    def drop_queue(self, mq: MessageQueue) -> None:
        """Stop reading ``mq`` at once, keeping nothing of it: nothing more is committed,
        its pending and buffered batches are not acknowledged (orderly: its lease may
        have ended, or it was released)."""
        self.assigned.pop(mq, None)
        self.errors.pop(mq, None)
        self.commits.forget(mq)
        self.redelivery.forget(mq)
        self.pending.drop(mq)

    async def _revoke(self, mq: MessageQueue) -> None:
        del self.assigned[mq]  # answers still in flight for it are dropped
        self.errors.pop(mq, None)
        self.pending.drop(mq)  # not acknowledged: its new owner reads it again
        self.redelivery.forget(mq)
        offset = self.processed.pop(mq, None)
        if offset is not None and self.options.mode == "clustering" and self.commits.committed.get(mq) != offset:
            await self.commits.commit_queue(mq, offset)  # (an idle queue does not wait for a commit under way)
        self.commits.forget(mq)
        log.info("consumer %s: released %s/%s/%d", self.client_id, mq.broker_name, mq.topic, mq.queue_id)

    def _move(self, old: MessageQueue, new: MessageQueue) -> None:
        """The queue's group has a new leader: read on from it where this consumer is
        (the batch being processed stays acknowledged to the queue), and commit the
        processed offset there (its copy of the group's offsets may lag)."""
        state = self.assigned.pop(old)
        self.errors.pop(old, None)
        self._generation += 1
        offset = self.commits.forget(old)
        fetch_from = offset
        for i, pending in enumerate(self.pending):
            if pending.mq == old:
                self.pending[i] = dataclasses.replace(pending, mq=new, generation=self._generation)
                fetch_from = pending.next_offset  # the last one of the queue: in order
        if offset is not None:
            self.processed[new] = offset
        new_state = self.assigned[new] = QueueState(self._generation, fetch_from if state.offset is not None else None)
        assert self._fetcher is not None
        self._fetcher.add(new, new_state)
        log.info(
            "consumer %s: %s/%s/%d moved to its new leader %s",
            self.client_id,
            new.broker_name,
            new.topic,
            new.queue_id,
            new.addr,
        )

    def _assign(self, mq: MessageQueue) -> None:
        self._assign_all([mq])

    def _assign_all(self, mqs: list[MessageQueue]) -> None:
        """Read ``mqs`` from their committed offsets (looked up first), in order."""
        assert self._fetcher is not None
        info = log.isEnabledFor(logging.INFO)
        taken: list[tuple[MessageQueue, QueueState]] = []
        for mq in mqs:
            self._generation += 1
            state = self.assigned[mq] = QueueState(self._generation)
            taken.append((mq, state))
            if info:
                log.info("consumer %s: took %s/%s/%d", self.client_id, mq.broker_name, mq.topic, mq.queue_id)
        self._fetcher.add_many(taken)


def _last_offsets(records: Sequence[Record]) -> dict[tuple[str, int], int]:
    """(topic, queue id) -> the highest queue offset among ``records``."""
    last: dict[tuple[str, int], int] = {}
    for r in records:
        key = (r.topic, r.queue_id)
        if r.queue_offset > last.get(key, -1):
            last[key] = r.queue_offset
    return last


def _moved(assigned: set[MessageQueue], wanted: set[MessageQueue]) -> dict[MessageQueue, MessageQueue]:
    """Assigned queues whose group's leader changed: the same topic, group and queue id
    wanted at another address (old -> new)."""
    gone = {(mq.topic, mq.broker_name, mq.queue_id): mq for mq in assigned - wanted}
    return {gone[key]: mq for mq in wanted - assigned if (key := (mq.topic, mq.broker_name, mq.queue_id)) in gone}


@asynccontextmanager
async def open_consumer(
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
) -> AsyncIterator[Consumer]:
    """A started consumer: ``async with open_consumer(ns, "g", {"orders": "*"}) as c:``.

    Addresses: name servers (``"h1:9876,h2:9876"`` or a list), or ``broker_addrs`` for a
    direct connection; neither (``None``): ``$CLMQ_NAMESRV``. ``subscriptions``: topic ->
    tag expression (``"*"``, ``"TagA || TagB"``). The options are
    :class:`ConsumerOptions`; a bad value is a ``ValueError`` on entering."""
    options = options_from(ConsumerOptions, locals())
    async with consumer_context(namesrv_addrs, broker_addrs, group, subscriptions, options) as consumer:
        yield consumer


@asynccontextmanager
async def consumer_context(
    namesrv_addrs: str | Sequence[str] | None,
    broker_addrs: str | Sequence[str] | None,
    group: str,
    subscriptions: dict[str, str],
    options: ConsumerOptions,
) -> AsyncIterator[Consumer]:
    """:func:`open_consumer` with its options as one object (the asyncio and blocking
    consumers check theirs before they start a loop)."""
    namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)
    security = resolve_security(options.security)
    async with background_nursery() as nursery:
        rpc = RpcClient(nursery, security=security)
        routes = Routes(rpc, namesrv, broker_addrs=brokers, refresh_interval_ms=0)
        consumer = Consumer(rpc, routes, group, subscriptions, options)
        if options.trace:  # its records go through a producer of its own
            wrpc = RpcClient(nursery, security=security)  # a connection of its own
            writer_options = ProducerOptions(security=options.security, **TRACE_WRITER_OPTIONS)
            writer = Producer(wrpc, Routes(wrpc, namesrv, broker_addrs=brokers), writer_options, nursery=nursery)
            consumer.state.tracer = consume_tracer(writer, nursery, options, group, consumer.client_id)
        ack_pending = False
        try:
            await consumer._start(nursery)
            yield consumer
            ack_pending = True
        finally:
            await consumer._close(ack_pending=ack_pending)
            if consumer.state.tracer is not None:
                await consumer.state.tracer.aclose()
            await rpc.aclose()
            nursery.cancel_scope.cancel()
