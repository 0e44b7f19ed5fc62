"""The admin client's reads of messages: a queue read without a group, a message by
key; a group's retry backlog and dead letters, and dead letters sent again. (Changes
to consumer groups: ``_admin_groups``.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import trio

from clmq.common import (
    DLQ_PREFIX,
    PROP_CANCEL_OF,
    PROP_DELIVER_AT,
    PROP_DLQ_BODY_OF,
    PROP_DLQ_GROUP,
    PROP_ORIGIN_ADDR,
    PROP_ORIGIN_MSG_ID,
    PROP_ORIGIN_OFFSET,
    PROP_ORIGIN_QID,
    PROP_ORIGIN_TOPIC,
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    PROP_TIMER_SRC,
    PROP_TRAN_GROUP,
    PROP_TRAN_HALF,
    Message,
    Record,
    dlq_topic,
    retry_topic,
)
from clmq.protocol import ErrorCode, RequestCode, decode_records
from clmq.protocol.transport import ConnectionFailed, RpcError

from ._admin_calls import AdminCalls
from ._msg_id import format_msg_id, parse_msg_id
from ._routes import MessageQueue, NoRouteError
from ._trace import resent_event
from .producer import Producer, SendError, open_producer

KEY_SCAN_CHUNK_MESSAGES = 256  # one PULL_MESSAGE of a key lookup's scan
_SEND_ERRORS = (SendError, NoRouteError, ConnectionFailed, RpcError, trio.TooSlowError)


@dataclass
class KeyLookup:
    """What :meth:`Admin.messages_by_key` found: the messages, how many it read, and
    whether it read every message in the time range (``complete``) or stopped at its
    ``max_scan_messages`` (older messages then were not searched)."""

    records: list[Record]
    scanned: int
    complete: bool


async def pull(
    calls: AdminCalls, addr: str, topic: str, queue_id: int, offset: int, max_messages: int
) -> tuple[list[Record], int]:
    """One PULL_MESSAGE without a group: the records and the next offset."""
    fields = {"topic": topic, "queue_id": queue_id, "offset": offset, "max_messages": max_messages, "max_wait_ms": 0}
    reply = await calls.rpc.request(addr, RequestCode.PULL_MESSAGE, fields, timeout_ms=calls.timeout_ms)
    return decode_records(reply.body), int(reply.fields["next_offset"])


async def topic_leaders(calls: AdminCalls, topic: str, broker_name: str | None = None) -> list[dict[str, Any]]:
    """The group leaders that have ``topic`` (only ``broker_name``'s if given), each
    with its queues' offsets (``queues``)."""
    found = []
    for b in await calls.leaders():
        if broker_name is not None and b["broker_name"] != broker_name:
            continue
        try:
            info = await calls.call(b["addr"], RequestCode.DESCRIBE_TOPIC, {"topic": topic})
        except RpcError as e:
            if e.code == ErrorCode.TOPIC_NOT_FOUND:
                continue
            raise
        found.append({**b, "queues": info["queues"]})
    return found


async def describe_topic(calls: AdminCalls, topic: str) -> list[dict[str, Any]]:
    """Per queue of ``topic`` on every group leader that has it (see :meth:`Admin.describe_topic`)."""
    rows = []
    for b in await calls.leaders():
        try:
            info = await calls.call(b["addr"], RequestCode.DESCRIBE_TOPIC, {"topic": topic})
        except RpcError:
            continue
        rows += [{"broker_name": b["broker_name"], "addr": b["addr"], **q} for q in info["queues"]]
    return rows


async def scan_for_key(
    calls: AdminCalls,
    topic: str,
    key: str,
    *,
    max_messages: int,
    max_scan_messages: int,
    since_ms: int | None,
    until_ms: int | None,
) -> KeyLookup:
    """Read each queue's newest messages (from ``since_ms`` if given) for ``key``."""
    leaders = await topic_leaders(calls, topic)
    queues = [(b["addr"], q) for b in leaders for q in b["queues"]]
    budget = max_scan_messages // max(1, len(queues))
    out: list[Record] = []
    scanned, complete = 0, True
    for addr, q in queues:
        required = q["min_offset"]
        if since_ms is not None:
            found = await calls.call(
                addr, RequestCode.SEARCH_OFFSET, {"topic": topic, "queue_id": q["queue_id"], "timestamp_ms": since_ms}
            )
            required = max(required, int(found["offset"]))
        start = max(required, q["max_offset"] - budget)  # the newest messages within the budget
        complete = complete and start == required
        offset = start
        while offset < q["max_offset"]:
            records, offset = await pull(calls, addr, topic, q["queue_id"], offset, KEY_SCAN_CHUNK_MESSAGES)
            if not records:
                break
            scanned += len(records)
            out += [
                r for r in records if key in r.keys.split() and (until_ms is None or r.store_timestamp_ms <= until_ms)
            ]
    out.sort(key=lambda r: r.store_timestamp_ms, reverse=True)
    return KeyLookup(out[:max_messages], scanned, complete)


# ------------------------------------------------------------ retries and dead letters
RESENT_GROUP_PREFIX = "%DLQ_RESENT%"  # the reserved group whose committed DLQ offset marks what was resent
RESEND_READ_CHUNK_MESSAGES = 256  # one PULL_MESSAGE of a resend's read of a dead-letter queue
# Properties a resent message does not carry: where the dead letter came from, the
# timer's, and its old UNIQ_KEY (kept, a send after an unknown outcome could be taken
# for the original by the broker's duplicate check).
DROPPED_ON_RESEND = frozenset(
    {
        PROP_ORIGIN_TOPIC,
        PROP_ORIGIN_QID,
        PROP_ORIGIN_OFFSET,
        PROP_ORIGIN_MSG_ID,
        PROP_ORIGIN_ADDR,
        PROP_DLQ_GROUP,
        PROP_DELIVER_AT,
        PROP_REAL_TOPIC,
        PROP_REAL_QID,
        PROP_REAL_TAGS,
        PROP_TIMER_SRC,
        PROP_CANCEL_OF,
        PROP_DLQ_BODY_OF,
        PROP_TRAN_HALF,  # a resent committed message is no commit of its half (nor accepted at the door)
        PROP_TRAN_GROUP,
        "UNIQ_KEY",
    }
)


@dataclass
class CancelResult:
    """What :meth:`Admin.cancel_message` did: ``state`` "cancelled", "already_cancelled",
    "too_late" (delivered, or due within the broker's timer_cancel_margin_ms) or
    "not_found" (no scheduled message has that id); ``deliver_at_ms`` its due time (0 if
    not found)."""

    state: str
    deliver_at_ms: int


@dataclass
class DeadLetter:
    """One message of a group's dead-letter queue (``%DLQ%group``, queue 0) on the broker
    ``addr`` (group ``broker_name``); ``record.queue_offset`` is its place there."""

    addr: str
    broker_name: str
    record: Record

    @property
    def msg_id(self) -> str:
        return format_msg_id(self.addr, self.record.commitlog_offset)

    @property
    def origin_topic(self) -> str:
        return self.record.properties.get(PROP_ORIGIN_TOPIC, "")

    @property
    def origin_queue_id(self) -> int:
        return int(self.record.properties.get(PROP_ORIGIN_QID, "-1") or -1)

    @property
    def origin_offset(self) -> int:
        return int(self.record.properties.get(PROP_ORIGIN_OFFSET, "-1") or -1)


@dataclass
class ResentLetter:
    """One dead letter sent again: where it was (broker, DLQ offset) and its new id."""

    broker_name: str
    dlq_offset: int
    origin_topic: str
    msg_id: str


@dataclass
class ResendResult:
    """What :meth:`Admin.resend_dead_letters` did: the letters resent, those skipped as
    resent before (at or below a broker's resend mark; ``resend_all`` sends them
    anyway), and failures (``broker_name: reason``; that broker's mark stops before the
    first letter that failed)."""

    resent: list[ResentLetter]
    skipped: int
    errors: list[str]


def resent_group(group: str) -> str:
    """The reserved group whose committed offset on ``%DLQ%group`` marks what was resent."""
    return RESENT_GROUP_PREFIX + group


async def queue_offsets(calls: AdminCalls, addr: str, topic: str) -> dict[str, Any] | None:
    """Queue 0 of ``topic`` on ``addr`` (min_offset, max_offset...), None if it has none."""
    try:
        info = await calls.call(addr, RequestCode.DESCRIBE_TOPIC, {"topic": topic})
    except RpcError as e:
        if e.code == ErrorCode.TOPIC_NOT_FOUND:
            return None
        raise
    return next((q for q in info["queues"] if q["queue_id"] == 0), None)


async def committed(calls: AdminCalls, addr: str, group: str, topic: str) -> int:
    """``group``'s committed offset of ``topic`` queue 0 on ``addr`` (-1: none)."""
    found = await calls.call(addr, RequestCode.QUERY_CONSUMER_OFFSET, {"group": group, "topic": topic, "queue_id": 0})
    return int(found["offset"])


async def retry_counts(calls: AdminCalls, b: dict[str, Any], group: str) -> dict[str, Any]:
    """One broker's figures for ``group``: retry backlog (messages of ``%RETRY%group``
    the group has not consumed) and dead letters (messages ``%DLQ%group`` holds). One
    QUERY_QUEUE_OFFSETS (the dashboard asks for every group every few seconds)."""
    row: dict[str, Any] = {"broker_name": b["broker_name"], "addr": b["addr"], "retry_backlog": 0, "dead_letters": 0}
    asked = {"group": group, "queues": [[retry_topic(group), 0], [dlq_topic(group), 0]]}
    retry, dlq = (await calls.call(b["addr"], RequestCode.QUERY_QUEUE_OFFSETS, asked))["offsets"]
    if retry is not None:  # [committed (-1: none), min, max]
        row["retry_backlog"] = max(0, retry[2] - max(retry[0], retry[1]))
    if dlq is not None:
        row["dead_letters"] = dlq[2] - dlq[1]
    return row


async def read_dead_letters(calls: AdminCalls, group: str, max_messages: int, start: int) -> list[DeadLetter]:
    """Up to ``max_messages`` dead letters of ``group`` from DLQ offset ``start`` on, broker by broker."""
    out: list[DeadLetter] = []
    for b in await calls.leaders():
        q = await queue_offsets(calls, b["addr"], dlq_topic(group))
        offset = max(start, q["min_offset"]) if q is not None else 0
        while q is not None and offset < q["max_offset"] and len(out) < max_messages:
            chunk = min(RESEND_READ_CHUNK_MESSAGES, max_messages - len(out))
            records, offset = await pull(calls, b["addr"], dlq_topic(group), 0, offset, chunk)
            if not records:
                break
            out += [DeadLetter(b["addr"], b["broker_name"], r) for r in records]
    return out


def resend_message(letter: DeadLetter) -> tuple[str, dict[str, str], int, str]:
    """A dead letter's resend: origin topic, its properties minus the system ones, and
    the queue and broker it came from (-1 / "": any)."""
    props = {k: v for k, v in letter.record.properties.items() if k not in DROPPED_ON_RESEND}
    return letter.origin_topic, props, letter.origin_queue_id, letter.record.properties.get(PROP_ORIGIN_ADDR, "")


async def resend_dead_letters(
    calls: AdminCalls, group: str, offsets: set[int] | None, resend_all: bool
) -> ResendResult:
    """Send dead letters of ``group`` again to their origin topics (see
    :meth:`Admin.resend_dead_letters`), broker by broker, in DLQ order."""
    result = ResendResult([], 0, [])
    async with open_producer(calls.namesrv_addrs, broker_addrs=calls.broker_addrs, trace=True) as producer:
        for b in await calls.leaders():
            q = await queue_offsets(calls, b["addr"], dlq_topic(group))
            if q is not None:
                await _resend_from(calls, producer, b, q, group, offsets, resend_all, result)
    return result


async def _resend_from(
    calls: AdminCalls,
    producer: Producer,
    b: dict[str, Any],
    q: dict[str, Any],
    group: str,
    offsets: set[int] | None,
    resend_all: bool,
    result: ResendResult,
) -> None:
    """One broker's dead letters; its resend mark then moves over the letters resent
    from it on without a gap (``--offset`` of a later letter leaves it: the letters
    before are still to resend)."""
    topic = dlq_topic(group)
    mark = max(0, await committed(calls, b["addr"], resent_group(group), topic))
    offset, new_mark = q["min_offset"], max(mark, q["min_offset"])
    if not resend_all and offsets is None:  # the letters resent before are not even read
        offset = max(mark, q["min_offset"])
        result.skipped += min(offset, q["max_offset"]) - q["min_offset"]
    while offset < q["max_offset"]:
        records, offset = await pull(calls, b["addr"], topic, 0, offset, RESEND_READ_CHUNK_MESSAGES)
        if not records:
            break
        for r in records:
            if offsets is not None and r.queue_offset not in offsets:
                continue
            if r.queue_offset < mark and not resend_all:
                result.skipped += 1
                continue
            try:
                result.resent.append(await _resend_one(producer, DeadLetter(b["addr"], b["broker_name"], r)))
            except _SEND_ERRORS as e:
                result.errors.append(f"{b['broker_name']}: dead letter {r.queue_offset}: {e or type(e).__name__}")
                offset = q["max_offset"]  # stop here: the mark must not pass a letter not resent
                break
            if r.queue_offset == new_mark:  # the mark moves over a run resent from it, never past a letter skipped
                new_mark += 1
    if new_mark > mark:
        await calls.call(
            b["addr"], RequestCode.COMMIT_OFFSET, {"group": resent_group(group), "offsets": [[topic, 0, new_mark]]}
        )


async def _resend_one(producer: Producer, letter: DeadLetter) -> ResentLetter:
    topic, props, qid, origin_addr = resend_message(letter)
    if not topic:
        raise SendError(f"it has no {PROP_ORIGIN_TOPIC} property")

    def pick(mqs: Sequence[MessageQueue], _msg: Message) -> MessageQueue:
        same = [mq for mq in mqs if mq.queue_id == qid]
        return next(
            (mq for mq in same if mq.addr == origin_addr),
            same[0] if same else mqs[letter.record.queue_offset % len(mqs)],
        )

    r = letter.record
    body = r.body
    if PROP_DLQ_BODY_OF in r.properties:  # a letter too large to copy: its body is in the failed record
        body = await _body_of(producer, r.properties[PROP_DLQ_BODY_OF])
    sent = await producer.send(topic, body, tags=r.tags, keys=r.keys, properties=props, selector=pick)
    if producer.tracer is not None:  # the copy's id linked to the dead letter's (docs/traces.md)
        producer.tracer.dispatcher.record(resent_event(letter.msg_id, r, sent, producer.tracer.client_id))
    return ResentLetter(letter.broker_name, r.queue_offset, topic, sent.msg_ids[0])


async def _body_of(producer: Producer, msg_id: str) -> bytes:
    addr, offset = parse_msg_id(msg_id)
    try:
        reply = await producer.rpc.request(addr, RequestCode.GET_MESSAGE, {"commitlog_offset": offset})
    except RpcError as e:
        raise SendError(f"its body, at {msg_id}, is gone ({e}): the dead letter is only a reference") from None
    return decode_records(reply.body, f"message {msg_id}")[0].body


async def dead_letter_counts(calls: AdminCalls, group: str | None) -> list[dict[str, Any]]:
    """Per group with a dead-letter queue (only ``group`` if given) and broker: the dead
    letters held, and how many of them are past the resend mark (not resent yet)."""
    rows = []
    for b in await calls.leaders():
        topics = (await calls.call(b["addr"], RequestCode.LIST_TOPICS, {"include_system": True}))["topics"]
        names = sorted(t for t in topics if t.startswith(DLQ_PREFIX))
        for topic in names if group is None else [t for t in names if t == dlq_topic(group)]:
            q = await queue_offsets(calls, b["addr"], topic)
            if q is None:
                continue
            g = topic.removeprefix(DLQ_PREFIX)
            mark = max(q["min_offset"], await committed(calls, b["addr"], resent_group(g), topic))
            rows.append(
                {
                    "group": g,
                    "broker_name": b["broker_name"],
                    "addr": b["addr"],
                    "dead_letters": q["max_offset"] - q["min_offset"],
                    "not_resent": max(0, q["max_offset"] - mark),
                    "min_offset": q["min_offset"],
                    "max_offset": q["max_offset"],
                }
            )
    return rows
