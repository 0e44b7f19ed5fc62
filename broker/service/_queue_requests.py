"""Requests about the messages and offsets of queues: PULL_MESSAGE (one queue, long
polled; consumers pull many queues at once with PULL_MESSAGES, ``_fetch``),
QUERY_OFFSETS, SEARCH_OFFSET and QUERY_QUEUE_OFFSETS (many queues at once)."""

from __future__ import annotations

from typing import Any, NoReturn

import trio

from clmq.broker.store import GetStatus, RawRead
from clmq.common import CorruptRecordError
from clmq.protocol import MAX_QUEUE_ID, ErrorCode, Frame
from clmq.protocol.transport import Peer, Reply, RequestError, need

from ._context import BrokerContext
from ._fetch import WIRE_STATUS, Visibility, optional, suggest_follower
from ._read_threads import ReadThreads

# A look-up of thousands of queues yields to other clients every this many rows: a
# checkpoint per row cost more than the row (about 2 us) and let every other request
# in between, so one look-up of 1,024 queues took 40-90 ms while fetches ran.
ROWS_PER_CHECKPOINT = 256


class QueueRequests:
    """PULL_MESSAGE and the offset look-ups; store reads in the pulls' threads."""

    def __init__(self, ctx: BrokerContext, readers: ReadThreads) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.config = ctx.config
        self._readers = readers

    async def pull_message(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields
        topic, qid, offset = need(f, "topic", str), need(f, "queue_id", int), need(f, "offset", int)
        # Types and ranges were checked (checked()); limits are clamped to the broker's.
        limit = max(1, min(optional(f, "max_messages", 32), self.config.max_pull_messages))
        wait_ms = min(optional(f, "max_wait_ms", 0), self.config.max_pull_wait_ms)
        tags = f.get("tags")
        res = await self._read(topic, qid, offset, limit, tags)
        if res.status is GetStatus.NO_MESSAGE and wait_ms:
            await self._wait_for(topic, qid, offset, wait_ms)
            res = await self._read(topic, qid, offset, limit, tags)
        if res.status is GetStatus.NO_QUEUE:
            no_queue(self.ctx, topic, qid)
        fields = {
            "status": WIRE_STATUS[res.status].value,
            "next_offset": res.next_offset,
            "min_offset": res.min_offset,
            "max_offset": res.max_offset,
            "count": res.count,
        }
        if res.count:
            self.ctx.traffic.add_out(topic, res.count, sum(s.length for s in res.spans))
        if suggest_follower(self.ctx, res.max_offset - res.next_offset):  # far behind: read from a follower
            fields["suggest_follower"] = True
        return Reply(fields, spans=res.spans)

    async def _read(self, topic: str, qid: int, offset: int, limit: int, tags: list[str] | None) -> RawRead:
        # In a worker thread, not on the event loop: even a read from the page cache can
        # block (a page fault on a cold page, a disk that stalls), and on the loop one such
        # read stalled every connection of the broker. The records go out with sendfile.
        # An offset assigned but not yet dispatched is NO_MESSAGE, so the pull waits (Visibility).
        # A damaged record at ``offset``: CORRUPT_DATA naming its file, offset and check
        # (records before it are answered first: the consumer reads up to the damage).
        visibility = Visibility(self.store)
        res = await self._readers.in_thread(
            visibility.read_to_damage, topic, qid, offset, limit, tags, self.config.max_pull_bytes
        )
        if isinstance(res, CorruptRecordError):
            raise RequestError(ErrorCode.CORRUPT_DATA, f"{topic}/{qid} offset {offset}: {res}")
        return res

    async def _wait_for(self, topic: str, qid: int, offset: int, wait_ms: int) -> None:
        key = (topic, qid)
        with trio.move_on_after(wait_ms / 1000):
            while True:
                event = self.ctx.waiters.register(key)  # before the check: no lost wake-up
                try:
                    if self.store.max_offset(topic, qid) > offset:
                        return
                    await event.wait()
                finally:
                    self.ctx.waiters.unregister(key, event)

    async def query_offsets(self, frame: Frame, peer: Peer) -> Reply:
        topic, qid = existing_queue(self.ctx, frame.fields)
        lo = await self._readers.in_thread(self.store.min_offset, topic, qid)
        return Reply({"min_offset": lo, "max_offset": self.store.max_offset(topic, qid)})

    async def search_offset(self, frame: Frame, peer: Peer) -> Reply:
        topic, qid = existing_queue(self.ctx, frame.fields)
        ts = need(frame.fields, "timestamp_ms", int)
        found = await self._readers.in_thread(self.store.offset_for_timestamp, topic, qid, ts)
        return Reply({"offset": found})

    async def query_queue_offsets(self, frame: Frame, peer: Peer) -> Reply:
        """For many queues at once: the group's committed offset (-1: none), min and
        max (a consumer given thousands of queues looks them up in a few requests)."""
        group = need(frame.fields, "group", str)
        rows: list[list[int] | None] = []
        for i, item in enumerate(need(frame.fields, "queues", list)):
            if not (
                type(item) is list
                and len(item) == 2
                and type(item[0]) is str
                and type(item[1]) is int
                and 0 <= item[1] <= MAX_QUEUE_ID
            ):
                raise RequestError(
                    ErrorCode.MALFORMED_REQUEST, f"field 'queues' row {i} must be [topic, queue_id], got {item!r:.80}"
                )
            topic, qid = item
            if not self.store.queue_exists(topic, qid):
                rows.append(None)
                continue
            rows.append([self.ctx.offsets.query(group, topic, qid), *self.store.bounds(topic, qid)])
            if i % ROWS_PER_CHECKPOINT == ROWS_PER_CHECKPOINT - 1:
                await trio.lowlevel.checkpoint()
        return Reply({"offsets": rows})


def no_queue(ctx: BrokerContext, topic: str, qid: int) -> NoReturn:
    """The error for a queue this broker does not have: its topic, or the queue id."""
    count = ctx.store.topics.queue_count(topic)
    if count is None:
        raise RequestError(ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {ctx.config.broker_name}")
    raise RequestError(ErrorCode.INVALID_QUEUE_ID, f"queue id {qid} not in 0..{count - 1} of topic {topic!r}")


def existing_queue(ctx: BrokerContext, f: dict[str, Any]) -> tuple[str, int]:
    """The request's ``topic`` and ``queue_id``, of a queue this broker has."""
    topic, qid = need(f, "topic", str), need(f, "queue_id", int)
    if not ctx.store.queue_exists(topic, qid):
        no_queue(ctx, topic, qid)
    return topic, qid
