"""Settling popped messages: ACK_MESSAGE and CHANGE_INVISIBLE_TIME, one request per
broker (replication group) for all of a call's messages there (in requests of at most
HANDLES_PER_REQUEST handles, halved while the broker takes fewer), following the group's
leader when it moved (NOT_LEADER, a connection that failed) and asking again while a
broker is busy or could not confirm (SYSTEM_BUSY while its POP state starts after a
restart or a promotion, FLUSH_DISK_TIMEOUT, REPLICATION_TIMEOUT, ...) for up to
``retry_budget_ms``; then ``unreachable``. Nothing is raised: each record gets a status,
and one broker's failure leaves the other brokers' answers as they are."""

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
from ._receipts import EXPIRED, GONE, INVALID, OK, UNKNOWN, UNREACHABLE, PopStats, Receipt, Receipts

log = logging.getLogger("clmq.pop")

NET_ERRORS = (ConnectionFailed, trio.TooSlowError, NoRouteError)
# Handles per request at most; a broker taking fewer (pop_max_handles_per_request, 4096
# by default) refuses a request over its limit, which is then asked again in halves.
HANDLES_PER_REQUEST = 1024
STATUSES = (OK, EXPIRED, GONE, INVALID)
# Answers after which the same request may work later (the broker starts, catches up, or
# its replicas come back). The ones marked in UNCONFIRMED may have been applied.
BUSY_CODES = frozenset(
    {
        ErrorCode.SYSTEM_BUSY,
        ErrorCode.SYSTEM_ERROR,
        ErrorCode.TIMEOUT,
        ErrorCode.FLUSH_DISK_TIMEOUT,
        ErrorCode.REPLICATION_TIMEOUT,
        ErrorCode.NOT_ENOUGH_REPLICAS,
        ErrorCode.STALE_EPOCH,
    }
)
UNCONFIRMED = frozenset(
    {
        ErrorCode.SYSTEM_ERROR,
        ErrorCode.TIMEOUT,
        ErrorCode.FLUSH_DISK_TIMEOUT,
        ErrorCode.REPLICATION_TIMEOUT,
        ErrorCode.NOT_ENOUGH_REPLICAS,
    }
)


def leader_moved(e: BaseException) -> bool:
    """A failure after which the group may answer at another address."""
    if isinstance(e, RpcError):
        return e.code in (ErrorCode.NOT_LEADER, ErrorCode.SHUTTING_DOWN)
    return isinstance(e, NET_ERRORS)


def worth_retrying(e: BaseException) -> bool:
    """A settling failure after which asking again (maybe elsewhere) may work."""
    return leader_moved(e) or (isinstance(e, RpcError) and e.code in BUSY_CODES)


def maybe_applied(e: BaseException) -> bool:
    """A failed try that the broker may have applied all the same (sent, no answer; or
    written and not confirmed)."""
    if isinstance(e, RpcError):
        return e.code in UNCONFIRMED
    return isinstance(e, (ConnectionFailed, trio.TooSlowError))


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
        ``invalid``, ``unreachable``); all but ``unreachable`` end the receipt. Never raises."""
        results = await self._settle(RequestCode.ACK_MESSAGE, records, {}, _ack_rows)
        out = []
        for record, (status, _) in zip(records, results):
            out.append(status)
            self._count_ack(record, status)
        return out

    async def change(self, records: Sequence[Record], invisible_time_ms: int, *, keep: bool) -> list[str]:
        """CHANGE_INVISIBLE_TIME: a status per record. ``keep``: an ``ok`` record stays
        with this consumer under its new handle (extend); else its receipt ends (nack).
        ``unknown``: a try may have been applied and the retry was refused (the receipt
        ends; the message comes back after its invisible time). Never raises."""
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
            elif status == UNKNOWN:
                stats.unknown += 1
                log.warning(
                    "pop %s: changing the invisible time of %s/%d offset %d: outcome unknown (a try timed out, "
                    "the retry was refused); it comes back after its invisible time",
                    self.group,
                    record.topic,
                    record.queue_id,
                    record.queue_offset,
                )
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
        """Requests per broker (in parts under its handle limit); (status, new handle) per record, in order."""
        by_broker, _missing = self.receipts.split(records)
        # No receipt here: settled through this consumer already, refused before, or
        # forgotten long past its deadline; whether the broker still holds it is not known
        # here, so it is not called settled: "expired" (treat it as delivered again).
        results: list[tuple[str, str]] = [(EXPIRED, "")] * len(records)

        async def one(entries: list[tuple[int, Receipt]]) -> None:
            for start in range(0, len(entries), HANDLES_PER_REQUEST):
                await part(entries[start : start + HANDLES_PER_REQUEST])

        async def part(entries: list[tuple[int, Receipt]]) -> None:
            receipts = [r for _, r in entries]
            try:
                answers = await self._to_leader(code, receipts, fields, rows)
            except _TooManyHandles:  # this broker takes fewer at once: halves, in turn
                half = len(entries) // 2
                await part(entries[:half])
                await part(entries[half:])
                return
            except Exception as e:  # never raised: the others' answers stand
                log.error("pop %s: %s at %s failed: %r", self.group, code.name, receipts[0].addr, e)
                answers = [(UNREACHABLE, "")] * len(receipts)
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
        addr, delay, unsure = receipts[0].addr, 0.05, False
        body = {"group": self.group, "handles": [r.handle for r in receipts], **fields}
        while True:
            try:
                reply = await self.rpc.request(addr, code, body, timeout_ms=opts.request_timeout_ms)
                answers = rows(reply.fields.get("results"), len(receipts))
                return _after_unsure(answers) if unsure and code == RequestCode.CHANGE_INVISIBLE_TIME else answers
            except (RpcError, *NET_ERRORS) as e:
                if _too_many(e, len(receipts)):
                    raise _TooManyHandles() from e
                if not worth_retrying(e):
                    log.error("pop %s: %s refused by %s: %s", self.group, code.name, addr, e)
                    return [(UNREACHABLE, "")] * len(receipts)
                unsure = unsure or maybe_applied(e)
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


class _TooManyHandles(Exception):
    """A request refused for carrying more handles than its broker takes at once."""


def _too_many(e: BaseException, handles: int) -> bool:
    return (
        handles > 1
        and isinstance(e, RpcError)
        and e.code == ErrorCode.MALFORMED_REQUEST
        and "pop_max_handles_per_request" in e.text
    )


def _after_unsure(answers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A change retried after a try that may have been applied: "expired" or "gone" may
    be the first try's doing (a new handle this consumer never got), so neither is told."""
    return [(UNKNOWN, "") if status in (EXPIRED, GONE) else (status, h) for status, h in answers]


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
