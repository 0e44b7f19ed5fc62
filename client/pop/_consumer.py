"""The POP consumer (RocketMQ 5's POP, Kafka's share groups): any number of members of
a group take messages from any queue of the subscribed topics; each message is
invisible to the rest of the group for ``invisible_time_ms``, acknowledged on its own
(:meth:`PopConsumer.ack`), handed back (:meth:`PopConsumer.nack`) or kept longer
(:meth:`PopConsumer.extend`); one not acknowledged in time is delivered again, to any
member, with ``reconsume_times`` one higher, and after ``max_reconsume_times`` goes to
``%DLQ%<group>`` (the broker decides; docs/consuming.md).

There is no rebalancing and no offset to commit: the brokers keep each group's POP
state. A member that dies leaves its messages to come back after their invisible
time; a member that closes hands back at once what it popped and never handed out.
"""

from __future__ import annotations

import logging
import os
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator, Literal, Sequence

import trio

from clmq.common import Record
from clmq.protocol.transport import ClientSecurity, RpcClient, background_nursery

from .._arguments import options_from, resolve_addrs, resolve_security
from .._routes import Routes
from ..consumer import Handler, TagFilter, check_limit
from ._buffer import PopBuffer
from ._loops import PopLoops, PopTarget
from ._options import DEFAULT_RETRY_DELAYS_MS, PopConsumerOptions
from ._receipts import PopStats, Receipt, Receipts
from ._run import Runner
from ._settle import Settler

log = logging.getLogger("clmq.pop")

RELEASE_TIMEOUT_S = 3.0  # at close: the wait for buffered messages to be handed back


class PopConsumer:
    """Use :func:`open_pop_consumer` (trio), ``open_asyncio_pop_consumer`` or
    ``BlockingPopConsumer``."""

    def __init__(
        self,
        rpc: RpcClient,
        routes: Routes,
        group: str,
        subscriptions: dict[str, str],
        options: PopConsumerOptions,
        pop_rpc: RpcClient | None = None,
    ) -> None:
        if not subscriptions:
            raise ValueError("subscriptions: give at least one topic (topic -> tag expression)")
        self.rpc, self.routes, self.group, self.options = rpc, routes, group, options
        # The long polls' own connections (closed first at close, which ends the polls the
        # brokers still hold: one answered after that would make messages invisible for nothing).
        self.pop_rpc = pop_rpc or rpc
        self.filters = {topic: TagFilter(expr) for topic, expr in subscriptions.items()}
        self.client_id = options.client_id or f"{socket.gethostname()}@{os.getpid()}@{id(self):x}"
        self.stats = PopStats()
        self.receipts = Receipts()
        self.buffer = PopBuffer(options.prefetch_max_messages)
        self.settler = Settler(rpc, routes, group, options, self.receipts, self.stats)
        self.loops = PopLoops(
            PopTarget(
                self.pop_rpc,
                routes,
                group,
                self.client_id,
                self.filters,
                options,
                self.buffer,
                self.receipts,
                self.stats,
            )
        )
        self._scope = trio.CancelScope()

    # ------------------------------------------------------------------ public
    async def receive(self) -> list[Record]:
        """The next messages (waits for some): up to ``receive_max_messages`` of what
        was popped, oldest first (orderly: whole queue batches, each in queue order).
        Each is in flight with this member until it is acknowledged, nacked, or its
        invisible time passes. Raises the error of a POP the broker refused for good
        (e.g. MALFORMED_REQUEST, NOT_AUTHORIZED)."""
        return await self._take(self.options.receive_max_messages)

    async def _take(self, most: int) -> list[Record]:
        buffer = self.buffer
        while True:
            if buffer.failure is not None:
                failure, buffer.failure = buffer.failure, None
                raise failure
            records = buffer.take(most, whole_queues=self.options.orderly)
            if records:
                return records
            await buffer.arrival()

    async def take_lane(self) -> list[Record]:
        """``run()``'s next unit of work: one message (orderly: one queue's batch)."""
        return await self._take(1)

    async def ack(self, records: Sequence[Record]) -> list[str]:
        """Acknowledge ``records`` (one ACK_MESSAGE per broker): a status per record, in
        order, never raised: ``ok`` (settled: never delivered again), ``expired``
        (refused: its invisible time had passed, it is delivered again; logged, counted
        in ``stats.ack_expired``; also a record this consumer holds no receipt of),
        ``gone`` (the broker says settled already), ``invalid`` (a handle the broker
        does not know), ``unreachable`` (no leader took it within ``retry_budget_ms``,
        busy and unconfirmed answers retried meanwhile: it comes back after its
        invisible time). One broker's failure leaves the others' statuses."""
        return await self.settler.ack(records)

    async def nack(self, records: Sequence[Record], delay_ms: int | None = None) -> list[str]:
        """Hand ``records`` back: each is delivered again (to any member) after
        ``delay_ms`` (None: ``retry_delays_ms`` for its attempt), one attempt higher,
        or goes to ``%DLQ%<group>`` past ``max_reconsume_times``. A status per record
        as :meth:`ack`'s, or ``unknown`` (a try whose answer was lost may have been
        applied, the retry was refused: it comes back after an invisible time)."""
        if delay_ms is not None and (type(delay_ms) is not int or delay_ms < 0):
            raise ValueError(f"delay_ms must be milliseconds >= 0 (or None: retry_delays_ms), got {delay_ms!r}")
        delays = [delay_ms if delay_ms is not None else self.delay_of(r) for r in records]
        out = [""] * len(records)
        for delay in sorted(set(delays)):
            picked = [i for i, d in enumerate(delays) if d == delay]
            statuses = await self.settler.change([records[i] for i in picked], delay, keep=False)
            for i, status in zip(picked, statuses):
                out[i] = status
        return out

    reconsume_later = nack

    async def extend(self, records: Sequence[Record], invisible_time_ms: int) -> list[str]:
        """Keep ``records`` with this member for ``invisible_time_ms`` from now
        (CHANGE_INVISIBLE_TIME): a status per record as :meth:`nack`'s; an ``ok`` record
        is acknowledged later under its new handle (kept here); after ``unknown`` the
        broker may hold it under a handle this member never got (an ack then answers
        ``expired``: treat it as delivered again)."""
        if type(invisible_time_ms) is not int or invisible_time_ms < 1:
            raise ValueError(f"invisible_time_ms must be milliseconds >= 1, got {invisible_time_ms!r}")
        return await self.settler.change(records, invisible_time_ms, keep=True)

    async def run(self, handler: Handler, *, max_messages: int | None = None) -> int:
        """Hand each message to ``handler(record)`` (plain or async), up to
        ``handler_concurrency`` at once: ``ConsumeStatus.SUCCESS`` or None acknowledges
        it, ``ConsumeStatus.RECONSUME_LATER`` or an exception (logged) nacks it.
        Orderly: a queue's batch is handled in order and stops at a failed message,
        which is nacked with the rest of its batch. Returns the number of messages
        handled, after ``max_messages`` (None: runs until cancelled)."""
        check_limit(max_messages)
        runner = Runner(
            self.take_lane,
            self.ack,
            self.nack,
            self.release,
            concurrency=self.options.handler_concurrency,
            orderly=self.options.orderly,
            delay_of=self.delay_of,
        )
        return await runner.run(handler, max_messages)

    async def release(self, records: Sequence[Record]) -> list[str]:
        """Hand ``records`` back at once, not as a failure of theirs (their attempt still counts)."""
        return await self.settler.change(records, 0, keep=False) if records else []

    def delay_of(self, record: Record) -> int:
        """The back-off of a nack of ``record`` without a delay."""
        return self.options.retry_delay_ms(record.reconsume_times + 1)

    def receipt(self, record: Record) -> Receipt | None:
        """The receipt (handle, attempt, deadline) of a record in flight with this member."""
        return self.receipts.get(record)

    @property
    def in_flight(self) -> int:
        """Messages popped by this member and not settled (buffered ones too)."""
        return len(self.receipts)

    # ------------------------------------------------------------- background
    async def _start(self, nursery: trio.Nursery) -> None:
        async def supervise(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with self._scope:
                async with trio.open_nursery() as loops:
                    await self.loops.supervise(loops, task_status=task_status)

        await nursery.start(supervise)

    async def _close(self) -> None:
        """Stop popping; hand back what was popped and never handed out."""
        self._scope.cancel()
        if self.pop_rpc is not self.rpc:
            await self.pop_rpc.aclose()
        buffered = [r for _, r in self.buffer.drain()]
        if not buffered or not self.options.release_on_close:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT_S):
            statuses = await self.release(buffered)
            self.stats.released += statuses.count("ok")


@asynccontextmanager
async def open_pop_consumer(
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
) -> AsyncIterator[PopConsumer]:
    """A started POP consumer: ``async with open_pop_consumer(ns, "g", {"orders": "*"}) as c:``.

    Addresses: name servers (``"h1:9876,h2:9876"`` or a list), or ``broker_addrs`` for a
    direct connection; neither: ``$CLMQ_NAMESRV``. ``subscriptions``: topic -> tag
    expression (``"*"``, ``"TagA || TagB"``). The options are
    :class:`PopConsumerOptions`; a bad value is a ``ValueError`` on entering."""
    options = options_from(PopConsumerOptions, locals())
    async with pop_consumer_context(namesrv_addrs, broker_addrs, group, subscriptions, options) as consumer:
        yield consumer


@asynccontextmanager
async def pop_consumer_context(
    namesrv_addrs: str | Sequence[str] | None,
    broker_addrs: str | Sequence[str] | None,
    group: str,
    subscriptions: dict[str, str],
    options: PopConsumerOptions,
) -> AsyncIterator[PopConsumer]:
    """:func:`open_pop_consumer` with its options as one object (the asyncio and
    blocking facades check theirs before they start a loop)."""
    namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)
    security = resolve_security(options.security)
    async with background_nursery() as nursery:
        rpc, pop_rpc = RpcClient(nursery, security=security), RpcClient(nursery, security=security)
        routes = Routes(rpc, namesrv, broker_addrs=brokers, refresh_interval_ms=0)
        consumer = PopConsumer(rpc, routes, group, subscriptions, options, pop_rpc)
        try:
            await consumer._start(nursery)
            yield consumer
        finally:
            await consumer._close()
            await pop_rpc.aclose()
            await rpc.aclose()
            nursery.cancel_scope.cancel()
