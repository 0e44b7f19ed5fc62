"""CONSUMER_SEND_BACK: a group failed on messages; copy each to the group's retry topic
through the timer (due after the group's back-off), or to its dead-letter topic once
it has failed too often. The group's committed offset on the original queue then
moves on: one bad message never blocks its queue (RocketMQ's consumer send-back)."""

from __future__ import annotations

from typing import Any

import trio

from clmq.broker.store import Store
from clmq.common import (
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
    TIMER_TOPIC,
    CorruptRecordError,
    Message,
    Record,
    dlq_topic,
    is_system_topic,
    record_size,
    retry_topic,
    timer_tag,
)
from clmq.protocol import ErrorCode, Frame
from clmq.protocol.auth import Operation, ResourceType
from clmq.protocol.transport import Peer, Reply, RequestError, need

from ._context import BrokerContext
from ._system_put import ensure_topic, put_acknowledged
from ._trace_buffer import send_back_events
from .timer import SCHEDULED_QUEUE, TIMER_QUEUES, wall_ms

# The timer's own properties: a retried message does not carry its last trip's.
_TRANSIENT = (PROP_DELIVER_AT, PROP_REAL_TOPIC, PROP_REAL_QID, PROP_REAL_TAGS, PROP_TIMER_SRC, PROP_CANCEL_OF)


class SendBack:
    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx

    async def handle(self, frame: Frame, peer: Peer) -> Reply:
        group = need(frame.fields, "group", str)
        rows: list[list[int]] = need(frame.fields, "messages", list)
        limit = frame.fields.get("max_reconsume_times")
        limit = self.ctx.config.max_reconsume_times if limit is None else limit
        to_dlq = bool(frame.fields.get("to_dlq", False))
        if not group or is_system_topic(group):
            raise RequestError(ErrorCode.MALFORMED_REQUEST, f"field 'group' must name a consumer group, got {group!r}")
        store = self.ctx.store
        if not isinstance(store, Store):
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                f"retries live in the CommitLog: this broker runs {self.ctx.config.storage_mode}",
            )
        self.ctx.replica.check_writable()
        longest = self.ctx.config.timer_max_delay_ms
        if any(delay > longest for _offset, delay in rows):
            raise RequestError(
                ErrorCode.MALFORMED_REQUEST, f"field 'messages': a delay_ms past timer_max_delay_ms={longest}"
            )
        records = await trio.to_thread.run_sync(_records_at, store, [r[0] for r in rows])
        # Copying a record into %RETRY%group lets the group read it: READ on its topic first.
        topics = sorted({r.topic for r in records})
        self.ctx.security.check(peer, [(Operation.READ, ResourceType.TOPIC, t) for t in topics], "CONSUMER_SEND_BACK")
        now = wall_ms()
        messages, results = [], []
        for record, (_offset, delay) in zip(records, rows):
            times = record.reconsume_times + 1
            due = now + (delay if delay >= 0 else self._backoff(times))
            copy = None if to_dlq or times > limit else self._retry(group, record, times, due)
            if copy is not None and record_size(copy) <= self.ctx.config.max_message_bytes:
                messages.append(copy)
                results.append(["retry", times, due])
            else:  # past the limit, or a record too near the size limit to carry the retry's properties
                messages.append(dead_letter(self.ctx, group, record, times))
                results.append(["dlq", times, 0])
        await self._ensure_topics(group, results)
        await put_acknowledged(self.ctx, messages, also={r.topic for r in records})  # the originals' ack mode too
        if self.ctx.tracer.enabled:
            send_back_events(self.ctx.tracer, self.ctx.addr(), self.ctx.config.broker_name, group, records, results)
        return Reply({"results": results})

    def _backoff(self, times: int) -> int:
        delays = self.ctx.config.retry_delays_ms  # a level past timer_max_delay_ms waits that long
        return min(delays[min(times, len(delays)) - 1], self.ctx.config.timer_max_delay_ms)

    async def _ensure_topics(self, group: str, results: list[list[Any]]) -> None:
        if any(r[0] == "retry" for r in results):
            await ensure_topic(self.ctx, TIMER_TOPIC, TIMER_QUEUES)
            await ensure_topic(self.ctx, retry_topic(group), 1)
        if any(r[0] == "dlq" for r in results):
            await ensure_topic(self.ctx, dlq_topic(group), 1)

    def _retry(self, group: str, record: Record, times: int, due: int) -> Message:
        props = origin_properties(self.ctx, record)
        props.update(
            {
                PROP_DELIVER_AT: str(due),
                PROP_REAL_TOPIC: retry_topic(group),
                PROP_REAL_QID: "0",
                PROP_REAL_TAGS: record.tags,
            }
        )
        return Message(
            TIMER_TOPIC,
            SCHEDULED_QUEUE,
            record.body,
            timer_tag(due),
            record.keys,
            props,
            record.flags,
            record.born_timestamp_ms,
            record.born_host,
            times,
        )


def origin_properties(ctx: BrokerContext, record: Record) -> dict[str, str]:
    """The record's properties, with where it came from first (kept from the first
    failure on, across retries)."""
    props = {k: v for k, v in record.properties.items() if k not in _TRANSIENT}
    if PROP_ORIGIN_TOPIC not in props:
        props[PROP_ORIGIN_TOPIC] = record.topic
        props[PROP_ORIGIN_QID] = str(record.queue_id)
        props[PROP_ORIGIN_OFFSET] = str(record.queue_offset)
        props[PROP_ORIGIN_ADDR] = ctx.addr()
        props[PROP_ORIGIN_MSG_ID] = f"{ctx.addr()}@{record.commitlog_offset:016X}"
    return props


def dead_letter(ctx: BrokerContext, group: str, record: Record, times: int) -> Message:
    """The copy of ``record`` for ``%DLQ%group`` (CONSUMER_SEND_BACK's and POP's dead
    letters): its properties with where it came from; a record too near the size
    limit to carry them goes as a reference to its body."""
    props = origin_properties(ctx, record)
    props[PROP_DLQ_GROUP] = group
    out = Message(
        dlq_topic(group),
        0,
        record.body,
        record.tags,
        record.keys,
        props,
        record.flags,
        record.born_timestamp_ms,
        record.born_host,
        times,
    )
    if record_size(out) > ctx.config.max_message_bytes:  # it must not block its queue: a reference
        out.body = b""  # the failed record keeps the body until retention removes it
        out.properties = {**props, PROP_DLQ_BODY_OF: f"{ctx.addr()}@{record.commitlog_offset:016X}"}
    return out


def _records_at(store: Store, offsets: list[int]) -> list[Record]:
    """The records at these commit-log offsets; NOT_FOUND naming the first that is none."""
    out = []
    for offset in offsets:
        try:
            record = store.log.read_record(offset)
        except CorruptRecordError as e:
            raise RequestError(ErrorCode.NOT_FOUND, f"no message starts at CommitLog offset {offset}: {e}") from None
        if record is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"CommitLog offset {offset} is not in the log (retention?)")
        out.append(record)
    return out
