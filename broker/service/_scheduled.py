"""Scheduled messages at the door: a SEND_MESSAGE to ``%TIMER%`` is checked before it
is stored (the timer trusts what it finds there), and CANCEL_MESSAGE."""

from __future__ import annotations

import struct

import trio

from clmq.broker.store import Store
from clmq.common import (
    MAX_TAGS_BYTES,
    PROP_CANCEL_OF,
    PROP_DELIVER_AT,
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    PROP_TIMER_SRC,
    TIMER_TOPIC,
    CorruptRecordError,
    Message,
    PackError,
    Record,
    check_properties,
    decode_properties,
    encode_properties,
    packed_heads,
    timer_tag,
)
from clmq.protocol import ErrorCode, Frame
from clmq.protocol.auth import Operation, ResourceType
from clmq.protocol.transport import Peer, Reply, RequestError, need

from ._context import BrokerContext
from ._system_put import ensure_topic, put_acknowledged
from .timer import CANCEL_QUEUE, SCHEDULED_QUEUE, TIMER_QUEUES, Timer, wall_ms


class ScheduledRequests:
    def __init__(self, ctx: BrokerContext, timer: Timer) -> None:
        self.ctx = ctx
        self.timer = timer

    def _store(self) -> Store:
        store = self.ctx.store
        if not isinstance(store, Store):
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                f"scheduled messages live in the CommitLog: this broker runs {self.ctx.config.storage_mode}",
            )
        return store

    async def check_send(self, body: bytes, peer: Peer) -> None:
        """Refuse a batch for ``%TIMER%`` unless every message is a well-formed
        scheduled message for an existing queue, due within ``timer_max_delay_ms``.
        Only the heads are read (queue id, tags, properties), not the bodies."""
        self._store()
        try:
            heads = packed_heads(body)
        except PackError as e:
            raise RequestError(ErrorCode.MALFORMED_REQUEST, str(e)) from None
        latest = wall_ms() + self.ctx.config.timer_max_delay_ms
        known: dict[tuple[str, str], None] = {}  # (topic, queue) already checked in this batch
        lead, lead_tags = b"", b""  # a checked prefix of properties (due, real topic and queue) and its tags
        for i, (qid, tags, raw) in enumerate(heads):
            # A producer's batch shares its due time and queue, encoded first (clmq's
            # producer does): checked once, each message then only for the rest.
            if lead and qid == SCHEDULED_QUEUE and tags == lead_tags and raw.startswith(lead):
                rest = raw[len(lead) :]
                _check(i, rest)  # well-formed; a routing key's name anywhere in it: the full check decides
                if (
                    len(rest) <= MAX_TAGS_BYTES
                    and _REAL_TAGS in rest
                    and not any(name in rest for name in _ROUTING_NAMES)
                ):
                    continue
            props = _decode(i, raw)
            self._check_one(i, qid, tags, props, latest)
            target = (props[PROP_REAL_TOPIC], props[PROP_REAL_QID])
            if target not in known:
                self._check_target(i, *target)
                self._check_access(peer, target[0])
                known[target] = None
            shared = encode_properties({k: props[k] for k in (PROP_DELIVER_AT, PROP_REAL_TOPIC, PROP_REAL_QID)})
            if raw.startswith(shared):
                lead, lead_tags = shared, tags
        if self.ctx.store.topics.queue_count(TIMER_TOPIC) is None:
            await ensure_topic(self.ctx, TIMER_TOPIC, TIMER_QUEUES)

    def _check_one(self, i: int, qid: int, tags: bytes, props: dict[str, str], latest: int) -> None:
        due = props.get(PROP_DELIVER_AT, "")
        if qid != SCHEDULED_QUEUE or not due.isdigit() or len(due) > 15 or tags != due.encode():
            raise RequestError(
                ErrorCode.INVALID_MESSAGE,
                f"message {i}: not a scheduled message (queue 0, {PROP_DELIVER_AT} digits, the same as its tags)",
            )
        if (
            not {PROP_REAL_TAGS, PROP_REAL_TOPIC, PROP_REAL_QID} <= props.keys()
            or PROP_CANCEL_OF in props
            or PROP_TIMER_SRC in props
        ):  # the broker's own marks: a forged one would hide a delivery
            raise RequestError(
                ErrorCode.INVALID_MESSAGE,
                f"message {i}: needs {PROP_REAL_TOPIC}, {PROP_REAL_QID} "
                f"and {PROP_REAL_TAGS}, no {PROP_CANCEL_OF} or {PROP_TIMER_SRC}",
            )
        if len(props[PROP_REAL_TAGS].encode()) > MAX_TAGS_BYTES:  # the delivered message's tags
            raise RequestError(
                ErrorCode.INVALID_MESSAGE, f"message {i}: {PROP_REAL_TAGS} longer than {MAX_TAGS_BYTES} bytes"
            )
        if int(due) > latest:
            raise RequestError(
                ErrorCode.INVALID_MESSAGE,
                f"message {i}: due at {due}, "
                f"later than timer_max_delay_ms={self.ctx.config.timer_max_delay_ms} from now",
            )

    def _check_access(self, peer: Peer, topic: str) -> None:
        """A scheduled message is a produce to its real topic: WRITE on it (the rule of
        SEND_MESSAGE leaves ``%TIMER%`` itself to this check)."""
        access = self.ctx.security.access
        if access.enabled:
            refused = access.refusal(peer, [(Operation.WRITE, ResourceType.TOPIC, topic)], "SEND_MESSAGE (scheduled)")
            if refused is not None:
                raise RequestError(ErrorCode.NOT_AUTHORIZED, refused.error_text)

    def _check_target(self, i: int, topic: str, qid: str) -> None:
        count = self.ctx.store.topics.queue_count(topic)
        if count is None:
            raise RequestError(
                ErrorCode.TOPIC_NOT_FOUND,
                f"message {i}: topic {topic!r} does not exist on {self.ctx.config.broker_name}",
            )
        if not qid.isdigit() or int(qid) >= count:
            raise RequestError(
                ErrorCode.INVALID_QUEUE_ID, f"message {i}: queue {qid!r} not in 0..{count - 1} of {topic!r}"
            )

    async def cancel(self, frame: Frame, peer: Peer) -> Reply:
        """CANCEL_MESSAGE: a marker in ``%TIMER%`` queue 1, due when its target is (the
        timer skips the target when its second comes)."""
        offset = need(frame.fields, "commitlog_offset", int)
        store = self._store()
        self.ctx.replica.check_writable()
        if not self.timer.running:  # what it delivered is known once it has started
            raise RequestError(ErrorCode.SYSTEM_BUSY, "the timer is starting (or recovering): retry")
        record = await trio.to_thread.run_sync(_scheduled_at, store, offset)
        due = int(record.properties[PROP_DELIVER_AT])
        if self.timer.is_cancelled(offset):
            return Reply({"state": "already_cancelled", "deliver_at_ms": due})
        # Against the clock and the timer's own progress (it may be ahead of its
        # schedule in a second, or have delivered a late message already).
        handled = max(wall_ms(), self.timer.handled_ms())
        if due <= handled + self.ctx.config.timer_cancel_margin_ms or self.timer.was_delivered(offset):
            return Reply({"state": "too_late", "deliver_at_ms": due})
        marker = Message(TIMER_TOPIC, CANCEL_QUEUE, b"", timer_tag(due), "", {PROP_CANCEL_OF: str(offset)})
        await put_acknowledged(self.ctx, [marker])  # "cancelled" must survive a crash and a fail-over
        return Reply({"state": "cancelled", "deliver_at_ms": due})


# Properties that route a scheduled message, or mark the broker's own records.
_ROUTING = frozenset({PROP_DELIVER_AT, PROP_REAL_TOPIC, PROP_REAL_QID, PROP_CANCEL_OF, PROP_TIMER_SRC})


_ROUTING_NAMES = tuple(name.encode() for name in _ROUTING)
_REAL_TAGS = PROP_REAL_TAGS.encode()  # the fast path's message must carry it too, as the full check requires


def _check(i: int, raw: bytes) -> None:
    try:
        check_properties(raw)
    except (ValueError, struct.error) as e:
        raise RequestError(ErrorCode.MALFORMED_REQUEST, f"message {i}: undecodable properties: {e}") from None


def _decode(i: int, raw: bytes) -> dict[str, str]:
    try:
        return decode_properties(raw)
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise RequestError(ErrorCode.MALFORMED_REQUEST, f"message {i}: undecodable properties: {e}") from None


def _scheduled_at(store: Store, offset: int) -> Record:
    try:
        record = store.log.read_record(offset)
    except CorruptRecordError as e:  # a made-up offset is no record
        raise RequestError(ErrorCode.NOT_FOUND, f"no message starts at CommitLog offset {offset}: {e}") from None
    if record is None or record.topic != TIMER_TOPIC or record.queue_id != SCHEDULED_QUEUE:
        raise RequestError(ErrorCode.NOT_FOUND, f"no scheduled message at CommitLog offset {offset}")
    return record
