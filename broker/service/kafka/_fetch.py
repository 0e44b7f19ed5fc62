"""Fetch, ListOffsets and OffsetForLeaderEpoch: reading queues as Kafka partitions.

A fetch reads each partition's queue from its offset (in the pulls' read threads)
and sends the messages as record batches (uncompressed; one batch per run of
consecutive offsets), within ``partition_max_bytes`` and ``max_bytes`` but always at
least one message (Kafka's KIP-74 rule, so that a message larger than the limits
still moves the consumer). With less than ``min_bytes`` found it waits, up to
``max_wait_ms``, for any of its queues to get messages (the same wake-ups as clmq's
long polls). The high watermark is the queue's end as consumers may see it (entries
are made only up to what replication confirmed), so a Kafka consumer never reads a
message that a failover could take back. Fetch sessions (KIP-227) are not kept:
session id 0 tells clients to send full requests, which they do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from clmq.broker.store import GetStatus, StorageEngine
from clmq.common import CorruptRecordError
from clmq.protocol.kafka import Compression, ErrorCode, KafkaRequest

from .._context import BrokerContext
from .._fetch import Visibility
from .._read_threads import ReadThreads
from ._cluster import ClusterView, ClusterViews
from ._listener import Peer
from ._mapping import to_kafka
from ._metadata import topic_id
from ._produce_wait import AckedEnds
from ._raw_records import batches_of

log = logging.getLogger("clmq.broker.kafka")

READ_CHUNK_MESSAGES = 512  # messages read per store call by ListOffsets' search by time
READ_MAX_MESSAGES = 16_384  # a partition's messages per fetch at most (its byte budget usually ends it first)
KAFKA_STORAGE_ERROR = 56
EARLIEST, LATEST, MAX_TIMESTAMP = -2, -1, -3
TIME_SCAN_BACK_MESSAGES = (
    64  # ListOffsets by time looks this far before the binary search's answer  # ListOffsets' special timestamps
)


@dataclass
class _Ask:
    topic: str
    index: int
    offset: int
    max_bytes: int
    queue_id: int = -1
    error: int = 0
    high_watermark: int = -1
    log_start: int = -1
    records: bytes = b""
    count: int = 0
    rows: list[Any] = field(default_factory=list)


class KafkaFetch:
    """Reads for Kafka consumers of this broker's queues."""

    def __init__(self, ctx: BrokerContext, views: ClusterViews, readers: ReadThreads, acked: AckedEnds) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.views = views
        self._readers = readers
        self.acked = acked  # queues' ends past their entries: what producers were told is stored
        # Fetch answers are compressed with this (kafka_fetch_compression): less network for CPU.
        self.compression = Compression[ctx.config.kafka_fetch_compression.upper()]

    def local_queue(self, view: ClusterView, topic: str, index: int) -> tuple[int, int]:
        """(queue id, 0) of a partition this broker leads, else (-1, error code)."""
        homes = view.topics.get(topic)
        if homes is None or not 0 <= index < len(homes):
            return -1, ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        home = homes[index]
        if home.group != self.ctx.config.broker_name or self.ctx.replica.role != "leader":
            self.views.invalidate()
            return -1, ErrorCode.NOT_LEADER_OR_FOLLOWER
        return home.queue_id, 0

    async def fetch(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        view = await self.views.current()
        asks, order = self._asks(body, view)
        wait_ms = min(max(body.get("max_wait_ms", 0), 0), self.ctx.config.kafka_max_fetch_wait_ms)
        max_bytes = max(body.get("max_bytes", 0x7FFFFFFF), 1)
        await self._readers.in_thread(self._read_all, asks, max_bytes)
        found = sum(len(a.records) for a in asks)
        wait = found < max(body.get("min_bytes", 1), 1) and wait_ms > 0 and not any(a.error for a in asks)
        if wait and await self._wait_any(asks, wait_ms):
            await self._readers.in_thread(self._read_all, asks, max_bytes)
        for ask in asks:  # on the event loop, where produce answers record them
            if not ask.error:
                ask.high_watermark = self.acked.end((ask.topic, ask.queue_id), ask.high_watermark)
            if ask.count:
                self.ctx.traffic.add_out(ask.topic, ask.count, len(ask.records))
        return {"throttle_time_ms": 0, "error_code": 0, "session_id": 0, "responses": self._responses(order, asks)}

    def _asks(self, body: dict[str, Any], view: ClusterView) -> tuple[list[_Ask], list[tuple[str, Any]]]:
        asks: list[_Ask] = []
        order: list[tuple[str, Any]] = []
        for t in body.get("topics", []):
            name = t.get("topic")
            if name is None:
                name = next((n for n in view.topics if topic_id(self.ctx.config.cluster, n) == t.get("topic_id")), "")
            order.append((name, t.get("topic_id")))
            for p in t.get("partitions", []):
                ask = _Ask(name, p["partition"], p["fetch_offset"], max(p.get("partition_max_bytes", 0), 0))
                ask.queue_id, ask.error = self.local_queue(view, name, ask.index)
                if not name:
                    ask.error = ErrorCode.UNKNOWN_TOPIC_ID
                asks.append(ask)
        return asks, order

    def _read_all(self, asks: list[_Ask], max_bytes: int) -> None:
        """Every partition's messages, within the request's byte budget (in a worker thread)."""
        budget = max_bytes
        visibility = Visibility(self.store)
        found = False  # a message found yet (the first may exceed the limits: KIP-74)
        for ask in asks:
            ask.records, ask.count = b"", 0
            if ask.error:
                continue
            _read_one(self.store, visibility, ask, min(ask.max_bytes, budget), not found, self.compression)
            budget -= len(ask.records)
            found = found or bool(ask.records)

    async def _wait_any(self, asks: list[_Ask], wait_ms: int) -> bool:
        """Wait until any asked queue gets messages past its offset; False on time-out."""
        event = trio.Event()
        keys = [(a.topic, a.queue_id) for a in asks if not a.error]
        for key in keys:
            self.ctx.waiters.add(key, event)
        try:
            if any(self.store.max_offset(a.topic, a.queue_id) > a.offset for a in asks if not a.error):
                return True
            with trio.move_on_after(wait_ms / 1000):
                await event.wait()
            return event.is_set()
        finally:
            for key in keys:
                self.ctx.waiters.unregister(key, event)

    def _responses(self, order: list[tuple[str, Any]], asks: list[_Ask]) -> list[dict[str, Any]]:
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for ask in asks:
            by_topic.setdefault(ask.topic, []).append(
                {
                    "partition_index": ask.index,
                    "error_code": ask.error,
                    "high_watermark": ask.high_watermark,
                    "last_stable_offset": ask.high_watermark,
                    "log_start_offset": ask.log_start,
                    "aborted_transactions": None,
                    "preferred_read_replica": -1,
                    "records": ask.records,
                }
            )
        return [{"topic": name, "topic_id": tid, "partitions": by_topic.pop(name, [])} for name, tid in order]

    # ------------------------------------------------------------ offsets
    async def list_offsets(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        view = await self.views.current()
        topics = []
        for t in req.body.get("topics", []):
            rows = [await self._list_one(view, t["name"], p) for p in t.get("partitions", [])]
            topics.append({"name": t["name"], "partitions": rows})
        return {"throttle_time_ms": 0, "topics": topics}

    async def _list_one(self, view: ClusterView, topic: str, p: dict[str, Any]) -> dict[str, Any]:
        row: dict[str, Any] = {
            "partition_index": p["partition_index"],
            "error_code": 0,
            "timestamp": -1,
            "offset": -1,
            "leader_epoch": -1,
            "old_style_offsets": [],
        }
        queue_id, error = self.local_queue(view, topic, p["partition_index"])
        if error:
            row["error_code"] = error
            return row
        when = p["timestamp"]
        lo, hi = self.store.bounds(topic, queue_id)
        hi = self.acked.end((topic, queue_id), hi)
        if when == EARLIEST:
            row["offset"] = lo
        elif when in (LATEST, MAX_TIMESTAMP) or when < 0:
            row["offset"] = hi
        else:
            found = await self._readers.in_thread(offset_for_time, self.store, topic, queue_id, when)
            if found is not None:
                row["offset"], row["timestamp"] = found
        row["old_style_offsets"] = [row["offset"]]
        return row

    async def offset_for_leader_epoch(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        """Leader epochs are not given to clients (Metadata says -1), so a client asking
        is told the partition's end: nothing to truncate."""
        view = await self.views.current()
        topics = []
        for t in req.body.get("topics", []):
            rows = []
            for p in t.get("partitions", []):
                queue_id, error = self.local_queue(view, t["topic"], p["partition"])
                end = -1 if error else self.store.max_offset(t["topic"], queue_id)
                rows.append({"error_code": error, "partition": p["partition"], "leader_epoch": -1, "end_offset": end})
            topics.append({"topic": t["topic"], "partitions": rows})
        return {"throttle_time_ms": 0, "topics": topics}


def _read_one(
    store: StorageEngine,
    visibility: Visibility,
    ask: _Ask,
    budget: int,
    first: bool,
    compression: Compression = Compression.NONE,
) -> None:
    """One partition's messages from ``ask.offset`` into ``ask.records``: whole
    messages within ``budget`` bytes, or one message if ``first`` (KIP-74). A damaged
    record stops this partition (KAFKA_STORAGE_ERROR, logged with its file and
    offset); the others are served."""
    lo, hi = store.bounds(ask.topic, ask.queue_id)
    ask.log_start, ask.high_watermark = lo, hi
    # next_assigned copies the log's table of queue offsets: asked only past the visible end
    if ask.offset < lo or (ask.offset > hi and ask.offset > visibility.next_assigned(ask.topic, ask.queue_id)):
        ask.error = ErrorCode.OFFSET_OUT_OF_RANGE
        return
    if ask.offset >= hi or (budget <= 0 and not first):
        return
    read = store.read_raw(ask.topic, ask.queue_id, ask.offset, READ_MAX_MESSAGES, max_bytes=max(budget, 1))
    if read.status is not GetStatus.FOUND or (read.nbytes > budget and not first):
        return
    try:
        ask.records, ask.count = batches_of(read, ask.queue_id, ask.offset, compression)
    except (CorruptRecordError, OSError) as e:
        log.warning("kafka fetch of %s queue %d at %d: %s", ask.topic, ask.queue_id, ask.offset, e)
        ask.error, ask.records = KAFKA_STORAGE_ERROR, b""


def offset_for_time(store: StorageEngine, topic: str, queue_id: int, when: int) -> tuple[int, int] | None:
    """The first (offset, timestamp) whose record timestamp (Kafka's: the born
    timestamp, or the one a Kafka producer set) is at least ``when``; None if none.
    Timestamps are set by producers and may go back a little: a binary search finds the
    region, a forward scan the first one at or after ``when``."""
    lo, hi = store.bounds(topic, queue_id)

    def stamp(offset: int) -> int | None:
        got = store.get(topic, queue_id, offset, 1)
        return to_kafka(got.messages[0])[0] if got.messages else None

    left, right = lo, hi
    while left < right:
        mid = (left + right) // 2
        ts = stamp(mid)
        if ts is not None and ts < when:
            left = mid + 1
        else:
            right = mid
    offset = max(lo, left - TIME_SCAN_BACK_MESSAGES)
    while offset < hi:
        got = store.get(topic, queue_id, offset, READ_CHUNK_MESSAGES)
        if not got.messages:
            return None
        for r in got.messages:
            ts = to_kafka(r)[0]
            if ts >= when:
                return r.queue_offset, ts
        offset = got.next_offset
    return None
