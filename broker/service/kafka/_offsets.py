"""OffsetCommit and OffsetFetch: Kafka groups' committed offsets, kept where clmq's own
groups keep theirs (``ConsumerOffsets``: one group namespace; ``clmq group describe``
shows a Kafka group's lag, and ``clmq group reset-offsets`` moves it). A Kafka
offset is a queue offset: the next message to read. The commit's metadata string is
not kept (read back as ""). Commits go to the group's coordinator, which holds the
partitions' queues (a cluster of one broker group; see docs/kafka.md)."""

from __future__ import annotations

from typing import Any, Protocol

from clmq.protocol.kafka import ErrorCode, KafkaRequest

from .._context import BrokerContext
from ._cluster import ClusterView, ClusterViews
from ._listener import Peer
from ._metadata import coordinator_for


class CommitCheck(Protocol):
    def check_commit(self, group_id: str, generation_id: int, member_id: str, group_instance_id: str | None) -> int: ...


class KafkaOffsets:
    """Committed offsets of Kafka groups."""

    def __init__(self, ctx: BrokerContext, views: ClusterViews, groups: CommitCheck) -> None:
        self.ctx = ctx
        self.views = views
        self.groups = groups

    def _coordinator_error(self, view: ClusterView, group: str) -> int:
        node = coordinator_for(view, group)
        if node is None:
            return ErrorCode.COORDINATOR_NOT_AVAILABLE
        return 0 if node.node_id == self.views.me.node_id else ErrorCode.NOT_COORDINATOR

    async def offset_commit(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        group = body["group_id"]
        view = await self.views.current()
        error = self._coordinator_error(view, group)
        if not error:
            error = self.groups.check_commit(
                group,
                body.get("generation_id_or_member_epoch", -1),
                body.get("member_id", ""),
                body.get("group_instance_id"),
            )
        if not error and self.ctx.replica.role != "leader":
            error = ErrorCode.NOT_COORDINATOR
        topics = []
        for t in body.get("topics", []):
            rows = [
                {
                    "partition_index": p["partition_index"],
                    "error_code": error or self._commit(view, group, t["name"], p),
                }
                for p in t["partitions"]
            ]
            topics.append({"name": t["name"], "partitions": rows})
        if not error:
            self.ctx.metadata.bump()  # followers copy the offsets
        return {"throttle_time_ms": 0, "topics": topics}

    def _commit(self, view: ClusterView, group: str, topic: str, p: dict[str, Any]) -> int:
        homes = view.topics.get(topic)
        index = p["partition_index"]
        if homes is None or not 0 <= index < len(homes):
            return ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        home = homes[index]
        if home.group != self.ctx.config.broker_name:
            return ErrorCode.NOT_COORDINATOR  # another group's queue: its offsets live there
        if p["committed_offset"] < 0:
            return ErrorCode.INVALID_COMMIT_OFFSET_SIZE
        self.ctx.offsets.commit(group, topic, home.queue_id, p["committed_offset"])
        return 0

    async def offset_fetch(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        view = await self.views.current()
        if "groups" in body:  # v8+: several groups at once
            groups = [self._fetch_group(view, g["group_id"], g.get("topics")) for g in body["groups"]]
            return {"throttle_time_ms": 0, "groups": groups}
        one = self._fetch_group(view, body["group_id"], body.get("topics"))
        return {"throttle_time_ms": 0, "topics": one["topics"], "error_code": one["error_code"]}

    def _fetch_group(self, view: ClusterView, group: str, topics: list[dict[str, Any]] | None) -> dict[str, Any]:
        error = self._coordinator_error(view, group)
        if error:
            return {"group_id": group, "topics": [], "error_code": error}
        if topics is None:  # every partition the group committed
            asked = self._committed(view, group)
        else:
            asked = {t["name"]: list(t["partition_indexes"]) for t in topics}
        rows = []
        for name, indexes in asked.items():
            parts = [self._fetch_one(view, group, name, i) for i in indexes]
            rows.append({"name": name, "partitions": parts})
        return {"group_id": group, "topics": rows, "error_code": 0}

    def _committed(self, view: ClusterView, group: str) -> dict[str, list[int]]:
        mine = self.ctx.config.broker_name
        out: dict[str, list[int]] = {}
        committed = self.ctx.offsets.of_group(group)
        for topic, homes in view.topics.items():
            for index, home in enumerate(homes):
                if home.group == mine and (topic, home.queue_id) in committed:
                    out.setdefault(topic, []).append(index)
        return out

    def _fetch_one(self, view: ClusterView, group: str, topic: str, index: int) -> dict[str, Any]:
        row: dict[str, Any] = {
            "partition_index": index,
            "committed_offset": -1,
            "committed_leader_epoch": -1,
            "metadata": "",
            "error_code": 0,
        }
        homes = view.topics.get(topic)
        if homes is None or not 0 <= index < len(homes):
            return row  # Kafka answers -1 (no offset) for unknown partitions
        home = homes[index]
        if home.group != self.ctx.config.broker_name:
            row["error_code"] = ErrorCode.NOT_COORDINATOR
            return row
        row["committed_offset"] = self.ctx.offsets.query(group, topic, home.queue_id)
        return row
