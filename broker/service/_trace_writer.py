"""Writing the broker's trace events (``_trace_buffer``) to ``%TRACE%``, and the
topic itself: a broker with ``trace_enabled`` creates ``%TRACE%``
(:data:`TRACE_QUEUES` queues) as soon as it leads its group, so that clients'
traces have somewhere to go; followers copy it like any topic."""

from __future__ import annotations

import logging

import trio

from clmq.common import TRACE_QUEUES, TRACE_TOPIC, ClmqError, trace_messages

from ._append import BusyError
from ._context import BrokerContext
from ._system_put import ensure_topic, put_messages
from ._trace_buffer import TRACE_FLUSH_INTERVAL_MS

log = logging.getLogger("clmq.broker.trace")


async def trace_loop(ctx: BrokerContext) -> None:
    """With ``trace_enabled``: create ``%TRACE%`` once leading, then write the buffered
    events every ``TRACE_FLUSH_INTERVAL_MS`` (a failed write is counted and logged, the
    broker goes on)."""
    if not ctx.config.trace_enabled:
        return
    queue = 0
    while True:
        await trio.sleep(TRACE_FLUSH_INTERVAL_MS / 1000)
        if ctx.replica.role != "leader":
            ctx.tracer.take(ctx.tracer.buffered)  # a follower records nothing of its own; kept nothing
            continue
        if not await _topic_ready(ctx):
            continue
        while ctx.tracer.buffered:
            queue = await _write_batch(ctx, queue)


async def _topic_ready(ctx: BrokerContext) -> bool:
    if ctx.store.topics.queue_count(TRACE_TOPIC) is not None:
        return True
    try:
        ctx.replica.check_writable()
        await ensure_topic(ctx, TRACE_TOPIC, TRACE_QUEUES)
    except (ClmqError, OSError, ValueError) as e:  # not leading (NOT_LEADER), a store that cannot
        log.info("%s not created yet: %s", TRACE_TOPIC, e)
        return False
    log.info("created %s (%d queues) for message traces", TRACE_TOPIC, TRACE_QUEUES)
    return True


async def _write_batch(ctx: BrokerContext, queue: int) -> int:
    """Append one batch of buffered events to one queue; the next queue to use."""
    events = ctx.tracer.take()
    queues = ctx.store.topics.queue_count(TRACE_TOPIC) or 1
    try:
        result = await put_messages(ctx, trace_messages(events, queue % queues))
        why = "" if result.ok else f"{result.status.value}: {result.error}"
    except (BusyError, ClmqError, OSError) as e:  # a trace write never stops the broker: counted and said
        why = str(e) or type(e).__name__
    if not why:
        ctx.tracer.written += len(events)
    else:
        ctx.tracer.failed += len(events)
        log.warning("%d trace events not written: %s", len(events), why)
    return queue + 1
