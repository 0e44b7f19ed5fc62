"""The POP consumer's loops: ``pops_in_flight`` long-polling POP_MESSAGE loops per (topic, broker
group) at that group's leader (:attr:`MessageQueue.addr`), and a supervisor that asks
the routes again (every ``route_refresh_interval_ms``, or at once when a loop met a
moved leader) and starts, moves and stops loops to match.

A loop asks only while the buffer has room (it reserves it first). A failure is retried
with back-off (50 ms doubling up to ``max_backoff_ms``); one after which the group's
leader may have moved (NOT_LEADER, SHUTTING_DOWN, a connection that failed or timed
out) also asks for fresh routes at once. An error that asking again cannot fix
(MALFORMED_REQUEST: e.g. an invisible time above the broker's maximum;
NOT_AUTHORIZED; REQUEST_NOT_SUPPORTED) is handed to the consumer, whose next
``receive()`` raises it (once), and asked again every ``max_backoff_ms`` (an operator
may fix it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from clmq.common import Record
from clmq.protocol import ErrorCode, Frame, ProtocolError, RequestCode, decode_records
from clmq.protocol.transport import RpcClient, RpcError

from .._routes import Routes
from ..consumer import TagFilter
from ._buffer import PopBuffer
from ._options import PopConsumerOptions
from ._receipts import PopStats, Receipt, Receipts
from ._settle import BUSY_CODES, NET_ERRORS, leader_moved

log = logging.getLogger("clmq.pop")

# Answers after which asking the same broker again later may work: busy or starting, a
# topic not created yet, a CK write not confirmed (flush or replicas too slow) or refused
# while too few replicas are in sync (_settle.BUSY_CODES).
RETRYABLE = BUSY_CODES | {ErrorCode.TOPIC_NOT_FOUND}
FIRST_BACKOFF_S = 0.05


@dataclass
class PopTarget:
    """What the loops share: the client, the group and where popped records go."""

    rpc: RpcClient
    routes: Routes
    group: str
    client_id: str
    filters: dict[str, TagFilter]
    options: PopConsumerOptions
    buffer: PopBuffer
    receipts: Receipts
    stats: PopStats


class PopLoops:
    """The supervisor and its loops (run in the consumer's nursery)."""

    def __init__(self, target: PopTarget) -> None:
        self.t = target
        self.loops: dict[tuple[str, str], tuple[str, trio.CancelScope]] = {}  # (topic, broker) -> (addr, scope)
        self._refresh = trio.Event()
        self.route_errors: dict[str, str] = {}  # topic -> why it has no route now

    async def supervise(self, nursery: trio.Nursery, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Match the loops to the routes, now and then again; started once they run."""
        await self._match(nursery)
        task_status.started()
        while True:
            with trio.move_on_after(self.t.options.route_refresh_interval_ms / 1000):
                await self._refresh.wait()
            self._refresh = trio.Event()
            await self._match(nursery)

    def refresh_soon(self) -> None:
        self._refresh.set()

    async def _match(self, nursery: trio.Nursery) -> None:
        wanted: dict[tuple[str, str], str] = {}
        for topic in self.t.filters:
            try:
                mqs = await self.t.routes.queues(topic, refresh=True)
            except NET_ERRORS as e:
                if self.route_errors.get(topic) != str(e):
                    log.warning("pop %s: no route for topic %r now: %s", self.t.group, topic, e)
                self.route_errors[topic] = str(e)
                wanted.update({k: v[0] for k, v in self.loops.items() if k[0] == topic})  # keep what runs
                continue
            self.route_errors.pop(topic, None)
            for mq in mqs:
                if mq.addr not in self.t.routes.leaderless:
                    wanted[topic, mq.broker_name] = mq.addr
        for key, (addr, scope) in list(self.loops.items()):
            if wanted.get(key) != addr:
                scope.cancel()
                del self.loops[key]
        for key, addr in wanted.items():
            if key not in self.loops:
                scope = trio.CancelScope()
                self.loops[key] = (addr, scope)
                nursery.start_soon(self._run_loop, key, addr, scope)

    async def _run_loop(self, key: tuple[str, str], addr: str, scope: trio.CancelScope) -> None:
        """``pops_in_flight`` loops at the group's leader (a POP's answer waits for its CK
        record to be stored: more than one in flight keeps the member busy meanwhile)."""
        with scope:  # cancelled by the supervisor when the routes move the group or drop it
            async with trio.open_nursery() as nursery:
                for _ in range(self.t.options.pops_in_flight):
                    nursery.start_soon(self._loop, key[0], key[1], addr)

    async def _loop(self, topic: str, broker_name: str, addr: str) -> None:
        t, opts = self.t, self.t.options
        backoff = FIRST_BACKOFF_S
        fields = self._fields(topic)
        while True:
            n = await t.buffer.reserve(self._share())
            records: list[Record] = []
            failure: BaseException | None = None
            try:
                reply = await t.rpc.request(
                    addr,
                    RequestCode.POP_MESSAGE,
                    {**fields, "max_messages": n},
                    timeout_ms=opts.pop_wait_ms + opts.request_timeout_ms,
                )
                records = self._received(reply, topic, broker_name, addr)
                backoff = FIRST_BACKOFF_S
            except (RpcError, ProtocolError, *NET_ERRORS) as e:
                failure = e
            finally:
                t.buffer.fill(n, broker_name, records)  # the room reserved is given back, cancelled too
            if failure is not None:
                backoff = await self._failed(topic, addr, failure, backoff)

    async def _failed(self, topic: str, addr: str, e: BaseException, backoff: float) -> float:
        """A POP failed: ask for fresh routes if the leader may have moved (the supervisor
        moves this loop if they name another), tell the consumer of an error asking again
        cannot fix, and wait before the next try; the next back-off."""
        t, cap = self.t, max(self.t.options.max_backoff_ms / 1000, FIRST_BACKOFF_S)
        t.stats.pop_errors += 1
        if leader_moved(e):
            log.info("pop %s: POP of %r at %s failed (routes asked again): %s", t.group, topic, addr, e or "timed out")
            self.refresh_soon()
        elif isinstance(e, RpcError) and e.code not in RETRYABLE:
            log.error("pop %s: POP of %r at %s refused (asked again in %.1f s): %s", t.group, topic, addr, cap, e)
            t.buffer.fail(e)
            backoff = cap
        else:
            log.info("pop %s: POP of %r at %s failed (retried in %.2f s): %s", t.group, topic, addr, backoff, e)
        await trio.sleep(backoff)
        return min(backoff * 2, cap)

    def _share(self) -> int:
        """What one POP asks for: ``max_messages``, or less so that every loop's POP fits
        in the prefetch bound at once (a loop waiting for room pops from nobody)."""
        opts = self.t.options
        loops = max(1, len(self.loops) * opts.pops_in_flight)
        return max(1, min(opts.max_messages, opts.prefetch_max_messages // loops))

    def _fields(self, topic: str) -> dict[str, Any]:
        t, opts = self.t, self.t.options
        fields: dict[str, Any] = {
            "group": t.group,
            "client_id": t.client_id,
            "topic": topic,
            "invisible_time_ms": opts.invisible_time_ms,
            "max_wait_ms": opts.pop_wait_ms,
            "orderly": opts.orderly,
            "start_from": opts.start_from,
        }
        tags = t.filters[topic].tags
        if tags is not None:
            fields["tags"] = tags
        if opts.max_reconsume_times is not None:
            fields["max_reconsume_times"] = opts.max_reconsume_times
        if opts.pop_max_bytes is not None:
            fields["max_bytes"] = opts.pop_max_bytes
        return fields

    def _received(self, reply: Frame, topic: str, broker_name: str, addr: str) -> list[Record]:
        """The answer's records, each with its receipt kept and ``reconsume_times`` set
        to its attempt minus one."""
        f = reply.fields
        records = decode_records(reply.body, f"POP from {addr}") if reply.body else []
        handles, attempts, deadline_ms = f.get("handles") or [], f.get("attempts") or [], f.get("deadline_ms", 0)
        if len(handles) != len(records) or len(attempts) != len(records):
            raise ProtocolError(
                f"POP_MESSAGE from {addr}: {len(records)} records, {len(handles)} handles, {len(attempts)} attempts"
            )
        stats, receipts = self.t.stats, self.t.receipts
        for record, handle, attempt in zip(records, handles, attempts):
            if not isinstance(handle, str) or type(attempt) is not int or attempt < 1:
                raise ProtocolError(f"POP_MESSAGE from {addr}: a bad handle or attempt: {handle!r:.60}, {attempt!r}")
            record.reconsume_times = attempt - 1
            receipts.add(Receipt(record, broker_name, addr, handle, attempt, int(deadline_ms)))
            stats.popped += 1
            stats.redelivered += attempt > 1
        return records
