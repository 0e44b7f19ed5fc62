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
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import trio

from commitlog import Record
from consumequeue import retry_topic
from protocol import ErrorCode, Frame, RequestCode
from protocol.transport import ConnectionFailed, RpcClient, RpcError, background_nursery

from ._allocate import allocate_averagely
from ._fetcher import DamagedQueueError, Fetcher, PendingBatches, PrefetchBuffer, QueueState
from ._options import ConsumerOptions, TagFilter
from ._orderly import QueueLocks
from ._redelivery import Handler, Redelivery, SendBackResult
from ._routes import MessageQueue, NoRouteError, ReadRouter, Routes

log = logging.getLogger("clmq.consumer")

_NET_ERRORS = (ConnectionFailed, RpcError, trio.TooSlowError, NoRouteError)

T = TypeVar("T")


class Consumer:
    """Use :func:`open_consumer` (trio) or :class:`client.BlockingConsumer`."""

    def __init__(self, rpc: RpcClient, routes: Routes, group: str, subscriptions: dict[str, str],
                 options: ConsumerOptions) -> None:  # fmt: skip
        if options.mode not in ("clustering", "broadcasting"):
            raise ValueError(f"mode={options.mode!r}: use clustering or broadcasting")
        self.rpc, self.routes, self.group, self.options = rpc, routes, group, options
        self.filters = {topic: TagFilter(expr) for topic, expr in subscriptions.items()}
        # Messages this group failed on come back through its retry topic (not to an
        # orderly consumer: it retries in place). It exists from the group's first send-back.
        self.retry_topic = retry_topic(group) if options.mode == "clustering" and not options.orderly else None
        if self.retry_topic is not None:
            self.filters.setdefault(self.retry_topic, TagFilter("*"))
        self.client_id = options.client_id or f"{socket.gethostname()}@{os.getpid()}@{id(self):x}"
        self.assigned: dict[MessageQueue, QueueState] = {}
        self._generation = 0
        self.processed: dict[MessageQueue, int] = Processed()
        # Assigned queues stopped at a damaged record (an entry goes once the queue reads again).
        self.errors: dict[MessageQueue, DamagedQueueError] = {}
        self._committed: dict[MessageQueue, int] = {}
        self.prefetch = PrefetchBuffer(options.prefetch_max_bytes)
        self.pending = PendingBatches()  # returned by the last receive(), not yet acknowledged
        self._rebalance_now = trio.Event()
        self._fetcher: Fetcher | None = None
        self.net_errors: tuple[type[BaseException], ...] = _NET_ERRORS  # what the fetcher retries after
        self.reads = ReadRouter(routes, always=options.read_from_followers, hold_ms=options.follower_read_hold_ms,
                                failure_backoff_ms=options.follower_failure_backoff_ms, seed=self.client_id)  # fmt: skip
        # Orderly: the queue locks (None otherwise).
        self.locks = (QueueLocks(self, retry_ms=options.lock_retry_ms, renew_interval_ms=options.lock_renew_interval_ms)
                      if options.orderly else None)  # fmt: skip
        self.redelivery = Redelivery(self)
        self._commit_lock = trio.Lock()  # a queue's commits never overlap: an older one must not land after a newer
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ public
    async def receive(self) -> list[Record]:
        """The next messages (waits for some): everything buffered, across queues, up
        to ``receive_max_messages`` (a queue's batch is not split), each queue's in
        order. Acknowledges what the previous call returned."""
        self.ack()
        while True:
            records = self._take()
            if records:
                return records
            self.ack()  # only batches with nothing to process (filtered out): done with
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
        return await self.redelivery.run(handler, max_messages)

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
        if self.options.mode != "clustering":
            return
        async with self._commit_lock:
            by_broker: dict[str, dict[MessageQueue, int]] = {}
            processed = self.processed
            assert isinstance(processed, Processed)
            changed, processed.changed = processed.changed, set()  # not a walk over 10,000 queues per interval
            for mq in changed:
                offset = processed.get(mq)
                if offset is not None and self._committed.get(mq) != offset:
                    by_broker.setdefault(mq.addr, {})[mq] = offset
            for addr, offsets in by_broker.items():  # one request per broker, however many queues
                await self._commit_to(addr, offsets)

    async def _commit_to(self, addr: str, offsets: dict[MessageQueue, int]) -> None:
        """Commit to the group's leader (:meth:`to_leader`). Offsets not committed stay
        processed: committed later."""
        rows = [[mq.topic, mq.queue_id, o] for mq, o in offsets.items()]
        try:
            await self.to_leader(next(iter(offsets)), addr, RequestCode.COMMIT_OFFSET, {"group": self.group, "offsets": rows})
        except _NET_ERRORS as e:
            log.warning("consumer %s: commit of %d offsets to %s failed: %s", self.client_id, len(rows), addr, e)
            if isinstance(self.processed, Processed):
                self.processed.changed.update(offsets)  # committed next time
            return
        self._committed.update(offsets)

    async def to_leader(self, mq: MessageQueue, addr: str, code: int, fields: dict[str, Any]) -> Frame:
        """A request to ``mq``'s group leader at ``addr``; a dead or demoted leader (the
        connection fails, NOT_LEADER) is followed to the leader fresh routes name, for
        up to ``retry_budget_ms``. Raises the last failure (one of ``net_errors``)."""
        deadline = trio.current_time() + self.options.retry_budget_ms / 1000
        delay = 0.05
        while True:
            try:
                return await self.request(addr, code, fields)
            except _NET_ERRORS as e:
                if not _leader_moved(e) or trio.current_time() + delay > deadline:
                    raise
            await trio.sleep(delay)
            delay = min(delay * 2, 0.5)
            addr = await self._leader_now(mq, addr)

    async def _leader_now(self, mq: MessageQueue, addr: str) -> str:
        """The address of ``mq``'s group leader as fresh routes say (``addr`` if unknown)."""
        try:
            mqs = await self.routes.queues(mq.topic, refresh=True)
        except _NET_ERRORS:
            return addr
        self._rebalance_now.set()  # move the group's queues to its new leader
        return next((m.addr for m in mqs if (m.broker_name, m.queue_id) == (mq.broker_name, mq.queue_id)
                     and m.addr not in self.routes.leaderless), addr)  # fmt: skip

    def route_failed(self, addr: str) -> None:
        """A group leader failed a request: refresh routes and rebalance now (its
        group may have a new leader)."""
        self._rebalance_now.set()

    # ------------------------------------------------------------- background
    async def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._fetcher = Fetcher(self, nursery)
        if self.locks is not None:
            self.locks.start(nursery)
        await self._heartbeat()
        await self._rebalance()
        nursery.start_soon(self._every, self.options.heartbeat_interval_ms, self._heartbeat)
        nursery.start_soon(self._rebalance_loop)
        nursery.start_soon(self._every, self.options.commit_interval_ms, self.commit)

    async def _close(self, *, ack_pending: bool = True) -> None:
        """Commit and leave the group. ``ack_pending`` false (the block was left by an
        exception, e.g. Ctrl-C): what receive returned last is not acknowledged."""
        if ack_pending:
            self.ack()
        with trio.CancelScope(shield=True), trio.move_on_after(3):
            await self.commit()
            for addr in await self._broker_addrs():
                try:
                    await self.request(addr, RequestCode.UNREGISTER_CLIENT, {"client_id": self.client_id})
                except _NET_ERRORS:
                    pass

    async def _every(self, interval_ms: int, fn: Callable[[], Awaitable[object]]) -> None:
        while True:
            await trio.sleep(interval_ms / 1000)
            await fn()

    async def request(self, addr: str, code: int, fields: dict[str, Any], timeout_ms: float | None = None) -> Frame:
        return await self.rpc.request(addr, code, fields, timeout_ms=timeout_ms or self.options.request_timeout_ms)

    async def _broker_addrs(self) -> list[str]:
        """The brokers of the subscribed topics (the retry topic lives on the same ones)."""
        addrs: set[str] = set()
        for topic in self.filters:
            if topic == self.retry_topic:
                continue
            try:
                addrs |= {mq.addr for mq in await self.routes.queues(topic)}
            except _NET_ERRORS:
                pass
        return sorted(addrs)

    async def _heartbeat(self) -> None:
        groups = [{"group": self.group, "mode": self.options.mode, "topics": sorted(self.filters)}]
        for addr in await self._broker_addrs():
            try:
                await self.request(addr, RequestCode.HEARTBEAT, {"client_id": self.client_id, "groups": groups})
            except _NET_ERRORS as e:
                log.debug("heartbeat to %s failed: %s", addr, e)

    async def _rebalance_loop(self) -> None:
        while True:
            with trio.move_on_after(self.options.rebalance_interval_ms / 1000):
                await self._rebalance_now.wait()
            self._rebalance_now = trio.Event()
            await self._rebalance()

    async def _rebalance(self) -> None:
        wanted: set[MessageQueue] = set()
        for topic in self.filters:
            try:
                mqs = await self.routes.queues(topic, refresh=True)
            except _NET_ERRORS as e:
                if topic == self.retry_topic and isinstance(e, NoRouteError) and not e.unreachable:
                    continue  # no message of this group failed yet: the broker creates it at the first send-back
                log.warning("consumer %s: no route for %s: %s", self.client_id, topic, e)
                wanted |= {mq for mq in self._current() if mq.topic == topic}  # keep what we have
                continue
            wanted |= set(await self._my_share(mqs))
        if self.locks is not None:
            self.locks.rebalance(wanted)
            return
        for old, new in _moved(set(self.assigned), wanted).items():
            self._move(old, new)
        for mq in [mq for mq in self.assigned if mq not in wanted]:
            await self._revoke(mq)
        for mq in sorted(wanted - set(self.assigned)):
            self._assign(mq)

    async def _my_share(self, mqs: list[MessageQueue]) -> list[MessageQueue]:
        if self.options.mode == "broadcasting" or not mqs:
            return mqs
        members: list[str] = []
        for addr in sorted({mq.addr for mq in mqs}):  # any broker that answers (one may be down)
            try:
                reply = await self.request(addr, RequestCode.GET_GROUP_MEMBERS, {"group": self.group})
            except _NET_ERRORS:
                continue
            members = list(reply.fields["members"])
            break
        if self.client_id not in members:
            members.append(self.client_id)
        return allocate_averagely(mqs, members, self.client_id)

    def _current(self) -> set[MessageQueue]:
        """The queues this member reads or (orderly) wants to."""
        return set(self.assigned) | (self.locks.wanted if self.locks is not None else set())

    def stop_queue(self, mq: MessageQueue) -> None:
        """Neither fetch ``mq`` nor hand it out from now on (orderly: being released)."""
        state = self.assigned.get(mq)
        if state is not None:
            state.stopped = True

    async def commit_queue(self, mq: MessageQueue) -> None:
        """Commit ``mq``'s processed offset now (if it moved)."""
        async with self._commit_lock:
            offset = self.processed.get(mq)
            if offset is not None and self._committed.get(mq) != offset:
                await self._commit_to(mq.addr, {mq: offset})

    def take_queue(self, mq: MessageQueue) -> None:
        """Orderly: the queue's lock was granted: read it from the committed offset."""
        self._assign(mq)

    def drop_queue(self, mq: MessageQueue) -> None:
        """Stop reading ``mq`` at once, keeping nothing of it: nothing more is committed,
        its pending and buffered batches are not acknowledged (orderly: its lease may
        have ended, or it was released)."""
        self.assigned.pop(mq, None)
        self.errors.pop(mq, None)
        self.processed.pop(mq, None)
        self._committed.pop(mq, None)
        self.redelivery.forget(mq)
        self.pending.drop(mq)

    async def _revoke(self, mq: MessageQueue) -> None:
        del self.assigned[mq]  # answers still in flight for it are dropped
        self.errors.pop(mq, None)
        self.pending.drop(mq)  # not acknowledged: its new owner reads it again
        self.redelivery.forget(mq)
        offset = self.processed.pop(mq, None)
        if offset is not None and self.options.mode == "clustering" and self._committed.get(mq) != offset:
            async with self._commit_lock:
                await self._commit_to(mq.addr, {mq: offset})
        self._committed.pop(mq, None)
        log.info("consumer %s: released %s/%s/%d", self.client_id, mq.broker_name, mq.topic, mq.queue_id)

    def _move(self, old: MessageQueue, new: MessageQueue) -> None:
        """The queue's group has a new leader: read on from it where this consumer is
        (the batch being processed stays acknowledged to the queue), and commit the
        processed offset there (its copy of the group's offsets may lag)."""
        state = self.assigned.pop(old)
        self.errors.pop(old, None)
        self._committed.pop(old, None)
        self._generation += 1
        offset = self.processed.pop(old, None)
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
        log.info("consumer %s: %s/%s/%d moved to its new leader %s", self.client_id, new.broker_name, new.topic,
                 new.queue_id, new.addr)  # fmt: skip

    def _assign(self, mq: MessageQueue) -> None:
        self._generation += 1
        state = self.assigned[mq] = QueueState(self._generation)
        assert self._fetcher is not None
        self._fetcher.add(mq, state)
        log.info("consumer %s: took %s/%s/%d", self.client_id, mq.broker_name, mq.topic, mq.queue_id)

    async def retrying(self, fn: Callable[[], Awaitable[T]]) -> T:
        delay = 0.05
        while True:
            try:
                return await fn()
            except _NET_ERRORS as e:
                log.debug("consumer %s: %s; retrying in %.2f s", self.client_id, e, delay)
                await trio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def start_offset_now(self, committed: int, lo: int, hi: int) -> int | None:
        """:meth:`start_offset` when it needs no request (all but timestamps), else None:
        a consumer of 10,000 queues calls it for each, and an await apiece adds up."""
        if self.options.mode == "clustering" and committed >= 0:
            return committed
        start = self.options.start_from
        if isinstance(start, int) or (isinstance(start, str) and start.isdigit()):
            return None
        return hi if start == "latest" else lo

    async def start_offset(self, mq: MessageQueue, committed: int, lo: int, hi: int) -> int:
        """Where to start reading a queue: the group's committed offset, else
        ``start_from`` (a timestamp is searched on the broker)."""
        now = self.start_offset_now(committed, lo, hi)
        if now is not None:
            return now
        q = {"topic": mq.topic, "queue_id": mq.queue_id, "timestamp_ms": int(self.options.start_from)}
        reply = await self.retrying(lambda: self.request(mq.addr, RequestCode.SEARCH_OFFSET, q))
        offset: int = reply.fields["offset"]
        return offset


class Processed(dict[MessageQueue, int]):
    """Next offset to commit per queue, and the queues whose offset was set since the
    last commit (``changed``): a commit looks at those only."""

    def __init__(self) -> None:
        super().__init__()
        self.changed: set[MessageQueue] = set()

    def __setitem__(self, mq: MessageQueue, offset: int) -> None:
        super().__setitem__(mq, offset)
        self.changed.add(mq)

    def setdefault(self, mq: MessageQueue, offset: int) -> int:
        self.changed.add(mq)
        return super().setdefault(mq, offset)


def _last_offsets(records: Sequence[Record]) -> dict[tuple[str, int], int]:
    """(topic, queue id) -> the highest queue offset among ``records``."""
    last: dict[tuple[str, int], int] = {}
    for r in records:
        key = (r.topic, r.queue_id)
        if r.queue_offset > last.get(key, -1):
            last[key] = r.queue_offset
    return last


def _leader_moved(e: BaseException) -> bool:
    """A failure after which the group may have a new leader (retry there)."""
    if isinstance(e, RpcError):
        return e.code in (ErrorCode.NOT_LEADER, ErrorCode.SHUTTING_DOWN)
    return isinstance(e, (ConnectionFailed, trio.TooSlowError))


def _moved(assigned: set[MessageQueue], wanted: set[MessageQueue]) -> dict[MessageQueue, MessageQueue]:
    """Assigned queues whose group's leader changed: the same topic, group and queue id
    wanted at another address (old -> new)."""
    gone = {(mq.topic, mq.broker_name, mq.queue_id): mq for mq in assigned - wanted}
    return {gone[key]: mq for mq in wanted - assigned if (key := (mq.topic, mq.broker_name, mq.queue_id)) in gone}


@asynccontextmanager
async def open_consumer(namesrv_addrs: list[str] | None, group: str, subscriptions: dict[str, str], *,
                        broker_addrs: list[str] | None = None, **options: object) -> AsyncIterator[Consumer]:  # fmt: skip
    """A started consumer: ``async with open_consumer(ns, "g", {"orders": "*"}) as c:``."""
    async with background_nursery() as nursery:
        rpc = RpcClient(nursery)
        consumer = Consumer(rpc, Routes(rpc, namesrv_addrs or [], broker_addrs=broker_addrs, refresh_interval_ms=0),
                            group, subscriptions, ConsumerOptions(**options))  # type: ignore[arg-type]  # fmt: skip
        ack_pending = False
        try:
            await consumer._start(nursery)
            yield consumer
            ack_pending = True
        finally:
            await consumer._close(ack_pending=ack_pending)
            await rpc.aclose()
            nursery.cancel_scope.cancel()
