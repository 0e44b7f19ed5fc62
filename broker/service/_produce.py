"""The produce path: SEND_MESSAGE through the append lane, the answer once the batch
is durable (sync flush) and held by the replicas (sync acks), and retries marked
``dedup`` answered with the copy an earlier try stored (``_dedup``)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import trio

from clmq.broker.store import PutResult, PutStatus
from clmq.common import TIMER_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_TOPIC, Message
from clmq.protocol import BatchError, ErrorCode, Frame, decode_batch, encode_batch
from clmq.protocol.auth import Operation, ResourceType
from clmq.protocol.transport import Later, Peer, Reply, RequestError, need

from ._append import BusyError, PendingPut
from ._context import BrokerContext, now_ms
from ._dedup import UNIQ_KEY, DedupLimits, Found, PartlyStored, find_stored_queues, place, wait_visible
from ._fetch import ReadThreads
from ._scheduled import ScheduledRequests
from .transaction import refuse_tran_half

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


class Produce:
    """SEND_MESSAGE for one broker."""

    def __init__(
        self,
        ctx: BrokerContext,
        readers: ReadThreads,
        scheduled: ScheduledRequests,
        half_door: Callable[[str, bytes, Peer], Awaitable[None]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.scheduled = scheduled
        self.half_door = half_door  # transactions' check of %TRANS_HALF% and %TRANS_OP% batches
        self.store = ctx.store
        self.config = ctx.config
        self._readers = readers
        self._acks_wait_for_fsync = ctx.store.config.commitlog.acks_wait_for_fsync  # (a frozen config)
        # The last produce request handed to the append lane: the lane appends in order,
        # so once it is done every earlier one is too (a dedup check waits for it: the
        # first try of a retried batch may still be waiting in the lane).
        self._last_put: PendingPut | None = None

    async def send_message(self, frame: Frame, peer: Peer) -> Reply | Later:
        """Queued in arrival order (the ordered part); the reply follows once stored.
        A retry marked ``dedup`` that was in fact stored is answered with the offsets
        found, ``duplicate: true``, and not appended again; one stored in part is
        completed (``_dedup``)."""
        topic = need(frame.fields, "topic", str)
        dedup = frame.fields.get("dedup", False)
        if type(dedup) is not bool:
            raise RequestError(ErrorCode.MALFORMED_REQUEST, f"field 'dedup' must be a boolean, got {dedup!r:.40}")
        await self.ctx.replica.writes_settled()  # a graceful hand-over under way: held, then answered
        if (refused := self._not_leader(topic)) is not None:
            return refused
        await self._check_kind(topic, frame.body, peer)
        body, part = frame.body, None
        if dedup:
            found = await self._stored_before(topic, body, peer)
            if found is not None and not found[1].missing:
                return Later(lambda: self._duplicate(topic, found[1]))
            if (refused := self._not_leader(topic)) is not None:  # the leader may have moved meanwhile
                return refused
            if found is not None:  # found in part: the rest is appended
                body, part = encode_batch([found[0][i] for i in found[1].missing]), found[1]
        try:
            put = self._last_put = self.ctx.lane.submit(topic, body, (peer.host, peer.port))
        except BusyError as e:
            raise RequestError(ErrorCode.SYSTEM_BUSY, str(e)) from None
        put.add_done_callback(self._count)
        if part is not None:
            return Later(lambda: self._completed(put, part))
        return Later(
            lambda: self._stored(put),
            subscribe=lambda deliver: put.add_done_callback(lambda p: self._answer_now(p, deliver)),
        )

    async def _check_kind(self, topic: str, body: bytes, peer: Peer) -> None:
        """The checks of special topics' batches, and of a creation by auto-create."""
        if topic not in (TRANS_HALF_TOPIC, TRANS_OP_TOPIC):  # (their door refuses it too)
            refuse_tran_half(body)  # TRAN_HALF marks a committed half's copy: set by the broker alone
        if topic == TIMER_TOPIC:  # scheduled messages: checked before the timer trusts them
            await self.scheduled.check_send(body, peer)
        elif topic in (TRANS_HALF_TOPIC, TRANS_OP_TOPIC) and self.half_door is not None:
            await self.half_door(topic, body, peer)  # half messages: checked before transactions trust them
        elif self.ctx.config.auto_create_topics and self.store.topics.queue_count(topic) is None:
            # a creation, which needs CREATE (on the topic or the cluster)
            self.ctx.security.check(peer, [(Operation.CREATE, ResourceType.TOPIC, topic)], "SEND_MESSAGE (auto-create)")
            await self._auto_create(topic)

    async def _auto_create(self, topic: str) -> None:
        """Create ``topic`` before its first message is appended, as CREATE_TOPIC does:
        the followers hold it before the message is acknowledged (the store would create
        it on the append too, but nobody would hear of it). A name the store refuses is
        left to the append, which answers INVALID_TOPIC."""
        try:
            await trio.to_thread.run_sync(self.store.create_topic, topic, self.config.default_queue_count)
        except ValueError:
            return
        await self.ctx.topic_changed(topic)

    def _count(self, put: PendingPut) -> None:
        result = put.result
        if result is not None and result.ok:
            self.ctx.traffic.add_in(put.topic, len(result.queue_offsets), len(put.body))

    def _answer_now(self, put: PendingPut, deliver: Callable[[Reply | None], None]) -> None:
        """Answer a stored put without a task when nothing is to wait for but the group
        commit (sync flush: :meth:`DurableWaiters.call_when_durable`): acknowledged
        without replicas to wait for, stored without error. Else ``deliver(None)``: the
        connection awaits ``_stored`` (sync acks, errors)."""
        result = put.result
        if result is None or not result.ok or not self.ctx.replica.acks_at_once(put.topic):
            deliver(None)
            return
        fields = {
            "queue_offsets": result.queue_offsets,
            "commitlog_offsets": result.commitlog_offsets,
            "store_timestamp_ms": result.store_timestamp_ms,
        }
        if not self._acks_wait_for_fsync:
            fields["durable"] = self.store.durable_offset >= result.end_offset
            deliver(Reply(fields))
            return

        def flushed(durable: bool) -> None:
            if durable and not self.ctx.replica.acks_at_once(put.topic):  # the role changed meanwhile
                deliver(None)  # _stored: durable at once, then wait_held decides
            else:
                deliver(self._flush_failed(fields, durable) or Reply(fields))

        self.ctx.lane.durable.call_when_durable(result.end_offset, self.config.sync_flush_timeout_ms / 1000, flushed)

    def _not_leader(self, topic: str) -> Reply | None:
        """The checks before a write (a follower, or too few replicas in sync: nothing
        written). NOT_LEADER names the leader in the field ``leader_addr`` too, so that
        a producer can retry there at once."""
        try:
            self.ctx.replica.check_sync_write(topic)
        except RequestError as e:
            if e.code != ErrorCode.NOT_LEADER:
                raise
            return Reply({"leader_addr": self.ctx.replica.leader_hint}, error_code=e.code, error_text=e.text)
        return None

    async def _stored_before(self, topic: str, body: bytes, peer: Peer) -> tuple[list[Message], Found] | None:
        """The request's messages and where an earlier try stored them (whole or in
        part: ``_dedup``), or None (append it all)."""
        try:
            msgs = decode_batch(body, topic, (peer.host, peer.port))
        except BatchError:
            return None  # the append answers MALFORMED_REQUEST
        keys = [m.properties.get(UNIQ_KEY) for m in msgs]
        if not msgs or None in keys:
            return None  # without an id per message: nothing to look for
        queue_ids = [m.queue_id for m in msgs]
        keys_by_queue: dict[int, list[str]] = {}
        for qid, key in zip(queue_ids, keys):
            keys_by_queue.setdefault(qid, []).append(str(key))
        limits = DedupLimits.of(self.config)
        if not await self._log_visible(limits.catch_up_timeout_ms):
            raise RequestError(
                ErrorCode.SYSTEM_BUSY,
                f"dedup: the queues did not show the whole log within {limits.catch_up_timeout_ms} ms; retry",
            )
        try:
            found = await self._readers.in_thread(
                find_stored_queues, self.store, topic, keys_by_queue, limits, now_ms()
            )
        except PartlyStored as e:
            raise RequestError(ErrorCode.INVALID_MESSAGE, str(e)) from None
        where = place(queue_ids, found)
        return None if where is None else (msgs, where)

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

    async def _duplicate(self, topic: str, found: Found) -> Reply:
        qoffs, coffs = found.offsets()
        fields = {
            "queue_offsets": qoffs,
            "commitlog_offsets": coffs,
            "store_timestamp_ms": found.store_timestamp_ms,
            "duplicate": True,
        }
        return await self._acknowledged(topic, fields, found.end_offset)

    async def _completed(self, put: PendingPut, found: Found) -> Reply:
        """The answer to a retried batch found in part, once the rest is appended: every
        message's offsets in request order, and how many had been stored before."""
        result = await _appended(put)
        qoffs, coffs = found.offsets((result.queue_offsets, result.commitlog_offsets))
        fields = {
            "queue_offsets": qoffs,
            "commitlog_offsets": coffs,
            "store_timestamp_ms": found.store_timestamp_ms,
            "stored_before": len(found.places) - len(found.missing),
        }
        return await self._acknowledged(put.topic, fields, max(result.end_offset, found.end_offset))

    async def _stored(self, put: PendingPut) -> Reply:
        result = await _appended(put)
        fields = {
            "queue_offsets": result.queue_offsets,
            "commitlog_offsets": result.commitlog_offsets,
            "store_timestamp_ms": result.store_timestamp_ms,
        }
        return await self._acknowledged(put.topic, fields, result.end_offset)

    async def _acknowledged(self, topic: str, fields: dict[str, Any], end_offset: int) -> Reply:
        """The answer to a stored batch, once durable (sync flush) and held by the
        replicas (sync acks)."""
        if self.store.config.commitlog.acks_wait_for_fsync:
            if (failed := self._flush_failed(fields, await self._await_durable(end_offset))) is not None:
                return failed
        else:
            fields["durable"] = self.store.durable_offset >= end_offset
        problem = await self.ctx.replica.wait_held(topic, end_offset)  # sync acks: the replicas hold it
        if problem is not None:
            return Reply(fields, error_code=problem[0], error_text=problem[1])
        return Reply(fields)

    def _flush_failed(self, fields: dict[str, Any], durable: bool) -> Reply | None:
        """Sync flush, once waited for: the answer if not durable (the flush failed: not
        stored for sure; or not within sync_flush_timeout_ms), else None. Sets ``durable``."""
        fields["durable"] = durable
        if durable:
            return None
        failure = self.store.failure
        if failure is not None:
            return Reply(error_code=ErrorCode.STORE_FAILED, error_text=f"written but not made durable: {failure}")
        return Reply(
            fields,
            error_code=ErrorCode.FLUSH_DISK_TIMEOUT,
            error_text=f"stored, but not fsynced within sync_flush_timeout_ms={self.config.sync_flush_timeout_ms}",
        )

    async def _await_durable(self, end_offset: int) -> bool:
        """Sync flush: wait for the group commit that covers ``end_offset`` (woken with
        every other request it covers: ``AppendLane.durable``)."""
        return await self.ctx.lane.durable.wait(end_offset, self.config.sync_flush_timeout_ms / 1000)


async def _appended(put: PendingPut) -> PutResult:
    """The result of ``put`` once the lane appended it; its error as a RequestError."""
    await put.done.wait()
    result = put.result
    assert result is not None
    if not result.ok:
        raise RequestError(_PUT_ERRORS[result.status], result.error)
    return result
