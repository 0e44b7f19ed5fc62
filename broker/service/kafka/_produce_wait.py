"""What a Kafka produce waits for after its append: durability (sync flush) and the
in-sync replicas (acks=-1, as clmq's sync acks); and the acknowledged ends of the
queues (:class:`AckedEnds`).

Kafka's high watermark covers what was acknowledged: a client told "stored" may at once
ask ListOffsets for the end. A queue's entries are made by the dispatcher a moment after
the append, so the end that ListOffsets and Fetch answer is the larger of the queue's
visible end and what was acknowledged in it; a fetch there waits (long poll) for the
entries. Waiting for the entries before answering instead cost a produce the
dispatcher's latency: at 10,000 partitions, where the first message of each queue
creates its file, a tenth of the throughput."""

from __future__ import annotations

from clmq.protocol import ErrorCode as ClmqError
from clmq.protocol.kafka import ErrorCode

from .._context import BrokerContext

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


class AckedEnds:
    """Per queue, the end (last offset + 1) of what a Kafka produce acknowledged, kept
    only while the queue's visible end is below it (then forgotten)."""

    def __init__(self) -> None:
        self._ends: dict[tuple[str, int], int] = {}

    def record(self, key: tuple[str, int], end: int) -> None:
        if end > self._ends.get(key, -1):
            self._ends[key] = end

    def end(self, key: tuple[str, int], visible_end: int) -> int:
        """The queue's end for Kafka clients: its visible end, or past it what was acknowledged."""
        acked = self._ends.get(key)
        if acked is None:
            return visible_end
        if acked <= visible_end:  # the entries caught up
            del self._ends[key]
            return visible_end
        return acked

    def forget_topic(self, topic: str) -> None:
        for key in [k for k in self._ends if k[0] == topic]:
            del self._ends[key]
