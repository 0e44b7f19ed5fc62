"""The broker's request handlers: pull, offsets, groups and topics (produce: ``_produce``).

Appends and every store call that may touch the disk run in worker threads
(``trio.to_thread``), so a slow disk holds up the requests that need it, not the event
loop: pulls and offset look-ups share ``pull_read_threads`` threads
(:class:`ReadThreads`); the records a pull found still go out with ``sendfile``.
Every request is checked (:func:`checked`) before its handler runs.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from clmq.broker.store import GetStatus, RawRead, StorageEngine
from clmq.common import CorruptRecordError, is_system_topic
from clmq.protocol import MAX_QUEUE_ID, ErrorCode, Frame, RequestCode
from clmq.protocol.transport import Handler, Peer, Reply, RequestError, checked, need

from ._admin_requests import AdminRequests
from ._context import BrokerContext, now_ms
from ._fetch import WIRE_STATUS, Fetch, ReadThreads, Visibility, optional, suggest_follower
from ._locks import LockRequests
from ._log_reads import LogReads
from ._metrics import status_fields
from ._produce import Produce
from ._scheduled import ScheduledRequests
from ._sendback import SendBack
from .timer import Timer

# A look-up of thousands of queues yields to other clients every this many rows: a
# checkpoint per row cost more than the row (about 2 us) and let every other request
# in between, so one look-up of 1,024 queues took 40-90 ms while fetches ran.
ROWS_PER_CHECKPOINT = 256


class Handlers:
    """Every request the broker serves, bound to one broker's :class:`BrokerContext`."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.config = ctx.config
        # Pulls and look-ups read the disk in at most this many threads at once: a slow
        # read (a page fault, a busy disk) holds up the pulls that wait for a thread, never
        # the event loop that serves every connection.
        self._readers = ReadThreads(ctx.config.pull_read_threads)
        self.timer = Timer(ctx)
        self.scheduled = ScheduledRequests(ctx, self.timer)
        self.produce = Produce(ctx, self._readers, self.scheduled)
        self.locks = LockRequests(ctx)
        self.started = time.monotonic()  # BROKER_INFO's uptime

    def table(self) -> dict[int, Handler]:
        """Every request code's handler, each behind :func:`checked`."""
        log_reads = LogReads(self.ctx, self._readers)
        admin = AdminRequests(self.ctx)
        handlers: dict[int, Handler] = {
            RequestCode.SEND_MESSAGE: self.produce.send_message,
            RequestCode.PULL_MESSAGE: self.pull_message,
            RequestCode.PULL_MESSAGES: Fetch(self.ctx, self._readers).handle,
            RequestCode.QUERY_OFFSETS: self.query_offsets,
            RequestCode.SEARCH_OFFSET: self.search_offset,
            RequestCode.COMMIT_OFFSET: self.commit_offset,
            RequestCode.QUERY_CONSUMER_OFFSET: self.query_consumer_offset,
            RequestCode.QUERY_QUEUE_OFFSETS: self.query_queue_offsets,
            RequestCode.HEARTBEAT: self.heartbeat,
            RequestCode.UNREGISTER_CLIENT: self.unregister_client,
            RequestCode.GET_GROUP_MEMBERS: self.group_members,
            RequestCode.LIST_GROUPS: self.list_groups,
            RequestCode.DESCRIBE_GROUP: self.describe_group,
            RequestCode.DELETE_GROUP: admin.delete_group,
            RequestCode.CONSUMER_SEND_BACK: SendBack(self.ctx).handle,
            RequestCode.CANCEL_MESSAGE: self.scheduled.cancel,
            RequestCode.LOCK_QUEUES: self.locks.lock,
            RequestCode.UNLOCK_QUEUES: self.locks.unlock,
            RequestCode.GET_MESSAGE: admin.get_message,
            RequestCode.CREATE_TOPIC: self.create_topic,
            RequestCode.DELETE_TOPIC: self.delete_topic,
            RequestCode.LIST_TOPICS: self.list_topics,
            RequestCode.DESCRIBE_TOPIC: self.describe_topic,
            RequestCode.BROKER_INFO: self.broker_info,
            RequestCode.GET_LOG_LAYOUT: log_reads.layout,
            RequestCode.READ_LOG: log_reads.read_log,
        }
        return {code: checked(handler) for code, handler in handlers.items()}

    # --------------------------------------------------------------------- pull
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
            self._no_queue(topic, qid)
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

    def _no_queue(self, topic: str, qid: int) -> None:
        count = self.store.topics.queue_count(topic)
        if count is None:
            raise RequestError(
                ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}"
            )
        raise RequestError(ErrorCode.INVALID_QUEUE_ID, f"queue id {qid} not in 0..{count - 1} of topic {topic!r}")

    # ------------------------------------------------------------------ offsets
    def _queue(self, f: dict[str, Any]) -> tuple[str, int]:
        topic, qid = need(f, "topic", str), need(f, "queue_id", int)
        if not self.store.queue_exists(topic, qid):
            self._no_queue(topic, qid)
        return topic, qid

    async def query_offsets(self, frame: Frame, peer: Peer) -> Reply:
        topic, qid = self._queue(frame.fields)
        lo = await self._readers.in_thread(self.store.min_offset, topic, qid)
        return Reply({"min_offset": lo, "max_offset": self.store.max_offset(topic, qid)})

    async def search_offset(self, frame: Frame, peer: Peer) -> Reply:
        topic, qid = self._queue(frame.fields)
        ts = need(frame.fields, "timestamp_ms", int)
        found = await self._readers.in_thread(self.store.offset_for_timestamp, topic, qid, ts)
        return Reply({"offset": found})

    async def commit_offset(self, frame: Frame, peer: Peer) -> Reply:
        """Many offsets of one group at once (a consumer of thousands of queues commits
        them in one request); queues that no longer exist are ignored."""
        group = need(frame.fields, "group", str)
        rows = need(frame.fields, "offsets", list)
        self.ctx.replica.check_writable()
        self.ctx.metadata.bump()
        for row in rows:
            if not (
                isinstance(row, list)
                and len(row) == 3
                and isinstance(row[0], str)
                and isinstance(row[1], int)
                and isinstance(row[2], int)
            ):
                raise RequestError(ErrorCode.MALFORMED_REQUEST, "offsets must be [topic, queue_id, offset] lists")
        for topic, qid, offset in rows:
            if self.store.queue_exists(topic, qid):
                self.ctx.offsets.commit(group, topic, qid, offset)
        return Reply()

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

    async def query_consumer_offset(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields
        group = need(f, "group", str)
        topic, qid = self._queue(f)
        return Reply({"offset": self.ctx.offsets.query(group, topic, qid)})

    # ------------------------------------------------------------------- groups
    async def heartbeat(self, frame: Frame, peer: Peer) -> Reply:
        client_id = need(frame.fields, "client_id", str)
        for g in need(frame.fields, "groups", list):
            if not isinstance(g, dict) or not isinstance(g.get("group"), str):
                raise RequestError(ErrorCode.MALFORMED_REQUEST, "groups must be maps with a 'group' name")
            if self.ctx.groups.heartbeat(
                client_id, g["group"], g.get("mode", "clustering"), g.get("topics", []), now_ms()
            ):
                self.ctx.metadata.bump()
        return Reply()

    async def unregister_client(self, frame: Frame, peer: Peer) -> Reply:
        client_id = need(frame.fields, "client_id", str)
        self.ctx.groups.leave(client_id)
        self.locks.release_client(client_id)
        return Reply()

    async def group_members(self, frame: Frame, peer: Peer) -> Reply:
        members = self.ctx.groups.members(need(frame.fields, "group", str))
        return Reply({"members": [m.client_id for m in members]})

    async def list_groups(self, frame: Frame, peer: Peer) -> Reply:
        return Reply({"groups": sorted(set(self.ctx.groups.groups()) | set(self.ctx.offsets.groups()))})

    async def describe_group(self, frame: Frame, peer: Peer) -> Reply:
        group = need(frame.fields, "group", str)
        rows = []
        for (topic, qid), committed in sorted(self.ctx.offsets.of_group(group).items()):
            if self.store.queue_exists(topic, qid):
                hi = self.store.max_offset(topic, qid)
                rows.append(
                    {
                        "topic": topic,
                        "queue_id": qid,
                        "committed": committed,
                        "max_offset": hi,
                        "lag": max(0, hi - committed),
                    }
                )
        members = [
            {"client_id": m.client_id, "mode": m.mode, "topics": m.topics} for m in self.ctx.groups.members(group)
        ]
        return Reply({"queues": rows, "members": members})

    # ------------------------------------------------------------------- topics
    async def create_topic(self, frame: Frame, peer: Peer) -> Reply:
        topic, count = need(frame.fields, "topic", str), need(frame.fields, "queue_count", int)
        self.ctx.replica.check_writable()
        have = self.store.topics.queue_count(topic)
        if have is not None and count < have:  # queues cannot go: their messages and offsets would be stranded
            raise RequestError(
                ErrorCode.INVALID_TOPIC,
                f"topic {topic!r} has {have} queues on {self.config.broker_name}: "
                f"a queue count can grow, not shrink (asked {count})",
            )
        try:
            await trio.to_thread.run_sync(self.store.create_topic, topic, count)
        except ValueError as e:
            raise RequestError(ErrorCode.INVALID_TOPIC, str(e)) from None
        self.ctx.metadata.bump_topics()
        self.ctx.register_now()
        return Reply({"queue_count": self.store.topics.queue_count(topic)})

    async def delete_topic(self, frame: Frame, peer: Peer) -> Reply:
        topic = need(frame.fields, "topic", str)
        self.ctx.replica.check_writable()
        if not await trio.to_thread.run_sync(self.store.delete_topic, topic):
            raise RequestError(
                ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}"
            )
        self.ctx.offsets.drop_topic(topic)
        self.ctx.metadata.bump_topics()
        self.ctx.register_now()
        return Reply()

    async def list_topics(self, frame: Frame, peer: Peer) -> Reply:
        topics = self.store.topics.all()
        if not frame.fields.get("include_system"):
            topics = {name: count for name, count in topics.items() if not is_system_topic(name)}
        return Reply({"topics": topics})

    async def describe_topic(self, frame: Frame, peer: Peer) -> Reply:
        topic = need(frame.fields, "topic", str)
        count = self.store.topics.queue_count(topic)
        if count is None:
            raise RequestError(
                ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}"
            )

        sizes = getattr(self.store, "queue_bytes", None)  # commitlog mode; partition-per-file: not summed (-1)
        cap = self.config.describe_size_max_entries

        def offsets() -> list[dict[str, int]]:
            rows = []
            for q in range(count):
                size = sizes(topic, q, cap) if sizes is not None else None
                rows.append(
                    {
                        "queue_id": q,
                        "min_offset": self.store.min_offset(topic, q),
                        "max_offset": self.store.max_offset(topic, q),
                        "size_bytes": -1 if size is None else size,
                    }
                )
            return rows

        return Reply({"queue_count": count, "queues": await self._readers.in_thread(offsets)})

    async def broker_info(self, frame: Frame, peer: Peer) -> Reply:
        c = self.config
        return Reply(
            {
                "broker_name": c.broker_name,
                "cluster": c.cluster,
                "addr": self.ctx.addr(),
                "storage_mode": c.storage_mode,
                "flush_mode": c.flush_mode,
                "end_offset": self.store.end_offset,
                "durable_offset": self.store.durable_offset,
                "dispatch_lag_bytes": self.store.dispatch_lag_bytes,
                "connections": self.ctx.connections(),
                "topics": len(self.store.topics.all()),
                "healthy": self.store.failure is None,
                "failure": health_text(self.store),
                "broker_id": c.broker_id,
                "role": self.ctx.replica.role,
                "epoch": self.ctx.replica.epoch,
                **self.timer_fields(),
                **status_fields(self.ctx, self.started),
            }
        )

    def timer_fields(self) -> dict[str, int | str]:
        """BROKER_INFO's view of the timer (pending -1: not running here, e.g. a follower)."""
        t = self.timer
        return {
            "timer_pending": t.pending,
            "timer_failure": t.failure,
            "timer_delivered": t.stats.delivered,
            "timer_cancelled": t.stats.cancelled,
            "timer_undeliverable": t.stats.undeliverable,
            "timer_memory_bytes": t.memory_bytes(),
        }


def health_text(store: StorageEngine) -> str:
    """Why the store is unhealthy ("" if it is), as the broker reports it."""
    return "" if store.failure is None else str(store.failure)


def registration(ctx: BrokerContext) -> dict[str, Any]:
    """The fields of the broker's REGISTER_BROKER: its topics and its health (a broker
    whose store failed registers ``healthy: false`` and why: name servers keep it in the
    routes, marked, so that producers skip it and consumers still read it)."""
    c, store = ctx.config, ctx.store
    return {
        "cluster": c.cluster,
        "broker_name": c.broker_name,
        "addr": ctx.addr(),
        "topics": store.topics.all(),
        "healthy": store.failure is None,
        "failure": health_text(store),
        "broker_id": c.broker_id,
        "role": ctx.replica.role,
        "epoch": ctx.replica.epoch,
    }
