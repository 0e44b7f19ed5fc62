"""What a Kafka produce waits for after its append: durability (sync flush), the
in-sync replicas (acks=-1, as clmq's sync acks) and its queue entries, which the
dispatcher makes a moment after the append (Kafka's high watermark covers what was
acknowledged: a client told "stored" may at once ask ListOffsets or Fetch for it)."""

from __future__ import annotations

import trio

from clmq.protocol import ErrorCode as ClmqError
from clmq.protocol.kafka import ErrorCode

from .._context import BrokerContext

VISIBLE_WAIT_S = 2.0  # an acknowledged produce waits at most this long for its queue entries
WRITE_ERRORS = {
    ClmqError.NOT_LEADER: ErrorCode.NOT_LEADER_OR_FOLLOWER,
    ClmqError.NOT_ENOUGH_REPLICAS: ErrorCode.NOT_ENOUGH_REPLICAS,
    ClmqError.REPLICATION_TIMEOUT: ErrorCode.REQUEST_TIMED_OUT,
    ClmqError.STALE_EPOCH: ErrorCode.NOT_LEADER_OR_FOLLOWER,
    ClmqError.SYSTEM_BUSY: ErrorCode.REQUEST_TIMED_OUT,
}


async def acknowledged(ctx: BrokerContext, topic: str, end_offset: int, acks: int) -> tuple[int, str] | None:
    """None once a put ending at ``end_offset`` may be acknowledged, else the error."""
    cfg = ctx.config
    fsync = ctx.store.config.commitlog.acks_wait_for_fsync
    if fsync and not await ctx.lane.durable.wait(end_offset, cfg.sync_flush_timeout_ms / 1000):
        return ErrorCode.REQUEST_TIMED_OUT, "stored, but not fsynced within sync_flush_timeout_ms"
    problem = await ctx.replica.wait_held(topic, end_offset, sync=acks == -1)
    if problem is not None:
        return WRITE_ERRORS.get(problem[0], ErrorCode.UNKNOWN_SERVER_ERROR), problem[1]
    return None


async def visible(ctx: BrokerContext, last: dict[tuple[str, int], int]) -> None:
    """Wait until each queue shows its last offset in ``last``; bounded by
    ``VISIBLE_WAIT_S`` (the answer goes then anyway). One wake-up event for all."""
    store = ctx.store
    with trio.move_on_after(VISIBLE_WAIT_S):
        while True:
            pending = [k for k, offset in last.items() if store.max_offset(*k) <= offset]
            if not pending:
                return
            event = trio.Event()
            for key in pending:  # before the check: an arrival in between is not missed
                ctx.waiters.add(key, event)
            try:
                if all(store.max_offset(*k) <= last[k] for k in pending):
                    await event.wait()
            finally:
                for key in pending:
                    ctx.waiters.unregister(key, event)
            last = {k: last[k] for k in pending}
