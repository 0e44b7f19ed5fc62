"""PULL_MESSAGES: one request reads many queues (Kafka's fetch), so that a consumer of
thousands of queues pays one round trip for many of them, not one per queue.

Queues are read in the order given, each up to ``max_per_queue`` messages, until the
request's ``max_messages`` or the broker's ``max_pull_bytes``; the rest are reported
``SKIPPED`` (the client asks again). If nothing is found the request waits (long
polling) until any of its queues gets entries or ``max_wait_ms`` passes.

The reads of one request run in one worker thread (a hop per request, not per queue),
among at most ``pull_read_threads``: a slow disk read holds up that request, not the
event loop.
"""

from __future__ import annotations

from typing import Any

import trio

from broker.store import GetStatus, Span
from protocol import ErrorCode, FetchAsk, FetchResult, Frame, PullStatus, RowError
from protocol.transport import Reply, RequestError, need

from ._context import BrokerContext


def parse_queues(fields: dict[str, Any]) -> list[FetchAsk]:
    try:
        return [FetchAsk.from_wire(row) for row in need(fields, "queues", list)]
    except RowError as e:
        raise RequestError(ErrorCode.MALFORMED_REQUEST, f"queues: {e}") from None


# A queue's read status as the wire says it (PULL_MESSAGE's status, a fetch row's first field).
WIRE_STATUS = {status: PullStatus[status.name] for status in GetStatus}


class Fetch:
    def __init__(self, context: BrokerContext, read_limiter: trio.CapacityLimiter) -> None:
        self.waiters = context.waiters
        self.store = context.store
        self.config = context.config
        self.read_limiter = read_limiter  # shared with the broker's other reads

    async def handle(self, frame: Frame, _peer: object) -> Reply:
        f = frame.fields
        asks = parse_queues(f)
        # Types and ranges were checked (protocol.check_request); limits are clamped to the broker's.
        total = max(1, min(f.get("max_messages") or 1024, self.config.max_pull_messages))
        per_queue = max(1, f.get("max_per_queue") or 256)
        wait_ms = min(f.get("max_wait_ms") or 0, self.config.max_pull_wait_ms)
        results, spans, found = await self._read_in_thread(asks, total, per_queue)
        if not found and wait_ms:
            await self._wait_any(asks, wait_ms)
            results, spans, found = await self._read_in_thread(asks, total, per_queue)
        return Reply({"results": results, "count": found}, spans=spans)

    async def _read_in_thread(self, asks: list[FetchAsk], total: int,
                              per_queue: int) -> tuple[list[list[Any]], list[Span], int]:  # fmt: skip
        return await trio.to_thread.run_sync(self._read, asks, total, per_queue, limiter=self.read_limiter)

    def _read(self, asks: list[FetchAsk], total: int, per_queue: int) -> tuple[list[list[Any]], list[Span], int]:
        """Per queue a :class:`FetchResult` row (max offset -1 when SKIPPED: not looked
        at), the spans, and the count."""
        results: list[list[Any]] = []
        spans: list[Span] = []
        found = nbytes = 0
        for topic, qid, offset, tags in asks:
            if found >= total or nbytes >= self.config.max_pull_bytes:
                results.append(FetchResult.row(PullStatus.SKIPPED, offset, 0, 0, -1))
                continue
            res = self.store.read_raw(topic, qid, offset, min(per_queue, total - found), tags,
                                      self.config.max_pull_bytes - nbytes)  # fmt: skip
            size = res.nbytes  # a sum over the spans: once
            results.append(FetchResult.row(WIRE_STATUS[res.status], res.next_offset, res.count, size, res.max_offset))
            spans += res.spans
            found += res.count
            nbytes += size
        return results, spans, found

    async def _wait_any(self, asks: list[FetchAsk], wait_ms: int) -> None:
        event = trio.Event()
        keys = [(topic, qid) for topic, qid, _o, _t in asks]
        waiters = self.waiters
        for key in keys:  # before the check: an arrival in between is not missed
            waiters.add(key, event)
        try:
            if any(self.store.queue_exists(t, q) and self.store.max_offset(t, q) > o for t, q, o, _ in asks):
                return
            with trio.move_on_after(wait_ms / 1000):
                await event.wait()
        finally:
            for key in keys:
                waiters.unregister(key, event)
