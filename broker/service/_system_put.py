"""Appends the broker makes itself (the timer's deliveries, retries, dead letters):
through the append lane like a producer's, so that they are ordered with produce
requests, counted in flight, and held back while a leader hands its group over."""

from __future__ import annotations

from typing import Sequence

import trio

from broker.store import PutResult, PutStatus
from commitlog import Message
from protocol import encode_batch

from ._context import BrokerContext


async def ensure_topic(ctx: BrokerContext, topic: str, queue_count: int) -> None:
    """Create a system topic (``%TIMER%``, ``%RETRY%g``, ``%DLQ%g``) the first time it
    is needed; the name servers hear of it at once (consumers find retry topics by route)."""
    if ctx.store.topics.queue_count(topic) is not None:
        return
    await trio.to_thread.run_sync(ctx.store.create_topic, topic, queue_count)
    ctx.metadata.bump_topics()
    ctx.register_now()


async def put_messages(ctx: BrokerContext, messages: Sequence[Message]) -> PutResult:
    """Append ``messages`` through the lane (as objects: their attempt counts and born
    hosts kept), in one request; its result (raises BusyError if the lane is full)."""
    if not messages:
        return PutResult(PutStatus.OK)
    puts = [ctx.lane.submit(messages[0].topic, encode_batch(messages), messages[0].born_host, messages)]
    result = PutResult(PutStatus.OK)
    for put in puts:
        await put.done.wait()
        assert put.result is not None
        if (not put.result.ok and result.ok) or result.ok:
            result = put.result
    return result
