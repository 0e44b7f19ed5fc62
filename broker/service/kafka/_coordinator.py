"""Kafka's classic group coordinator for clmq's Kafka listener: the trio side.

The group rules are plain synchronous code (:mod:`._rebalance`, :mod:`._group_join`,
:mod:`._group_calls`, :mod:`._group_views`); here a parked JoinGroup or SyncGroup waits on
a trio event, and :meth:`KafkaGroups.run` fires the deadlines (sessions, rebalance
timeouts, the initial delay). All clocks are ``trio.current_time()``, so a test's
``MockClock`` makes every timeout instant.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import trio

from ._group_calls import check_commit, heartbeat, leave_group, sync_group
from ._group_join import Join, join_group
from ._group_state import INCONSISTENT_GROUP_PROTOCOL, GroupSettings, Reply, error_join
from ._group_views import delete_groups, describe_groups, list_groups
from ._rebalance import Rebalancer

__all__ = ["GroupSettings", "KafkaGroups"]

log = logging.getLogger("clmq.broker")

# JoinGroup's protocol name became nullable in v7; older versions must get a string.
NULLABLE_PROTOCOL_NAME_VERSION = 7


class KafkaGroups:
    """Kafka classic consumer groups (JoinGroup, SyncGroup, Heartbeat, LeaveGroup, Describe/List/Delete).

    ``native_members(group_id)`` counts the live members clmq's own consumers have in a group
    of that name: the two kinds share one namespace, so a Kafka join is refused while native
    members exist (and :meth:`has_members` lets the native side refuse the other way).
    ``drop_offsets(group_id)`` forgets a deleted group's committed offsets.
    """

    def __init__(
        self, settings: GroupSettings, native_members: Callable[[str], int], drop_offsets: Callable[[str], None]
    ) -> None:
        self._rb = Rebalancer(settings, trio.current_time)
        self._native_members = native_members
        self._drop_offsets = drop_offsets
        self._wake: trio.Event | None = None
        self._rb.timers.on_sooner = self._on_sooner

    def _on_sooner(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fire session expiries and rebalance deadlines; runs until cancelled."""
        task_status.started()
        timers = self._rb.timers
        while True:
            self._wake = trio.Event()
            deadline = timers.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._wake.wait()
            while (action := timers.pop_due(trio.current_time())) is not None:
                try:
                    action()
                except Exception:
                    # A bug in one group's step must not stop every other group's timers.
                    log.exception("Kafka group coordinator: a timer failed")

    async def join_group(self, body: dict[str, Any], version: int, client_id: str, client_host: str) -> dict[str, Any]:
        """JoinGroup; parks until the rebalance completes (all members rejoined, or its timeout)."""
        await trio.lowlevel.checkpoint()
        gid = body.get("group_id") or ""
        if gid and self._native_members(gid) > 0:
            log.info("Kafka group %s: JoinGroup refused, clmq's native consumers are members of that group", gid)
            response = error_join(INCONSISTENT_GROUP_PROTOCOL, body.get("member_id") or "")
        else:
            response = await _wait(join_group(self._rb, Join.parse(body, version, client_id, client_host)))
        if version < NULLABLE_PROTOCOL_NAME_VERSION and response.get("protocol_name") is None:
            response = {**response, "protocol_name": ""}
        return response

    async def sync_group(self, body: dict[str, Any], version: int) -> dict[str, Any]:
        """SyncGroup; followers park until the leader's SyncGroup brings the assignments."""
        await trio.lowlevel.checkpoint()
        return await _wait(sync_group(self._rb, body))

    async def heartbeat(self, body: dict[str, Any], version: int) -> dict[str, Any]:
        """Heartbeat: renews the member's session; REBALANCE_IN_PROGRESS asks it to rejoin."""
        await trio.lowlevel.checkpoint()
        return heartbeat(self._rb, body)

    async def leave_group(self, body: dict[str, Any], version: int) -> dict[str, Any]:
        """LeaveGroup (one member before v3, a list from v3); the rest of the group rebalances."""
        await trio.lowlevel.checkpoint()
        return leave_group(self._rb, body, version)

    def describe_groups(self, body: dict[str, Any], version: int) -> dict[str, Any]:
        """DescribeGroups: state, protocol and members (metadata and assignment once Stable)."""
        return describe_groups(self._rb, body)

    def list_groups(self, body: dict[str, Any], version: int) -> dict[str, Any]:
        """ListGroups, with the states (v4+) and types (v5+) filters."""
        return list_groups(self._rb, body)

    def delete_groups(self, body: dict[str, Any], version: int) -> dict[str, Any]:
        """DeleteGroups: only groups without members; their offsets are dropped too."""
        return delete_groups(self._rb, body, self._drop_offsets)

    def check_commit(self, group_id: str, generation_id: int, member_id: str, group_instance_id: str | None) -> int:
        """The error an OffsetCommit must answer for this member (0: commit); renews its session."""
        return check_commit(self._rb, group_id, generation_id, member_id, group_instance_id)

    def has_members(self, group_id: str) -> bool:
        """Whether Kafka clients are members (or about to be) of the group: native joins must wait."""
        group = self._rb.groups.get(group_id)
        return group is not None and bool(group.members or group.pending_join)

    def groups(self) -> list[dict[str, Any]]:
        """Every group for the dashboard and the CLI: id, state, protocol, members and assignments."""
        return [self._rb.summary(g) for g in self._rb.groups.values()]


async def _wait(outcome: dict[str, Any] | Reply) -> dict[str, Any]:
    """The response now, or once a later step completes the reply (callers checkpoint before
    changing state, so a response that is ready is never lost to a cancellation).

    If the caller is cancelled here (its connection closed) the reply stays with the member:
    the group goes on as if the client were slow, and its session or the rebalance timeout
    ends it, as in Kafka.
    """
    if isinstance(outcome, dict):
        return outcome
    if outcome.response is None:
        done = trio.Event()
        outcome.notify = done.set
        await done.wait()
    assert outcome.response is not None
    return outcome.response
