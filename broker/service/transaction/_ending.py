"""What ending a half message appends, and how: a commit is the real message (its
real topic, queue and tags, the half's keys, body and properties without the
transaction ones, plus ``TRAN_HALF``) and its op record in ONE store call through the
append lane, the message first; a rollback or a check is an op record alone. The op's
tags are the half's commit-log offset (the dispatcher makes it the entry's tag code)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import trio

from clmq.broker.store import PutResult, PutStatus
from clmq.common import (
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    PROP_TRAN_GROUP,
    PROP_TRAN_HALF,
    TRANS_OP_TOPIC,
    Message,
    Record,
    is_system_topic,
)
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

from .._append import _BAD_INPUT, BusyError
from .._context import BrokerContext
from .._system_put import put_messages

_NOT_STORED = {
    PutStatus.DISK_FULL: ErrorCode.DISK_FULL,
    PutStatus.STORE_CLOSED: ErrorCode.SHUTTING_DOWN,
    PutStatus.STORE_FAILED: ErrorCode.STORE_FAILED,
    PutStatus.UNKNOWN_TOPIC: ErrorCode.TOPIC_NOT_FOUND,
    PutStatus.INVALID_QUEUE_ID: ErrorCode.INVALID_QUEUE_ID,
    PutStatus.MESSAGE_TOO_LARGE: ErrorCode.MESSAGE_TOO_LARGE,
}
_TRANSACTION_PROPS = (PROP_REAL_TOPIC, PROP_REAL_QID, PROP_REAL_TAGS, PROP_TRAN_GROUP)


def op_record(queue_id: int, half_offset: int) -> Message:
    """An op record of ``%TRANS_OP%`` (queue 0 commit, 1 rollback, 2 check) for a half."""
    return Message(TRANS_OP_TOPIC, queue_id, b"", str(half_offset), "", {})


def committed_message(half: Record) -> Message:
    """The message a committed half becomes in its real queue (UNIQ_KEY kept); refused
    (INVALID_MESSAGE) if its real topic is a system topic or its queue no number."""
    target, qid = half.properties.get(PROP_REAL_TOPIC, ""), half.properties.get(PROP_REAL_QID, "")
    if not target or is_system_topic(target) or not (qid.isascii() and qid.isdigit()):
        raise RequestError(
            ErrorCode.INVALID_MESSAGE,
            f"the half message at {half.commitlog_offset} cannot be committed to {target!r} queue {qid!r}",
        )
    props = {k: v for k, v in half.properties.items() if k not in _TRANSACTION_PROPS}
    props[PROP_TRAN_HALF] = str(half.commitlog_offset)
    return Message(
        half.properties[PROP_REAL_TOPIC],
        int(half.properties[PROP_REAL_QID]),
        half.body,
        half.properties.get(PROP_REAL_TAGS, ""),
        half.keys,
        props,
        half.flags,
        half.born_timestamp_ms,
        half.born_host,
        half.reconsume_times,
    )


async def store_together(ctx: BrokerContext, messages: Sequence[Message]) -> PutResult:
    """Append ``messages`` in one store call; refused (RequestError) unless stored.
    Nothing is stored when this raises."""
    for topic in sorted({m.topic for m in messages}):
        ctx.replica.check_sync_write(topic)
    try:
        result = await put_messages(ctx, messages)
    except BusyError as e:
        raise RequestError(ErrorCode.SYSTEM_BUSY, str(e)) from None
    return _stored(result)


def _stored(result: PutResult) -> PutResult:
    if result.status is PutStatus.FLUSH_DISK_TIMEOUT:
        return result  # stored: the wait for durability says what is missing
    if not result.ok:
        code = _NOT_STORED.get(result.status, ErrorCode.IO_ERROR)
        raise RequestError(code, f"not stored: {result.status.value}: {result.error}")
    return result


@dataclass
class _Slot:
    messages: Sequence[Message]
    wake: trio.Event = field(default_factory=trio.Event)  # appended, or this END's turn to append
    finished: bool = False
    result: PutResult | None = None
    error: RequestError | None = None


class EndAppends:
    """The ends of many transactions appended together: ENDs arriving while one store
    call is being made wait for it and go in the next one, each END's records still
    whole and in order within it (a commit's message, then its op record). An END that
    finds no append under way makes them (no task of its own) until its own records
    are stored, then hands over to the first END still waiting (nobody appends for
    others for ever). A store call that refuses one END's records as they are is made
    again per END, so one bad END (its real topic deleted, say) never fails the others."""

    MAX_ENDS_PER_APPEND = 256

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self._queue: list[_Slot] = []
        self._appending = False
        self.appends = 0  # store calls made (a batch of ENDs each)

    async def store(self, messages: Sequence[Message]) -> PutResult:
        """As :func:`store_together`, for one END's records; the result is this END's part."""
        for topic in sorted({m.topic for m in messages}):
            self.ctx.replica.check_sync_write(topic)
        slot = _Slot(messages)
        self._queue.append(slot)
        while not slot.finished:
            if not self._appending:
                await self._lead(slot)
            else:
                await slot.wake.wait()
                slot.wake = trio.Event()
        if slot.error is not None:
            raise slot.error
        assert slot.result is not None
        return _stored(slot.result)

    async def _lead(self, own: _Slot) -> None:
        """Append the waiting ENDs, in order, until ``own`` is stored."""
        self._appending = True
        try:
            await trio.lowlevel.checkpoint()  # the ENDs of this round of the event loop join
            while not own.finished and self._queue:
                batch = self._queue[: self.MAX_ENDS_PER_APPEND]
                del self._queue[: len(batch)]
                await self._append(batch)
        finally:
            self._appending = False
            if self._queue:  # the first END still waiting appends next
                self._queue[0].wake.set()
            if not own.finished and own in self._queue:  # interrupted before its turn
                self._queue.remove(own)
                own.finished, own.error = True, RequestError(ErrorCode.SHUTTING_DOWN, "the end was interrupted")

    async def _append(self, batch: list[_Slot]) -> None:
        try:
            result = await self._put([m for slot in batch for m in slot.messages])
            self.appends += 1
            if result.status in _BAD_INPUT and len(batch) > 1:
                for slot in batch:  # someone's records refused as they are: each on its own
                    await self._alone(slot)
            else:
                _split(result, batch)
        except BusyError as e:
            for slot in batch:  # never one already stored: its END must answer what it stored
                if slot.result is None and slot.error is None:
                    slot.error = RequestError(ErrorCode.SYSTEM_BUSY, str(e))
        finally:
            for slot in batch:
                if slot.result is None and slot.error is None:
                    slot.error = RequestError(ErrorCode.SHUTTING_DOWN, "the append of this end was interrupted")
                slot.finished = True
                slot.wake.set()

    async def _alone(self, slot: _Slot) -> None:
        """Store one END's records on their own; a busy lane fails this END only."""
        try:
            slot.result = await self._put(slot.messages)
        except BusyError as e:
            slot.error = RequestError(ErrorCode.SYSTEM_BUSY, str(e))

    async def _put(self, messages: Sequence[Message]) -> PutResult:
        """One store call through the append lane (raises BusyError if it is full)."""
        return await put_messages(self.ctx, messages)


def _split(result: PutResult, batch: list[_Slot]) -> None:
    """Each END's part of one store call's result (the whole call's end: durable and
    held together)."""
    at = 0
    for slot in batch:
        n = len(slot.messages)
        if not result.ok:
            slot.result = result
            continue
        slot.result = PutResult(
            result.status,
            result.error,
            result.queue_offsets[at : at + n],
            result.commitlog_offsets[at : at + n],
            result.end_offset,
            result.store_timestamp_ms,
        )
        at += n


async def acknowledged(ctx: BrokerContext, topics: Sequence[str], result: PutResult) -> None:
    """Wait until what ``result`` stored is as durable as the flush mode promises a
    producer and held by the replicas each topic's ack mode asks for (RequestError if not)."""
    sync = ctx.store.config.commitlog.acks_wait_for_fsync
    if sync and not await ctx.lane.durable.wait(result.end_offset, ctx.config.sync_flush_timeout_ms / 1000):
        raise RequestError(ErrorCode.FLUSH_DISK_TIMEOUT, "stored, but not fsynced within sync_flush_timeout_ms")
    for topic in sorted(set(topics)):
        problem = await ctx.replica.wait_held(topic, result.end_offset)
        if problem is not None:
            raise RequestError(problem[0], problem[1])
