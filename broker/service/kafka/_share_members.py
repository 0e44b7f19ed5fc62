"""Share group membership (KIP-932's ShareGroupHeartbeat) on the group's coordinator.

A member joins with epoch 0 (the Java client names its own member id; one is made for
a client that sends none), heartbeats every ``kafka_share_heartbeat_interval_ms`` and
leaves with epoch -1 or by falling silent for ``kafka_share_session_timeout_ms``. The
assignment is the simplest one that is right for work-queue semantics: every member
gets every partition of the topics it subscribes to (many members read one partition;
the POP state decides who gets which message). A member's epoch rises whenever its
assignment changes (a topic created or grown); the assignment is sent when the
member's epoch is not the current one, else null (unchanged).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from clmq.protocol.kafka import ErrorCode

from ._cluster import ClusterView
from ._metadata import topic_id

Assignment = tuple[tuple[str, tuple[int, ...]], ...]  # (topic, partitions), sorted


@dataclass
class ShareMember:
    """One member of a share group as its coordinator knows it."""

    member_id: str
    epoch: int = 0
    topics: tuple[str, ...] = ()
    assignment: Assignment = ()
    seen: float = field(default_factory=time.monotonic)


class ShareGroups:
    """The share groups this broker coordinates: members, subscriptions, assignments."""

    def __init__(self, interval_ms: int, timeout_ms: int, cluster: str, on_leave: Callable[[str, str], None]) -> None:
        self.interval_ms = interval_ms
        self.timeout_ms = timeout_ms
        self.cluster = cluster
        self.on_leave = on_leave  # (group, member id): the member left or timed out
        self.groups: dict[str, dict[str, ShareMember]] = {}

    def members(self, group: str) -> list[str]:
        """The member ids of ``group`` (after dropping the silent ones)."""
        self.expire()
        return sorted(self.groups.get(group, {}))

    def expire(self) -> None:
        """Members silent past the session timeout leave their groups."""
        limit = time.monotonic() - self.timeout_ms / 1000
        for group, members in list(self.groups.items()):
            for mid in [m for m, member in members.items() if member.seen < limit]:
                del members[mid]
                self.on_leave(group, mid)
            if not members:
                del self.groups[group]

    def heartbeat(self, body: dict[str, Any], view: ClusterView) -> dict[str, Any]:
        """One ShareGroupHeartbeat: join (epoch 0), stay (epoch > 0) or leave (epoch -1)."""
        self.expire()
        group, mid, epoch = str(body.get("group_id") or ""), str(body.get("member_id") or ""), body["member_epoch"]
        if not group:
            return self._answer(ErrorCode.INVALID_REQUEST, mid, -1, "a share group needs a group id")
        members = self.groups.setdefault(group, {})
        if epoch == -1:
            if members.pop(mid, None) is not None:
                self.on_leave(group, mid)
            return self._answer(ErrorCode.NONE, mid, -1)
        member = members.get(mid)
        if epoch == 0:
            mid = mid or uuid.uuid4().hex
            member = members.setdefault(mid, ShareMember(mid))
        elif member is None:
            return self._answer(ErrorCode.UNKNOWN_MEMBER_ID, mid, -1, f"member {mid!r} is not in share group {group!r}")
        elif epoch > member.epoch:
            return self._answer(ErrorCode.FENCED_MEMBER_EPOCH, mid, -1, f"epoch {epoch} is ahead of {member.epoch}")
        member.seen = time.monotonic()
        if body.get("subscribed_topic_names") is not None:
            member.topics = tuple(sorted(set(body["subscribed_topic_names"])))
        assignment = tuple((t, tuple(range(len(view.topics[t])))) for t in member.topics if t in view.topics)
        if assignment != member.assignment or member.epoch == 0:
            member.assignment, member.epoch = assignment, member.epoch + 1
        answer = self._answer(ErrorCode.NONE, mid, member.epoch)
        if epoch != member.epoch:
            answer["assignment"] = {
                "topic_partitions": [
                    {"topic_id": topic_id(self.cluster, t), "partitions": list(parts)} for t, parts in assignment
                ]
            }
        return answer

    def _answer(self, code: int, mid: str, epoch: int, message: str | None = None) -> dict[str, Any]:
        return {
            "throttle_time_ms": 0,
            "error_code": code,
            "error_message": message,
            "member_id": mid or None,
            "member_epoch": epoch,
            "heartbeat_interval_ms": self.interval_ms,
            "assignment": None,
        }
