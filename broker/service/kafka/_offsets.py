"""OffsetCommit and OffsetFetch: Kafka groups' committed offsets, kept where clmq's own
groups keep theirs (``ConsumerOffsets``: one group namespace; ``clmq group describe``
shows a Kafka group's lag, and ``clmq group reset-offsets`` moves it). A Kafka
offset is a queue offset: the next message to read. The commit's metadata string is
not kept (read back as ""). Commits go to the group's coordinator; partitions of
another broker group are committed there (the coordinator forwards them with
COMMIT_OFFSET to that group's leader, and reads them back with DESCRIBE_GROUP), since
each group's offsets live with its queues, replicated with them."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from clmq.protocol import ErrorCode as ClmqErrorCode
from clmq.protocol import RequestCode
from clmq.protocol.kafka import ErrorCode, KafkaRequest
from clmq.protocol.transport import ConnectionFailed, RpcError

from .._context import BrokerContext
from ._cluster import ClusterView, ClusterViews
from ._listener import Peer
from ._metadata import coordinator_for

log = logging.getLogger("clmq.broker.kafka")
FORWARD_TIMEOUT_MS = 5000


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
        remote: dict[str, list[_Forward]] = {}  # leader address -> rows to commit there
        topics = []
        for t in body.get("topics", []):
            rows = []
            for p in t["partitions"]:
                row: dict[str, Any] = {"partition_index": p["partition_index"], "error_code": error}
                rows.append(row)
                if not error:
                    row["error_code"] = self._commit(view, group, t["name"], p, row, remote)
            topics.append({"name": t["name"], "partitions": rows})
        if not error:
            self.ctx.metadata.bump()  # followers copy the offsets
        await self._forward(group, remote, peer)
        return {"throttle_time_ms": 0, "topics": topics}

    def _commit(
        self,
        view: ClusterView,
        group: str,
        topic: str,
        p: dict[str, Any],
        row: dict[str, Any],
        remote: dict[str, list[_Forward]],
    ) -> int:
        """Commit one partition here, or set it aside for its group's leader; its error code."""
        homes = view.topics.get(topic)
        index = p["partition_index"]
        if homes is None or not 0 <= index < len(homes):
            return ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        if p["committed_offset"] < 0:
            return ErrorCode.INVALID_COMMIT_OFFSET_SIZE
        home = homes[index]
        if home.group != self.ctx.config.broker_name:  # another group's queue: its offsets live there
            if not home.leader_addr:
                return ErrorCode.COORDINATOR_NOT_AVAILABLE
            remote.setdefault(home.leader_addr, []).append((row, [topic, home.queue_id, p["committed_offset"]]))
            return 0
        self.ctx.offsets.commit(group, topic, home.queue_id, p["committed_offset"])
        return 0

    def _behalf(self, peer: Peer) -> dict[str, Any]:
        """With logins on: the client a forwarded request is for (the other group's
        leader decides its ACLs for that principal, not for this broker's user)."""
        if not self.ctx.security.access.enabled:
            return {}
        return {"on_behalf_of": [peer.session.principal or "User:ANONYMOUS", peer.host]}

    async def _forward(self, group: str, remote: dict[str, list[_Forward]], peer: Peer) -> None:
        """Commits of other groups' partitions, to their leaders (a failure: those rows'
        error REQUEST_TIMED_OUT, which the client retries; a refusal by that leader's
        ACLs: GROUP_AUTHORIZATION_FAILED)."""
        client = self.views.client()
        for addr, parts in remote.items():
            try:
                if client is None:
                    raise ConnectionFailed(f"{addr}: the broker's client is not running")
                fields = {"group": group, "offsets": [entry for _row, entry in parts], **self._behalf(peer)}
                await client.request(addr, RequestCode.COMMIT_OFFSET, fields, timeout_ms=FORWARD_TIMEOUT_MS)
            except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
                log.info("kafka: forwarding %d commits of group %s to %s failed: %s", len(parts), group, addr, e)
                refused = isinstance(e, RpcError) and e.code == ClmqErrorCode.NOT_AUTHORIZED
                for row, _entry in parts:
                    row["error_code"] = ErrorCode.GROUP_AUTHORIZATION_FAILED if refused else ErrorCode.REQUEST_TIMED_OUT

    async def offset_fetch(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        view = await self.views.current()
        if "groups" in body:  # v8+: several groups at once
            groups = [await self._fetch_group(view, g["group_id"], g.get("topics"), peer) for g in body["groups"]]
            return {"throttle_time_ms": 0, "groups": groups}
        one = await self._fetch_group(view, body["group_id"], body.get("topics"), peer)
        return {"throttle_time_ms": 0, "topics": one["topics"], "error_code": one["error_code"]}

    async def _fetch_group(
        self, view: ClusterView, group: str, topics: list[dict[str, Any]] | None, peer: Peer
    ) -> dict[str, Any]:
        error = self._coordinator_error(view, group)
        if error:
            return {"group_id": group, "topics": [], "error_code": error}
        committed = await self._all_committed(view, group, peer)
        if isinstance(committed, int):  # not loaded (a leader did not answer), or refused there
            return {"group_id": group, "topics": [], "error_code": committed}
        if topics is None:  # every partition the group committed
            asked: dict[str, list[int]] = {}
            for topic, index in sorted(committed):
                asked.setdefault(topic, []).append(index)
        else:
            asked = {t["name"]: list(t["partition_indexes"]) for t in topics}
        rows = [
            {"name": name, "partitions": [_fetched(i, committed.get((name, i), -1)) for i in indexes]}
            for name, indexes in asked.items()
        ]
        return {"group_id": group, "topics": rows, "error_code": 0}

    async def _all_committed(self, view: ClusterView, group: str, peer: Peer) -> dict[tuple[str, int], int] | int:
        """(topic, partition) -> committed offset of every partition of the group, from
        this broker's offsets and (for other groups' partitions) their leaders'; or the
        error: COORDINATOR_LOAD_IN_PROGRESS (a leader did not answer; the client
        retries), GROUP_AUTHORIZATION_FAILED (its ACLs refused the client)."""
        mine = self.ctx.config.broker_name
        by_group: dict[str, dict[tuple[str, int], int]] = {mine: self.ctx.offsets.of_group(group)}
        for homes in view.topics.values():
            for home in homes:
                if home.group not in by_group:
                    fetched = await self._remote_offsets(home.leader_addr, group, peer)
                    if isinstance(fetched, int):
                        return fetched
                    by_group[home.group] = fetched
        out: dict[tuple[str, int], int] = {}
        for topic, homes in view.topics.items():
            for index, home in enumerate(homes):
                offset = by_group[home.group].get((topic, home.queue_id))
                if offset is not None:
                    out[topic, index] = offset
        return out

    async def _remote_offsets(self, addr: str, group: str, peer: Peer) -> dict[tuple[str, int], int] | int:
        client = self.views.client()
        if not addr or client is None:
            return ErrorCode.COORDINATOR_LOAD_IN_PROGRESS
        try:
            fields = {"group": group, **self._behalf(peer)}
            reply = await client.request(addr, RequestCode.DESCRIBE_GROUP, fields, timeout_ms=FORWARD_TIMEOUT_MS)
        except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
            log.info("kafka: reading group %s's offsets at %s failed: %s", group, addr, e)
            if isinstance(e, RpcError) and e.code == ClmqErrorCode.NOT_AUTHORIZED:
                return ErrorCode.GROUP_AUTHORIZATION_FAILED
            return ErrorCode.COORDINATOR_LOAD_IN_PROGRESS
        return {(str(q["topic"]), int(q["queue_id"])): int(q["committed"]) for q in reply.fields.get("queues", [])}


_Forward = tuple[dict[str, Any], list[Any]]  # an answer's row, and [topic, queue id, offset] to commit


def _fetched(index: int, offset: int) -> dict[str, Any]:
    return {
        "partition_index": index,
        "committed_offset": offset,
        "committed_leader_epoch": -1,
        "metadata": "",
        "error_code": 0,
    }
