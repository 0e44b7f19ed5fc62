"""Settling popped messages: ACK_MESSAGE and CHANGE_INVISIBLE_TIME, one request per
broker (replication group) for all of a call's messages there, following the group's
leader when it moved (NOT_LEADER, a connection that failed) for up to
``retry_budget_ms``."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import trio

from clmq.common import Record
from clmq.protocol import ErrorCode, ProtocolError, RequestCode
from clmq.protocol.transport import ConnectionFailed, RpcClient, RpcError

from .._routes import NoRouteError, Routes
from ._options import PopConsumerOptions
from ._receipts import EXPIRED, GONE, INVALID, OK, UNREACHABLE, PopStats, Receipt, Receipts

log = logging.getLogger("clmq.pop")

NET_ERRORS = (ConnectionFailed, trio.TooSlowError, NoRouteError)
STATUSES = (OK, EXPIRED, GONE, INVALID)


def leader_moved(e: BaseException) -> bool:
    """A failure after which the group may answer at another address."""
    if isinstance(e, RpcError):
        return e.code in (ErrorCode.NOT_LEADER, ErrorCode.SHUTTING_DOWN)
    return isinstance(e, NET_ERRORS)


class Settler:
    """The consumer's ACK and CHANGE_INVISIBLE_TIME requests."""

    def __init__(
        self,
        rpc: RpcClient,
        routes: Routes,
        group: str,
        options: PopConsumerOptions,
        receipts: Receipts,
        stats: PopStats,
    ) -> None:
        self.rpc, self.routes, self.group, self.options = rpc, routes, group, options
        self.receipts, self.stats = receipts, stats

    async def ack(self, records: Sequence[Record]) -> list[str]:
        """ACK_MESSAGE: a status per record, in order (``ok``, ``expired``, ``gone``,
        ``invalid``, ``unreachable``); all but ``unreachable`` end the receipt."""
        results = await self._settle(RequestCode.ACK_MESSAGE, records, {}, _ack_rows)
        out = []
        for record, (status, _) in zip(records, results):
            out.append(status)
            self._count_ack(record, status)
        return out

    async def change(self, records: Sequence[Record], invisible_time_ms: int, *, keep: bool) -> list[str]:
        """CHANGE_INVISIBLE_TIME: a status per record. ``keep``: an ``ok`` record stays
        with this consumer under its new handle (extend); else its receipt ends (nack)."""
        fields = {"invisible_time_ms": invisible_time_ms}
        results = await self._settle(RequestCode.CHANGE_INVISIBLE_TIME, records, fields, _change_rows)
        deadline_ms = int(time.time() * 1000) + invisible_time_ms
        stats, out = self.stats, []
        for record, (status, handle) in zip(records, results):
            out.append(status)
            receipt = self.receipts.get(record)
            if status == OK and receipt is not None and keep:
                receipt.handle, receipt.deadline_ms = handle, deadline_ms
                stats.extended += 1
                continue
            if status == OK:
                stats.nacked += 1
            elif status == UNREACHABLE:
                stats.unreachable += 1
                continue
            elif status == EXPIRED:
                log.warning(
                    "pop %s: changing the invisible time of %s/%d offset %d refused: its invisible time had "
                    "passed (it is delivered again)",
                    self.group,
                    record.topic,
                    record.queue_id,
                    record.queue_offset,
                )
            self.receipts.drop(record)
        return out

    def _count_ack(self, record: Record, status: str) -> None:
        stats = self.stats
        if status == UNREACHABLE:
            stats.unreachable += 1
            return
        self.receipts.drop(record)
        if status == OK:
            stats.acked += 1
        elif status == EXPIRED:
            stats.ack_expired += 1
            log.warning(
                "pop %s: ack of %s/%d offset %d refused: its invisible time had passed (it is delivered again)",
                self.group,
                record.topic,
                record.queue_id,
                record.queue_offset,
            )
        elif status == GONE:
            stats.ack_gone += 1
        else:
            stats.ack_invalid += 1

    async def _settle(
        self,
        code: RequestCode,
        records: Sequence[Record],
        fields: dict[str, Any],
        rows: Callable[[Any, int], list[tuple[str, str]]],
    ) -> list[tuple[str, str]]:
        """One request per broker; (status, new handle) per record, in order."""
        by_broker, _missing = self.receipts.split(records)
        results: list[tuple[str, str]] = [(GONE, "")] * len(records)  # no receipt (missing): settled already

        async def one(entries: list[tuple[int, Receipt]]) -> None:
            answers = await self._to_leader(code, [r for _, r in entries], fields, rows)
            for (i, _), answer in zip(entries, answers):
                results[i] = answer

        async with trio.open_nursery() as nursery:
            for entries in by_broker.values():
                nursery.start_soon(one, entries)
        return results

    async def _to_leader(
        self,
        code: RequestCode,
        receipts: list[Receipt],
        fields: dict[str, Any],
        rows: Callable[[Any, int], list[tuple[str, str]]],
    ) -> list[tuple[str, str]]:
        """The request at the group's leader, followed when it moves; ``unreachable``
        for each after ``retry_budget_ms``."""
        opts = self.options
        deadline = trio.current_time() + opts.retry_budget_ms / 1000
        addr, delay = receipts[0].addr, 0.05
        body = {"group": self.group, "handles": [r.handle for r in receipts], **fields}
        while True:
            try:
                reply = await self.rpc.request(addr, code, body, timeout_ms=opts.request_timeout_ms)
                return rows(reply.fields.get("results"), len(receipts))
            except (RpcError, *NET_ERRORS) as e:
                if not leader_moved(e):
                    raise
                if trio.current_time() + delay > deadline:
                    log.warning("pop %s: %s to %s failed: %s", self.group, code.name, addr, e or "timed out")
                    return [(UNREACHABLE, "")] * len(receipts)
            await trio.sleep(delay)
            delay = min(delay * 2, 0.5)
            addr = await self._leader_now(receipts[0], addr)
            for r in receipts:
                r.addr = addr

    async def _leader_now(self, receipt: Receipt, addr: str) -> str:
        """The address of ``receipt``'s group leader as fresh routes say (``addr`` if unknown)."""
        try:
            mqs = await self.routes.queues(receipt.record.topic, refresh=True)
        except NET_ERRORS:
            return addr
        return next(
            (m.addr for m in mqs if m.broker_name == receipt.broker_name and m.addr not in self.routes.leaderless),
            addr,
        )


def _ack_rows(value: Any, n: int) -> list[tuple[str, str]]:
    if not isinstance(value, list) or len(value) != n or any(v not in STATUSES for v in value):
        raise ProtocolError(f"ACK_MESSAGE: {n} handles sent, the answer has no status for each: {value!r:.80}")
    return [(v, "") for v in value]


def _change_rows(value: Any, n: int) -> list[tuple[str, str]]:
    if not isinstance(value, list) or len(value) != n:
        raise ProtocolError(f"CHANGE_INVISIBLE_TIME: {n} handles sent, the answer has no row for each: {value!r:.80}")
    out = []
    for row in value:
        if not (isinstance(row, (list, tuple)) and len(row) == 2 and row[0] in STATUSES and isinstance(row[1], str)):
            raise ProtocolError(f"CHANGE_INVISIBLE_TIME: a row is not [status, handle]: {row!r:.80}")
        out.append((row[0], row[1]))
    return out
