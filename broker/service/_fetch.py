"""PULL_MESSAGES: one request reads many queues (Kafka's fetch), so that a consumer of
thousands of queues pays one round trip for many of them, not one per queue.

Queues are read in the order given, each up to ``max_per_queue`` messages, until the
request's ``max_messages`` or the broker's ``max_pull_bytes``; the rest are reported
``SKIPPED`` (the client asks again). If nothing is found the request waits (long
polling) until any of its queues gets entries or ``max_wait_ms`` passes.
"""

from __future__ import annotations

from typing import Any

import trio

from protocol import ErrorCode, Frame
from protocol.transport import Reply, RequestError, need

from ._context import BrokerContext

QueueAsk = tuple[str, int, int, "list[str] | None"]  # topic, queue id, offset, tags


def parse_queues(fields: dict[str, Any]) -> list[QueueAsk]:
    asks: list[QueueAsk] = []
    for item in need(fields, "queues", list):
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and isinstance(item[1], int)
                and isinstance(item[2], int) and (item[3] is None or isinstance(item[3], list))):  # fmt: skip
            raise RequestError(ErrorCode.MALFORMED_REQUEST, "queues must be [topic, queue_id, offset, tags or nil] lists")
        asks.append((item[0], item[1], item[2], item[3]))
    return asks


class Fetch:
    def __init__(self, context: BrokerContext) -> None:
        self.waiters = context.waiters
        self.store = context.store
        self.config = context.config

    async def handle(self, frame: Frame, _peer: object) -> Reply:
        f = frame.fields
        asks = parse_queues(f)
        total = max(1, min(int(f.get("max_messages", 1024)), self.config.max_pull_messages))
        per_queue = max(1, int(f.get("max_per_queue", 256)))
        wait_ms = max(0, min(int(f.get("max_wait_ms", 0)), self.config.max_pull_wait_ms))
        await trio.lowlevel.checkpoint()
        results, spans, found = self._read(asks, total, per_queue)
        if not found and wait_ms:
            await self._wait_any(asks, wait_ms)
            results, spans, found = self._read(asks, total, per_queue)
        return Reply({"results": results, "count": found}, spans=spans)

    def _read(self, asks: list[QueueAsk], total: int, per_queue: int) -> tuple[list[list[Any]], list[Any], int]:
        """Per queue ``[status, next offset, count, bytes, max offset]`` (max offset -1 when
        SKIPPED: not looked at), the spans, and the count."""
        results: list[list[Any]] = []
        spans: list[Any] = []
        found = nbytes = 0
        for topic, qid, offset, tags in asks:
            if found >= total or nbytes >= self.config.max_pull_bytes:
                results.append(["SKIPPED", offset, 0, 0, -1])
                continue
            res = self.store.read_raw(topic, qid, offset, min(per_queue, total - found), tags,
                                      self.config.max_pull_bytes - nbytes)  # fmt: skip
            size = res.nbytes  # a sum over the spans: once
            results.append([res.status.name, res.next_offset, res.count, size, res.max_offset])
            spans += res.spans
            found += res.count
            nbytes += size
        return results, spans, found

    async def _wait_any(self, asks: list[QueueAsk], wait_ms: int) -> None:
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
