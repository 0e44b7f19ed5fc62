"""Requests about consumer groups: their members (HEARTBEAT, UNREGISTER_CLIENT,
GET_GROUP_MEMBERS), their committed offsets (COMMIT_OFFSET, QUERY_CONSUMER_OFFSET),
LIST_GROUPS and DESCRIBE_GROUP. (Deleting a group: ``_admin_requests``.)"""

from __future__ import annotations

from typing import Any

from clmq.protocol import ErrorCode, Frame
from clmq.protocol.auth import Operation, ResourceType
from clmq.protocol.transport import Peer, Reply, RequestError, need

from ._context import BrokerContext, now_ms
from ._locks import LockRequests
from ._queue_requests import existing_queue

READ, GROUP = Operation.READ, ResourceType.GROUP


class GroupRequests:
    """Membership and offsets of consumer groups; a client that leaves gives up its
    queue locks (``locks``)."""

    def __init__(self, ctx: BrokerContext, locks: LockRequests) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.locks = locks

    async def commit_offset(self, frame: Frame, peer: Peer) -> Reply:
        """Many offsets of one group at once (a consumer of thousands of queues commits
        them in one request); queues that no longer exist are ignored."""
        group = need(frame.fields, "group", str)
        rows = need(frame.fields, "offsets", list)
        self.ctx.replica.check_writable()
        self.ctx.metadata.bump()
        for row in rows:
            if not (
                isinstance(row, list)
                and len(row) == 3
                and isinstance(row[0], str)
                and isinstance(row[1], int)
                and isinstance(row[2], int)
            ):
                raise RequestError(ErrorCode.MALFORMED_REQUEST, "offsets must be [topic, queue_id, offset] lists")
        for topic, qid, offset in rows:
            if self.store.queue_exists(topic, qid):
                self.ctx.offsets.commit(group, topic, qid, offset)
        return Reply()

    async def query_consumer_offset(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields
        group = need(f, "group", str)
        topic, qid = existing_queue(self.ctx, f)
        return Reply({"offset": self.ctx.offsets.query(group, topic, qid)})

    async def heartbeat(self, frame: Frame, peer: Peer) -> Reply:
        client_id = need(frame.fields, "client_id", str)
        for g in need(frame.fields, "groups", list):
            if not isinstance(g, dict) or not isinstance(g.get("group"), str):
                raise RequestError(ErrorCode.MALFORMED_REQUEST, "groups must be maps with a 'group' name")
            if self.ctx.kafka_members(g["group"]):  # one namespace: a group is Kafka's or clmq's at a time
                raise RequestError(
                    ErrorCode.GROUP_ACTIVE,
                    f"group {g['group']!r} has members using the Kafka protocol; "
                    "a group's members use one protocol at a time (use another group name)",
                )
            if self.ctx.groups.heartbeat(
                client_id, g["group"], g.get("mode", "clustering"), g.get("topics", []), now_ms()
            ):
                self.ctx.metadata.bump()
        return Reply()

    async def unregister_client(self, frame: Frame, peer: Peer) -> Reply:
        client_id = need(frame.fields, "client_id", str)
        groups = self.ctx.groups.groups_of(client_id)  # leaving them is a member's act: READ on each
        self.ctx.security.check(peer, [(READ, GROUP, g) for g in groups], "UNREGISTER_CLIENT")
        self.ctx.groups.leave(client_id)
        self.locks.release_client(client_id)
        return Reply()

    async def group_members(self, frame: Frame, peer: Peer) -> Reply:
        members = self.ctx.groups.members(need(frame.fields, "group", str))
        return Reply({"members": [m.client_id for m in members]})

    async def list_groups(self, frame: Frame, peer: Peer) -> Reply:
        groups = set(self.ctx.groups.groups()) | set(self.ctx.offsets.groups()) | set(self.ctx.kafka_groups())
        groups |= set(self.ctx.pop_groups())  # groups that pop: POP consumers, Kafka share groups
        return Reply({"groups": sorted(groups)})

    async def describe_group(self, frame: Frame, peer: Peer) -> Reply:
        group = need(frame.fields, "group", str)
        rows = []
        for (topic, qid), committed in sorted(self.ctx.offsets.of_group(group).items()):
            if self.store.queue_exists(topic, qid):
                hi = self.store.max_offset(topic, qid)
                rows.append(
                    {
                        "topic": topic,
                        "queue_id": qid,
                        "committed": committed,
                        "max_offset": hi,
                        "lag": max(0, hi - committed),
                    }
                )
        members = [
            {"client_id": m.client_id, "mode": m.mode, "topics": m.topics} for m in self.ctx.groups.members(group)
        ]
        members += [
            {"client_id": member, "mode": "kafka", "topics": [], "kafka_client_id": client}
            for member, client in sorted(self.ctx.kafka_members(group).items())
        ]
        fields: dict[str, Any] = {"queues": rows, "members": members}
        pop = self.ctx.pop_describe(group)
        if pop is not None:  # POP consumption's state of the group on this broker
            fields["pop"] = pop
        return Reply(fields)
