"""Appends the broker makes itself (the timer's deliveries, retries, dead letters):
through the append lane like a producer's, so that they are ordered with produce
requests, counted in flight, and held back while a leader hands its group over."""

from __future__ import annotations

from typing import Iterable, Sequence

import trio

from clmq.broker.store import PutResult, PutStatus
from clmq.common import Message
from clmq.protocol import ErrorCode, encode_batch
from clmq.protocol.transport import RequestError

from ._append import BusyError
from ._context import BrokerContext


class UnconfirmedError(RequestError):
    """The messages were appended (they may outlive a crash, a replay finds them) but
    their durability or replication was not confirmed: state that follows the log
    changes as if they were stored; the answer is still this error."""


async def ensure_topic(ctx: BrokerContext, topic: str, queue_count: int) -> None:
    """Create a system topic (``%TIMER%``, ``%RETRY%g``, ``%DLQ%g``) the first time it
    is needed; the name servers hear of it at once (consumers find retry topics by route).
    Returns once every in-sync follower holds it (also when another call made it and
    is still waiting); RequestError (REPLICATION_TIMEOUT) if they do not in time."""
    if ctx.store.topics.queue_count(topic) is not None:
        await ctx.topics_held(topic)
        return
    await trio.to_thread.run_sync(ctx.store.create_topic, topic, queue_count)
    await ctx.topic_changed(topic)


async def put_messages(ctx: BrokerContext, messages: Sequence[Message]) -> PutResult:
    """Append ``messages`` through the lane (as objects: their attempt counts and born
    hosts kept), in one request; its result (raises BusyError if the lane is full)."""
    if not messages:
        return PutResult(PutStatus.OK)
    put = ctx.lane.submit(messages[0].topic, encode_batch(messages), messages[0].born_host, messages)
    await put.done.wait()
    assert put.result is not None
    return put.result


async def put_acknowledged(ctx: BrokerContext, messages: Sequence[Message], also: Iterable[str] = ()) -> PutResult:
    """:func:`put_messages` for an answer that promises the copy: refused (RequestError)
    unless stored, durable as the flush mode promises a producer (sync: fsynced) and held
    by the replicas the ack mode of each topic asks for: the messages' and ``also``'s (a
    retry or a dead letter replaces the original, whose offset the consumer then commits
    past: it must not be lost). Returns the put's result (its offsets); UnconfirmedError
    (a RequestError) when they were appended but that promise is not confirmed."""
    result = await append_acknowledged(ctx, messages, also)
    await confirm_acknowledged(ctx, result, sorted({m.topic for m in messages} | set(also)))
    return result


async def append_acknowledged(ctx: BrokerContext, messages: Sequence[Message], also: Iterable[str] = ()) -> PutResult:
    """:func:`put_acknowledged`'s first half: the topics' ack modes checked, then the
    append (RequestError unless stored); its order in the log is fixed when it returns."""
    for topic in sorted({m.topic for m in messages} | set(also)):
        ctx.replica.check_sync_write(topic)
    try:
        result = await put_messages(ctx, messages)
    except BusyError as e:
        raise RequestError(ErrorCode.SYSTEM_BUSY, str(e)) from None
    if not result.ok:
        raise RequestError(ErrorCode.IO_ERROR, f"not stored: {result.status.value}: {result.error}")
    return result


async def confirm_acknowledged(ctx: BrokerContext, result: PutResult, topics: Sequence[str]) -> None:
    """:func:`put_acknowledged`'s second half: wait until an appended result is durable
    as the flush mode promises and held as each topic's ack mode asks (UnconfirmedError)."""
    sync = ctx.store.config.commitlog.acks_wait_for_fsync
    if sync and not await ctx.lane.durable.wait(result.end_offset, ctx.config.sync_flush_timeout_ms / 1000):
        raise UnconfirmedError(ErrorCode.FLUSH_DISK_TIMEOUT, "stored, but not fsynced within sync_flush_timeout_ms")
    for topic in topics:  # each topic's ack mode (an async one answers at once)
        problem = await ctx.replica.wait_held(topic, result.end_offset)
        if problem is not None:
            raise UnconfirmedError(problem[0], problem[1])
