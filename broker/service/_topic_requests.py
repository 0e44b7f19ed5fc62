"""Requests about topics: CREATE_TOPIC (or grow one), DELETE_TOPIC, LIST_TOPICS and
DESCRIBE_TOPIC (its queues' offsets and sizes, read in the pulls' threads)."""

from __future__ import annotations

import trio

from clmq.common import is_system_topic
from clmq.protocol import ErrorCode, Frame
from clmq.protocol.transport import Peer, Reply, RequestError, need

from ._context import BrokerContext
from ._read_threads import ReadThreads


class TopicRequests:
    """Topic changes (on the leader only; followers copy them) and descriptions."""

    def __init__(self, ctx: BrokerContext, readers: ReadThreads) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.config = ctx.config
        self._readers = readers

    async def create_topic(self, frame: Frame, peer: Peer) -> Reply:
        topic, count = need(frame.fields, "topic", str), need(frame.fields, "queue_count", int)
        return Reply({"queue_count": await self.create(topic, count)})

    async def create(self, topic: str, count: int) -> int:
        """Create ``topic`` with ``count`` queues here, or grow it to that many (the
        Kafka listener's CreateTopics and CreatePartitions too); its queue count."""
        self.ctx.replica.check_writable()
        have = self.store.topics.queue_count(topic)
        if have is not None and count < have:  # queues cannot go: their messages and offsets would be stranded
            raise RequestError(
                ErrorCode.INVALID_TOPIC,
                f"topic {topic!r} has {have} queues on {self.config.broker_name}: "
                f"a queue count can grow, not shrink (asked {count})",
            )
        try:
            await trio.to_thread.run_sync(self.store.create_topic, topic, count)
        except ValueError as e:
            raise RequestError(ErrorCode.INVALID_TOPIC, str(e)) from None
        await self.ctx.topic_changed(topic)
        return self.store.topics.queue_count(topic) or 0

    async def delete_topic(self, frame: Frame, peer: Peer) -> Reply:
        await self.delete(need(frame.fields, "topic", str))
        return Reply()

    async def delete(self, topic: str) -> None:
        """Delete ``topic`` here, with its groups' offsets (the Kafka listener's DeleteTopics too)."""
        self.ctx.replica.check_writable()
        if not await trio.to_thread.run_sync(self.store.delete_topic, topic):
            raise RequestError(
                ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}"
            )
        self.ctx.offsets.drop_topic(topic)
        self.ctx.pop_drop_topic(topic)
        await self.ctx.topic_changed(topic)

    async def list_topics(self, frame: Frame, peer: Peer) -> Reply:
        topics = self.store.topics.all()
        if not frame.fields.get("include_system"):
            topics = {name: count for name, count in topics.items() if not is_system_topic(name)}
        return Reply({"topics": topics})

    async def describe_topic(self, frame: Frame, peer: Peer) -> Reply:
        topic = need(frame.fields, "topic", str)
        count = self.store.topics.queue_count(topic)
        if count is None:
            raise RequestError(
                ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}"
            )

        sizes = getattr(self.store, "queue_bytes", None)  # commitlog mode; partition-per-file: not summed (-1)
        cap = self.config.describe_size_max_entries

        def offsets() -> list[dict[str, int]]:
            rows = []
            for q in range(count):
                size = sizes(topic, q, cap) if sizes is not None else None
                rows.append(
                    {
                        "queue_id": q,
                        "min_offset": self.store.min_offset(topic, q),
                        "max_offset": self.store.max_offset(topic, q),
                        "size_bytes": -1 if size is None else size,
                    }
                )
            return rows

        return Reply({"queue_count": count, "queues": await self._readers.in_thread(offsets)})
