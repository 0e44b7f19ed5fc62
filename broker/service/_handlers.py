"""The broker's request handlers: produce, pull, offsets, groups and topics.

Appends and every store call that may touch the disk run in worker threads
(``trio.to_thread``), so a slow disk holds up the requests that need it, not the event
loop: pulls and offset look-ups share ``pull_read_threads`` threads
(:class:`ReadThreads`); the records a pull found still go out with ``sendfile``.
Every request is checked (:func:`checked`) before its handler runs.
"""

from __future__ import annotations

from typing import Any

import trio

from broker.store import GetStatus, PutStatus, RawRead, StorageEngine
from commitlog import CorruptRecordError, FlushMode
from protocol import MAX_QUEUE_ID, BatchError, ErrorCode, Frame, RequestCode, decode_batch
from protocol.transport import Handler, Later, Peer, Reply, RequestError, checked, need

from ._append import BusyError, PendingPut
from ._context import BrokerContext, now_ms
from ._dedup import UNIQ_KEY, DedupLimits, PartlyStored, Stored, find_stored, wait_visible
from ._fetch import WIRE_STATUS, Fetch, ReadThreads, Visibility, optional, suggest_follower
from ._log_reads import LogReads

# A look-up of thousands of queues yields to other clients every this many rows: a
# checkpoint per row cost more than the row (about 2 us) and let every other request
# in between, so one look-up of 1,024 queues took 40-90 ms while fetches ran.
ROWS_PER_CHECKPOINT = 256

_PUT_ERRORS = {
    PutStatus.MESSAGE_TOO_LARGE: ErrorCode.MESSAGE_TOO_LARGE,
    PutStatus.INVALID_MESSAGE: ErrorCode.INVALID_MESSAGE,
    PutStatus.INVALID_TOPIC: ErrorCode.INVALID_TOPIC,
    PutStatus.UNKNOWN_TOPIC: ErrorCode.TOPIC_NOT_FOUND,
    PutStatus.INVALID_QUEUE_ID: ErrorCode.INVALID_QUEUE_ID,
    PutStatus.MALFORMED_BATCH: ErrorCode.MALFORMED_REQUEST,
    PutStatus.DISK_FULL: ErrorCode.DISK_FULL,
    PutStatus.IO_ERROR: ErrorCode.IO_ERROR,
    PutStatus.STORE_CLOSED: ErrorCode.SHUTTING_DOWN,
    PutStatus.FLUSH_DISK_TIMEOUT: ErrorCode.FLUSH_DISK_TIMEOUT,
    PutStatus.STORE_FAILED: ErrorCode.STORE_FAILED,
}


class Handlers:
    """Every request the broker serves, bound to one broker's :class:`BrokerContext`."""

    def __init__(self, context: BrokerContext) -> None:
        self.b = context
        self.store = context.store
        self.config = context.config
        # Pulls and look-ups read the disk in at most this many threads at once: a slow
        # read (a page fault, a busy disk) holds up the pulls that wait for a thread, never
        # the event loop that serves every connection.
        self._readers = ReadThreads(context.config.pull_read_threads)
        # The last produce request handed to the append lane: the lane appends in order,
        # so once it is done every earlier one is too (a dedup check waits for it: the
        # first try of a retried batch may still be waiting in the lane).
        self._last_put: PendingPut | None = None

    def table(self) -> dict[int, Handler]:
        """Every request code's handler, each behind :func:`checked`."""
        log_reads = LogReads(self.b, self._readers)
        handlers: dict[int, Handler] = {
            RequestCode.SEND_MESSAGE: self.send_message,
            RequestCode.PULL_MESSAGE: self.pull_message,
            RequestCode.PULL_MESSAGES: Fetch(self.b, self._readers).handle,
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
            RequestCode.CREATE_TOPIC: self.create_topic,
            RequestCode.DELETE_TOPIC: self.delete_topic,
            RequestCode.LIST_TOPICS: self.list_topics,
            RequestCode.DESCRIBE_TOPIC: self.describe_topic,
            RequestCode.BROKER_INFO: self.broker_info,
            RequestCode.GET_LOG_LAYOUT: log_reads.layout,
            RequestCode.READ_LOG: log_reads.read,
        }
        return {code: checked(handler) for code, handler in handlers.items()}

    # ------------------------------------------------------------------ produce
    async def send_message(self, frame: Frame, peer: Peer) -> Reply | Later:
        """Queued in arrival order (the ordered part); the reply follows once stored.
        A retry marked ``dedup`` that was in fact stored is answered with the offsets
        found, ``duplicate: true``, and not appended again (``_dedup``)."""
        topic = need(frame.fields, "topic", str)
        dedup = frame.fields.get("dedup", False)
        if type(dedup) is not bool:
            raise RequestError(ErrorCode.MALFORMED_REQUEST, f"field 'dedup' must be a boolean, got {dedup!r:.40}")
        if (refused := self._not_leader(topic)) is not None:
            return refused
        if dedup:
            found = await self._stored_before(topic, frame.body, peer)
            if found is not None:
                return Later(lambda: self._duplicate(topic, found))
            if (refused := self._not_leader(topic)) is not None:  # the leader may have moved meanwhile
                return refused
        try:
            put = self._last_put = self.b.lane.submit(topic, frame.body, (peer.host, peer.port))
        except BusyError as e:
            raise RequestError(ErrorCode.SYSTEM_BUSY, str(e)) from None
        return Later(lambda: self._stored(put))

    def _not_leader(self, topic: str) -> Reply | None:
        """The checks before a write (a follower, or too few replicas in sync: nothing
        written). NOT_LEADER names the leader in the field ``leader_addr`` too, so that
        a producer can retry there at once."""
        try:
            self.b.replica.check_sync_write(topic)
        except RequestError as e:
            if e.code != ErrorCode.NOT_LEADER:
                raise
            return Reply({"leader_addr": self.b.replica.leader_hint}, error_code=e.code, error_text=e.text)
        return None

    async def _stored_before(self, topic: str, body: bytes, peer: Peer) -> Stored | None:
        """Where a retried batch was stored by an earlier try, or None (append it)."""
        try:
            msgs = decode_batch(body, topic, (peer.host, peer.port))
        except BatchError:
            return None  # the append answers MALFORMED_REQUEST
        keys = [m.properties.get(UNIQ_KEY) for m in msgs]
        if not msgs or None in keys or len({m.queue_id for m in msgs}) != 1:
            return None  # without an id per message, or across queues: nothing to look for
        limits = DedupLimits.of(self.config)
        if not await self._log_visible(limits.catch_up_timeout_ms):
            raise RequestError(ErrorCode.SYSTEM_BUSY, f"dedup: the queues did not show the whole log within "
                                                      f"{limits.catch_up_timeout_ms} ms; retry")  # fmt: skip
        try:
            return await self._readers.run(find_stored, self.store, topic, msgs[0].queue_id,
                                           [str(k) for k in keys], limits, now_ms())  # fmt: skip
        except PartlyStored as e:
            raise RequestError(ErrorCode.INVALID_MESSAGE, str(e)) from None

    async def _log_visible(self, timeout_ms: int) -> bool:
        """Wait until every produce request accepted so far is appended (the lane keeps
        their order: the last one's end covers the others) and visible in its queue."""
        earlier = self._last_put
        if earlier is not None:
            with trio.move_on_after(timeout_ms / 1000):
                await earlier.done.wait()
            if not earlier.done.is_set():
                return False
        return await wait_visible(self.store, timeout_ms)

    async def _duplicate(self, topic: str, found: Stored) -> Reply:
        fields = {"queue_offsets": found.queue_offsets, "commitlog_offsets": found.commitlog_offsets,
                  "store_timestamp_ms": found.store_timestamp_ms, "duplicate": True}  # fmt: skip
        return await self._acknowledged(topic, fields, found.end_offset)

    async def _stored(self, put: PendingPut) -> Reply:
        await put.done.wait()
        result = put.result
        assert result is not None
        if not result.ok:
            raise RequestError(_PUT_ERRORS[result.status], result.error)
        fields = {"queue_offsets": result.queue_offsets, "commitlog_offsets": result.commitlog_offsets,
                  "store_timestamp_ms": result.store_timestamp_ms}  # fmt: skip
        return await self._acknowledged(put.topic, fields, result.end_offset)

    async def _acknowledged(self, topic: str, fields: dict[str, Any], end_offset: int) -> Reply:
        """The answer to a stored batch, once durable (sync flush) and held by the
        replicas (sync acks)."""
        sync = self.store.config.commitlog.flush_mode is FlushMode.SYNC
        durable = await self._await_durable(end_offset) if sync else self.store.durable_offset >= end_offset
        failure = self.store.failure
        if sync and not durable and failure is not None:  # the flush failed: not stored for sure
            raise RequestError(ErrorCode.STORE_FAILED, f"written but not made durable: {failure}")
        fields["durable"] = durable
        if sync and not durable:
            return Reply(fields, error_code=ErrorCode.FLUSH_DISK_TIMEOUT,
                         error_text=f"stored, but not fsynced within sync_flush_timeout_ms={self.config.sync_flush_timeout_ms}")  # fmt: skip
        problem = await self.b.replica.wait_held(topic, end_offset)  # sync acks: the replicas hold it
        if problem is not None:
            return Reply(fields, error_code=problem[0], error_text=problem[1])
        return Reply(fields)

    async def _await_durable(self, end_offset: int) -> bool:
        """Sync flush: wait for the group commit that covers ``end_offset``."""
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake() -> None:  # runs on the flusher thread
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self.store.on_durable(end_offset, wake)  # on failure: called at once (then store.failure is set)
        with trio.move_on_after(self.config.sync_flush_timeout_ms / 1000):
            await done.wait()
        return done.is_set() and self.store.failure is None and self.store.durable_offset >= end_offset

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
        fields = {"status": WIRE_STATUS[res.status].value, "next_offset": res.next_offset, "min_offset": res.min_offset,
                  "max_offset": res.max_offset, "count": res.count}  # fmt: skip
        if suggest_follower(self.b, res.max_offset - res.next_offset):  # far behind: read from a follower
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
        res = await self._readers.run(visibility.read_to_damage, topic, qid, offset, limit, tags,
                                      self.config.max_pull_bytes)  # fmt: skip
        if isinstance(res, CorruptRecordError):
            raise RequestError(ErrorCode.CORRUPT_DATA, f"{topic}/{qid} offset {offset}: {res}")
        return res

    async def _wait_for(self, topic: str, qid: int, offset: int, wait_ms: int) -> None:
        key = (topic, qid)
        with trio.move_on_after(wait_ms / 1000):
            while True:
                event = self.b.waiters.register(key)  # before the check: no lost wake-up
                try:
                    if self.store.max_offset(topic, qid) > offset:
                        return
                    await event.wait()
                finally:
                    self.b.waiters.unregister(key, event)

    def _no_queue(self, topic: str, qid: int) -> None:
        count = self.store.topics.queue_count(topic)
        if count is None:
            raise RequestError(ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}")
        raise RequestError(ErrorCode.INVALID_QUEUE_ID, f"queue id {qid} not in 0..{count - 1} of topic {topic!r}")

    # ------------------------------------------------------------------ offsets
    def _queue(self, f: dict[str, Any]) -> tuple[str, int]:
        topic, qid = need(f, "topic", str), need(f, "queue_id", int)
        if not self.store.queue_exists(topic, qid):
            self._no_queue(topic, qid)
        return topic, qid

    async def query_offsets(self, frame: Frame, peer: Peer) -> Reply:
        topic, qid = self._queue(frame.fields)
        lo = await self._readers.run(self.store.min_offset, topic, qid)
        return Reply({"min_offset": lo, "max_offset": self.store.max_offset(topic, qid)})

    async def search_offset(self, frame: Frame, peer: Peer) -> Reply:
        topic, qid = self._queue(frame.fields)
        ts = need(frame.fields, "timestamp_ms", int)
        found = await self._readers.run(self.store.offset_for_timestamp, topic, qid, ts)
        return Reply({"offset": found})

    async def commit_offset(self, frame: Frame, peer: Peer) -> Reply:
        """Many offsets of one group at once (a consumer of thousands of queues commits
        them in one request); queues that no longer exist are ignored."""
        group = need(frame.fields, "group", str)
        rows = need(frame.fields, "offsets", list)
        self.b.replica.check_writable()
        self.b.metadata.bump()
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[1], int)
                    and isinstance(row[2], int)):  # fmt: skip
                raise RequestError(ErrorCode.MALFORMED_REQUEST, "offsets must be [topic, queue_id, offset] lists")
        for topic, qid, offset in rows:
            if self.store.queue_exists(topic, qid):
                self.b.offsets.commit(group, topic, qid, offset)
        return Reply()

    async def query_queue_offsets(self, frame: Frame, peer: Peer) -> Reply:
        """For many queues at once: the group's committed offset (-1: none), min and
        max (a consumer given thousands of queues looks them up in a few requests)."""
        group = need(frame.fields, "group", str)
        rows: list[list[int] | None] = []
        for i, item in enumerate(need(frame.fields, "queues", list)):
            if not (type(item) is list and len(item) == 2 and type(item[0]) is str and type(item[1]) is int
                    and 0 <= item[1] <= MAX_QUEUE_ID):  # fmt: skip
                raise RequestError(ErrorCode.MALFORMED_REQUEST,
                                   f"field 'queues' row {i} must be [topic, queue_id], got {item!r:.80}")  # fmt: skip
            topic, qid = item
            if not self.store.queue_exists(topic, qid):
                rows.append(None)
                continue
            rows.append([self.b.offsets.query(group, topic, qid), *self.store.bounds(topic, qid)])
            if i % ROWS_PER_CHECKPOINT == ROWS_PER_CHECKPOINT - 1:
                await trio.lowlevel.checkpoint()
        return Reply({"offsets": rows})

    async def query_consumer_offset(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields
        group = need(f, "group", str)
        topic, qid = self._queue(f)
        return Reply({"offset": self.b.offsets.query(group, topic, qid)})

    # ------------------------------------------------------------------- groups
    async def heartbeat(self, frame: Frame, peer: Peer) -> Reply:
        client_id = need(frame.fields, "client_id", str)
        for g in need(frame.fields, "groups", list):
            if not isinstance(g, dict) or not isinstance(g.get("group"), str):
                raise RequestError(ErrorCode.MALFORMED_REQUEST, "groups must be maps with a 'group' name")
            if self.b.groups.heartbeat(client_id, g["group"], g.get("mode", "clustering"), g.get("topics", []), now_ms()):
                self.b.metadata.bump()
        return Reply()

    async def unregister_client(self, frame: Frame, peer: Peer) -> Reply:
        self.b.groups.leave(need(frame.fields, "client_id", str))
        return Reply()

    async def group_members(self, frame: Frame, peer: Peer) -> Reply:
        members = self.b.groups.members(need(frame.fields, "group", str))
        return Reply({"members": [m.client_id for m in members]})

    async def list_groups(self, frame: Frame, peer: Peer) -> Reply:
        return Reply({"groups": sorted(set(self.b.groups.groups()) | set(self.b.offsets.groups()))})

    async def describe_group(self, frame: Frame, peer: Peer) -> Reply:
        group = need(frame.fields, "group", str)
        rows = []
        for (topic, qid), committed in sorted(self.b.offsets.of_group(group).items()):
            if self.store.queue_exists(topic, qid):
                hi = self.store.max_offset(topic, qid)
                rows.append({"topic": topic, "queue_id": qid, "committed": committed, "max_offset": hi,
                             "lag": max(0, hi - committed)})  # fmt: skip
        members = [{"client_id": m.client_id, "mode": m.mode, "topics": m.topics} for m in self.b.groups.members(group)]
        return Reply({"queues": rows, "members": members})

    # ------------------------------------------------------------------- topics
    async def create_topic(self, frame: Frame, peer: Peer) -> Reply:
        topic, count = need(frame.fields, "topic", str), need(frame.fields, "queue_count", int)
        self.b.replica.check_writable()
        try:
            await trio.to_thread.run_sync(self.store.create_topic, topic, count)
        except ValueError as e:
            raise RequestError(ErrorCode.INVALID_TOPIC, str(e)) from None
        self.b.metadata.bump_topics()
        self.b.register_now()
        return Reply({"queue_count": self.store.topics.queue_count(topic)})

    async def delete_topic(self, frame: Frame, peer: Peer) -> Reply:
        topic = need(frame.fields, "topic", str)
        self.b.replica.check_writable()
        if not await trio.to_thread.run_sync(self.store.delete_topic, topic):
            raise RequestError(ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}")
        self.b.offsets.drop_topic(topic)
        self.b.metadata.bump_topics()
        self.b.register_now()
        return Reply()

    async def list_topics(self, frame: Frame, peer: Peer) -> Reply:
        return Reply({"topics": self.store.topics.all()})

    async def describe_topic(self, frame: Frame, peer: Peer) -> Reply:
        topic = need(frame.fields, "topic", str)
        count = self.store.topics.queue_count(topic)
        if count is None:
            raise RequestError(ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}")

        def offsets() -> list[dict[str, int]]:
            return [{"queue_id": q, "min_offset": self.store.min_offset(topic, q), "max_offset": self.store.max_offset(topic, q)}
                    for q in range(count)]  # fmt: skip

        return Reply({"queue_count": count, "queues": await self._readers.run(offsets)})

    async def broker_info(self, frame: Frame, peer: Peer) -> Reply:
        c = self.config
        return Reply({"broker_name": c.broker_name, "cluster": c.cluster, "addr": self.b.addr(),
                      "storage_mode": c.storage_mode, "flush_mode": c.flush_mode, "end_offset": self.store.end_offset,
                      "durable_offset": self.store.durable_offset, "dispatch_lag_bytes": self.store.dispatch_lag_bytes,
                      "connections": self.b.connections(), "topics": len(self.store.topics.all()),
                      "healthy": self.store.failure is None, "failure": health_text(self.store),
                      "broker_id": c.broker_id, "role": self.b.replica.role, "epoch": self.b.replica.epoch})  # fmt: skip


def health_text(store: StorageEngine) -> str:
    """Why the store is unhealthy ("" if it is), as the broker reports it."""
    return "" if store.failure is None else str(store.failure)


def registration(context: BrokerContext) -> dict[str, Any]:
    """The fields of the broker's REGISTER_BROKER: its topics and its health (a broker
    whose store failed registers ``healthy: false`` and why: name servers keep it in the
    routes, marked, so that producers skip it and consumers still read it)."""
    c, store = context.config, context.store
    return {"cluster": c.cluster, "broker_name": c.broker_name, "addr": context.addr(), "topics": store.topics.all(),
            "healthy": store.failure is None, "failure": health_text(store), "broker_id": c.broker_id,
            "role": context.replica.role, "epoch": context.replica.epoch}  # fmt: skip
