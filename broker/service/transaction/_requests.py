"""The requests of transactional messages: half messages checked at the door
(SEND_MESSAGE to ``%TRANS_HALF%``), END_TRANSACTION, CHECK_TRANSACTIONS (long-polled
per group) and LIST_TRANSACTIONS (protocol/_codes.py has the wire contract)."""

from __future__ import annotations

import struct
from typing import Any, Awaitable, Callable

import trio

from clmq.broker.store import PutResult, Store
from clmq.common import (
    MAX_TAGS_BYTES,
    PROP_CANCEL_OF,
    PROP_DELIVER_AT,
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    PROP_TIMER_SRC,
    PROP_TRAN_GROUP,
    PROP_TRAN_HALF,
    TRANS_HALF_TOPIC,
    TRANS_OP_CHECK,
    TRANS_OP_COMMIT,
    TRANS_OP_ROLLBACK,
    TRANS_OP_TOPIC,
    CorruptRecordError,
    PackError,
    Record,
    decode_properties,
    is_system_topic,
    packed_heads,
)
from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.auth import Operation, ResourceType
from clmq.protocol.transport import Handler, Peer, Reply, RequestError, need

from .._context import BrokerContext
from .._dedup import UNIQ_KEY, wait_visible
from .._system_put import ensure_topic
from ._ending import EndAppends, acknowledged, committed_message, op_record, store_together
from ._pending import Ended, Half, PendingSet
from ._polls import wall_ms
from ._service import Transactions
from ._state import HALF_QUEUE, HALF_QUEUES, OP_QUEUES, queue_number
from ._traces import trace_end

CHECK_DEFAULT_MESSAGES = 32  # a CHECK_TRANSACTIONS without max_messages gets at most this many
CHECK_MAX_MESSAGES = 1000  # ... and never more than this
CHECK_MAX_WAIT_MS = 30_000  # a poll waits at most this long
LIST_DEFAULT_MESSAGES = 100  # a LIST_TRANSACTIONS without max_messages lists this many
INLINE_READ_DISTANCE_BYTES = 64 << 20  # an END reads a half this close to the log's end without a thread
END_DISPATCH_WAIT_MS = 1000  # an END of a half just stored waits at most this long for its queue entry
_DISPATCH_POLL_S = 0.002
LIST_CATCH_UP_MS = 1000  # a list waits at most this long for the queues to show what was stored before it
_FORBIDDEN = (PROP_TRAN_HALF, PROP_DELIVER_AT, PROP_TIMER_SRC, PROP_CANCEL_OF)  # marks a half may not carry


class TransactionRequests:
    """The handlers of END_TRANSACTION, CHECK_TRANSACTIONS and LIST_TRANSACTIONS, and the
    door of ``%TRANS_HALF%`` / ``%TRANS_OP%`` (:meth:`check_send`), over the leader's
    :class:`Transactions`; ``appends`` joins the ENDs in flight into one store call."""

    def __init__(self, ctx: BrokerContext, service: Transactions) -> None:
        self.ctx, self.service = ctx, service
        self.appends = EndAppends(ctx)  # the ENDs in flight appended together

    def handlers(self) -> dict[int, Handler]:
        """The request code -> handler table the broker registers."""
        return {
            RequestCode.END_TRANSACTION: self._naming_leader(self.end_transaction),
            RequestCode.CHECK_TRANSACTIONS: self._naming_leader(self.check_transactions),
            RequestCode.LIST_TRANSACTIONS: self._naming_leader(self.list_transactions),
        }

    def _naming_leader(self, handler: Callable[[Frame, Peer], Awaitable[Reply]]) -> Handler:
        """NOT_LEADER answers carry ``leader_addr`` when it is known (as SEND_MESSAGE's
        do): the producer goes to the leader at once."""

        async def handle(frame: Frame, peer: Peer) -> Reply:
            try:
                return await handler(frame, peer)
            except RequestError as e:
                if e.code != ErrorCode.NOT_LEADER:
                    raise
                return Reply({"leader_addr": self.ctx.replica.leader_hint}, error_code=e.code, error_text=e.text)

        return handle

    def _store(self) -> Store:
        store = self.ctx.store
        if not isinstance(store, Store):
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                f"transactional messages live in the CommitLog: this broker runs {self.ctx.config.storage_mode}",
            )
        return store

    # ------------------------------------------------------------- the door
    async def check_send(self, topic: str, body: bytes, peer: Peer) -> None:
        """Refuse a batch for ``%TRANS_HALF%`` unless every message is a well-formed half
        message for an existing queue of a user topic the peer may WRITE; refuse any
        batch for ``%TRANS_OP%`` (the broker's own records)."""
        self._store()
        if topic == TRANS_OP_TOPIC:
            raise RequestError(ErrorCode.INVALID_TOPIC, f"{TRANS_OP_TOPIC} is written by the broker only")
        try:
            heads = packed_heads(body)
        except PackError as e:
            raise RequestError(ErrorCode.MALFORMED_REQUEST, str(e)) from None
        halves = self.service.halves
        limit = self.ctx.config.transaction_max_pending
        if halves is not None and len(halves.pending) + len(heads) > limit:
            raise RequestError(
                ErrorCode.SYSTEM_BUSY,
                f"{len(halves.pending)} half messages pending: transaction_max_pending={limit}; retry later",
            )
        checked: set[tuple[str, str]] = set()
        groups: set[str] = set()
        for i, (qid, _tags, raw) in enumerate(heads):
            props = _decode(i, raw)
            check_half(i, qid, props)
            target = (props[PROP_REAL_TOPIC], props[PROP_REAL_QID])
            if target not in checked:
                self._check_target(i, *target)
                self.ctx.security.check(
                    peer, [(Operation.WRITE, ResourceType.TOPIC, target[0])], "SEND_MESSAGE (transactional)"
                )
                checked.add(target)
            if props[PROP_TRAN_GROUP] not in groups:  # the producer group is a transactional id
                need_id = (Operation.WRITE, ResourceType.TRANSACTIONAL_ID, props[PROP_TRAN_GROUP])
                self.ctx.security.check(peer, [need_id], "SEND_MESSAGE (transactional)")
                groups.add(props[PROP_TRAN_GROUP])
        await ensure_topic(self.ctx, TRANS_HALF_TOPIC, HALF_QUEUES)
        await ensure_topic(self.ctx, TRANS_OP_TOPIC, OP_QUEUES)

    def _check_target(self, i: int, topic: str, qid: str) -> None:
        count = self.ctx.store.topics.queue_count(topic)
        if count is None:
            raise RequestError(
                ErrorCode.TOPIC_NOT_FOUND,
                f"message {i}: topic {topic!r} does not exist on {self.ctx.config.broker_name}",
            )
        number = queue_number(qid)
        if number is None or number >= count:
            raise RequestError(
                ErrorCode.INVALID_QUEUE_ID, f"message {i}: queue {qid!r} not in 0..{count - 1} of {topic!r}"
            )

    # ------------------------------------------------------------- END_TRANSACTION
    async def end_transaction(self, frame: Frame, peer: Peer) -> Reply:
        """Commit (the real message and its op record in one append) or roll back (an op
        record); exactly once: a second END answers already_committed/already_rolled_back."""
        group = need(frame.fields, "group", str)
        offset = need(frame.fields, "commitlog_offset", int)
        commit = need(frame.fields, "action", str) == "commit"
        half, record = await self._pending_half(self._store(), offset, group, peer)
        if record is not None and half is not None:
            self.ctx.security.check(peer, [(Operation.WRITE, ResourceType.TOPIC, half.topic)], "END_TRANSACTION")
            if commit:
                self._door_again(record)
        stored: list[PutResult] = []

        async def append() -> PutResult:
            if record is None:  # it was read into the pending set meanwhile: the next try finds it
                raise RequestError(ErrorCode.SYSTEM_BUSY, f"the half message at {offset} is being read: retry")
            msgs = [committed_message(record), op_record(TRANS_OP_COMMIT, offset)] if commit else []
            result = await self.appends.store(msgs or [op_record(TRANS_OP_ROLLBACK, offset)])
            stored.append(result)
            return result

        real_qid = int(record.properties[PROP_REAL_QID]) if commit and record is not None else None
        ended = await self.service.end(offset, append, real_qid)
        if stored and half is not None:  # this END ended it (not already_*): traced
            trace_end(self.ctx, half, record, ended)
        fields: dict[str, Any] = {"state": ended.state}
        if ended.commitlog_offset >= 0:
            fields.update(
                msg_id=self.service.msg_id(ended.commitlog_offset),
                queue_id=ended.queue_id,
                queue_offset=ended.queue_offset,
            )
        if stored:  # answered once durable and held, as a produce is
            topics = [TRANS_OP_TOPIC] + ([half.topic] if commit and half is not None else [])
            await acknowledged(self.ctx, topics, stored[0])
        return Reply(fields)

    async def _pending_half(
        self, store: Store, offset: int, group: str, peer: Peer
    ) -> tuple[Half | None, Record | None]:
        """The pending half at ``offset`` and its record; (None, None) if it is not
        pending (ended, or never one: :meth:`Transactions.end` answers which). Only an
        offset the ``%TRANS_HALF%`` queue itself names is a half: one past what the
        queue has been read to is looked up there (the dispatcher waited for), never
        taken from whatever record the log holds at that offset. Another group's half,
        pending or ended, is NOT_FOUND."""
        halves = self.service.running_halves()
        if offset not in halves.pending and offset not in halves.ended and offset >= halves.read_to:
            await self._read_queue_past(store, offset)
            halves = self.service.running_halves()
        half = halves.pending.get(offset)
        if half is None:
            ended = halves.ended.get(offset)
            if ended is not None:
                await self._check_ended(store, offset, ended, group, peer)
            return None, None
        if half.group != group:
            raise RequestError(ErrorCode.NOT_FOUND, f"the half message at {offset} is not of group {group!r}")
        record = await self._read(store, offset, half.size)
        if record is None:
            raise RequestError(ErrorCode.CORRUPT_DATA, f"the half message at CommitLog offset {offset} cannot be read")
        return half, record

    async def _read_queue_past(self, store: Store, offset: int) -> None:
        """Read the half queue's entries up to ``offset`` into the pending set (SYSTEM_BUSY,
        retryable, if the dispatcher has not passed it within ``END_DISPATCH_WAIT_MS``)."""
        if offset >= store.log.write_offset:
            return  # no record starts there: Transactions.end answers NOT_FOUND
        interval = _DISPATCH_POLL_S
        with trio.move_on_after(END_DISPATCH_WAIT_MS / 1000):
            while store.dispatcher.dispatched_offset <= offset:
                await trio.sleep(interval)
                interval = min(2 * interval, 0.05)
        if store.dispatcher.dispatched_offset <= offset:
            raise RequestError(ErrorCode.SYSTEM_BUSY, f"the record at {offset} is not yet in its queue: retry")
        await self.service.refresh()

    async def _check_ended(self, store: Store, offset: int, ended: Ended, group: str, peer: Peer) -> None:
        """An ended half is answered (already_*) to its own group only, and only to a
        peer that may WRITE its real topic; its group read from its record if unknown."""
        if not ended.group:
            record = await self._read(store, offset)
            if record is None or record.topic != TRANS_HALF_TOPIC:
                raise RequestError(ErrorCode.NOT_FOUND, f"no half message at CommitLog offset {offset}")
            ended.group = record.properties.get(PROP_TRAN_GROUP, "")
            ended.topic = record.properties.get(PROP_REAL_TOPIC, "")
        if ended.group != group:
            raise RequestError(ErrorCode.NOT_FOUND, f"the half message at {offset} is not of group {group!r}")
        self.ctx.security.check(peer, [(Operation.WRITE, ResourceType.TOPIC, ended.topic)], "END_TRANSACTION")

    def _door_again(self, record: Record) -> None:
        """The door's checks, on the stored half before it is committed (a record that
        reached the half queue some other way commits nothing it could not send)."""
        props = record.properties
        check_half(0, record.queue_id, props)
        self._check_target(0, props[PROP_REAL_TOPIC], props[PROP_REAL_QID])

    async def _read(self, store: Store, offset: int, size: int | None = None) -> Record | None:
        """The record at ``offset`` (None: none starts there). A half stored within
        ``INLINE_READ_DISTANCE_BYTES`` of the log's end is read on the event loop (its
        pages are in the cache: a thread hand-over would cost more than the read);
        an older one in a worker thread."""
        try:
            if store.log.write_offset - offset <= INLINE_READ_DISTANCE_BYTES:
                return store.log.read_record(offset, size)
            return await trio.to_thread.run_sync(store.log.read_record, offset, size)
        except CorruptRecordError:  # a made-up offset is no record
            return None

    # ------------------------------------------------------------- CHECK_TRANSACTIONS
    async def check_transactions(self, frame: Frame, peer: Peer) -> Reply:
        """The group's half messages due for a check (long-polled up to max_wait_ms),
        each counted by a check op record before it is answered."""
        group = need(frame.fields, "group", str)
        limit = min(int(frame.fields.get("max_messages") or CHECK_DEFAULT_MESSAGES), CHECK_MAX_MESSAGES)
        wait_s = min(int(frame.fields.get("max_wait_ms") or 0), CHECK_MAX_WAIT_MS) / 1000
        store = self._store()
        self.service.running_halves()
        self.service.polls.polled(group)  # a producer of the group is alive: its halves are asked, not counted
        await self.service.refresh()
        try:
            due = await self._wait_due(group, peer, limit, wait_s)
        finally:
            self.service.polls.polled(group)
        if not due:
            return Reply({"checks": []})
        halves = self.service.running_halves()
        halves.asked(due, wall_ms())  # taken now: another poller of the group is not asked the same
        try:  # counted durably before asked: counts survive a crash and a fail-over
            await store_together(self.ctx, [op_record(TRANS_OP_CHECK, h.offset) for h in due])
        except RequestError:
            for half in due:  # not asked after all: due again at once
                half.last_check_ms = 0
                halves.make_ready(half, wall_ms())
            raise
        for half in due:
            half.checks += 1
        self.service.running_halves().stats.checks += len(due)
        body = await trio.to_thread.run_sync(_raw_records, store, due)
        return Reply({"checks": [[h.offset, h.checks] for h in due]}, body=body)

    async def _wait_due(self, group: str, peer: Peer, limit: int, wait_s: float) -> list[Half]:
        """The group's halves due now, or the first due within ``wait_s`` (the checker
        wakes the group's polls); [] if none."""
        waiters = self.service.waiters
        with trio.move_on_after(wait_s):
            while True:
                due = self._due(self.service.running_halves(), group, peer, limit)
                if due:
                    return due
                event = trio.Event()
                waiters.setdefault(group, []).append(event)
                try:
                    await event.wait()
                finally:
                    if event in waiters.get(group, []):
                        waiters[group].remove(event)
                        if not waiters[group]:
                            del waiters[group]
        return []

    def _due(self, halves: PendingSet, group: str, peer: Peer, limit: int) -> list[Half]:
        config, access = self.ctx.config, self.ctx.security.access
        out = []
        for half in halves.ready_of(group):
            if half.offset in self.service.ending or half.checks >= config.transaction_check_max:
                continue  # being ended; or the checker decides (transaction_unresolved)
            if access.enabled and access.refusal(
                peer, [(Operation.WRITE, ResourceType.TOPIC, half.topic)], "CHECK_TRANSACTIONS"
            ):
                continue
            out.append(half)
            if len(out) >= limit:
                break
        return out

    # ------------------------------------------------------------- LIST_TRANSACTIONS
    async def list_transactions(self, frame: Frame, peer: Peer) -> Reply:
        """The pending half messages (of ``group``, or every group), at most ``max_messages``
        rows (commit-log offset, group, real topic and queue, keys, UNIQ_KEY, times, checks),
        with the total pending and the counts since this leader started."""
        group = frame.fields.get("group") or None
        limit = int(frame.fields.get("max_messages") or LIST_DEFAULT_MESSAGES)
        store = self._store()
        halves = self.service.running_halves()
        await wait_visible(store, LIST_CATCH_UP_MS)  # the half messages stored before this request: listed
        await self.service.refresh()
        mine = halves.of_group(group)
        rows = await trio.to_thread.run_sync(_rows, store, mine[:limit])
        s = halves.stats
        return Reply(
            {
                "pending": rows,
                "total": len(mine),
                "committed": s.committed,
                "rolled_back": s.rolled_back,
                "checks": s.checks,
            }
        )


def check_half(i: int, qid: int, props: dict[str, str]) -> None:
    """Refuse message ``i`` of a batch unless it is a well-formed half message (its
    real topic's existence and queue range are checked against the store apart)."""
    missing = [k for k in (PROP_REAL_TOPIC, PROP_REAL_QID, PROP_REAL_TAGS, PROP_TRAN_GROUP) if not props.get(k)]
    missing = [k for k in missing if k != PROP_REAL_TAGS or k not in props]  # empty tags are tags
    if qid != HALF_QUEUE or missing:
        raise RequestError(
            ErrorCode.INVALID_MESSAGE,
            f"message {i}: not a half message (queue {HALF_QUEUE}, {PROP_REAL_TOPIC}, {PROP_REAL_QID}, "
            f"{PROP_REAL_TAGS}, {PROP_TRAN_GROUP}): queue {qid}, missing {missing}",
        )
    forged = [k for k in _FORBIDDEN if k in props]
    if forged:
        raise RequestError(ErrorCode.INVALID_MESSAGE, f"message {i}: a half message cannot carry {forged}")
    if len(props[PROP_REAL_TAGS].encode()) > MAX_TAGS_BYTES:
        raise RequestError(
            ErrorCode.INVALID_MESSAGE, f"message {i}: {PROP_REAL_TAGS} longer than {MAX_TAGS_BYTES} bytes"
        )
    if is_system_topic(props[PROP_REAL_TOPIC]):
        raise RequestError(ErrorCode.INVALID_MESSAGE, f"message {i}: {props[PROP_REAL_TOPIC]!r} is a system topic")


def _decode(i: int, raw: bytes) -> dict[str, str]:
    try:
        return decode_properties(raw)
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise RequestError(ErrorCode.MALFORMED_REQUEST, f"message {i}: undecodable properties: {e}") from None


def _raw_records(store: Store, due: list[Half]) -> bytes:
    return b"".join(store.log.read_bytes(h.offset, h.size) or b"" for h in due)


def _rows(store: Store, halves: list[Half]) -> list[dict[str, Any]]:
    rows = []
    for h in halves:
        try:
            record = store.log.read_record(h.offset, h.size)
        except CorruptRecordError:
            record = None
        rows.append(
            {
                "commitlog_offset": h.offset,
                "group": h.group,
                "topic": h.topic,
                "queue_id": h.queue_id,
                "keys": record.keys if record is not None else "",
                "uniq_key": record.properties.get(UNIQ_KEY, "") if record is not None else "",
                "stored_ms": h.stored_ms,
                "checks": h.checks,
                "last_check_ms": h.last_check_ms,
            }
        )
    return rows
