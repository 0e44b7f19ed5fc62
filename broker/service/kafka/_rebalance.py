"""The rebalance steps of Kafka's classic groups: prepare, complete the join, hand out assignments,
expire silent members and late syncs (Kafka's ``GroupMetadataManager``, classic part).

Plain and synchronous: each step runs to its end between two trio checkpoints, so no locks
are needed; deadlines go into a :class:`Timers` table that :mod:`._coordinator` drives.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ._group_state import (
    NONE,
    REBALANCE_IN_PROGRESS,
    Group,
    GroupSettings,
    Member,
    State,
    Timers,
    error_sync,
)

log = logging.getLogger("clmq.broker")


class Rebalancer:
    """Every classic group and the transitions between their states."""

    def __init__(self, settings: GroupSettings, now: Callable[[], float]) -> None:
        self.settings = settings
        self.now = now
        self.groups: dict[str, Group] = {}
        self.timers = Timers()

    # -- timers -------------------------------------------------------------------------

    def _after(self, key: tuple[str, ...], delay_ms: float, action: Callable[[], None]) -> None:
        self.timers.schedule(key, self.now() + delay_ms / 1000, action)

    def renew_session(self, group: Group, member: Member, timeout_ms: int | None = None) -> None:
        """(Re)start the member's session: it is removed unless heard from within the timeout."""
        gid, mid = group.group_id, member.member_id
        ms = member.session_timeout_ms if timeout_ms is None else timeout_ms
        self._after(("session", gid, mid), ms, lambda: self.expire_session(gid, mid))

    def renew_pending(self, group: Group, member_id: str, timeout_ms: int) -> None:
        """The session of an id handed out with MEMBER_ID_REQUIRED, until the member rejoins with it."""
        gid = group.group_id
        self._after(("session", gid, member_id), timeout_ms, lambda: self.expire_session(gid, member_id))

    def cancel_session(self, group: Group, member_id: str) -> None:
        self.timers.cancel(("session", group.group_id, member_id))

    def forget(self, group: Group) -> None:
        """Drop a group and every deadline that refers to it (DeleteGroups)."""
        group.transition(State.DEAD)
        del self.groups[group.group_id]
        self.timers.cancel(("join", group.group_id))
        self.timers.cancel(("sync", group.group_id))
        for mid in [*group.members, *group.pending_join]:
            self.cancel_session(group, mid)

    # -- the join phase -----------------------------------------------------------------

    def rebalance_or_complete_join(self, group: Group, reason: str) -> None:
        """A membership change: start a rebalance, or see whether the current one can finish."""
        if group.can_rebalance():
            self.prepare_rebalance(group, reason)
        else:
            self.maybe_complete_join_phase(group)

    def prepare_rebalance(self, group: Group, reason: str) -> None:
        if group.state == State.COMPLETING_REBALANCE:
            # Members parked in SyncGroup must rejoin: their generation is over.
            for member in group.members.values():
                member.assignment = b""
            self._propagate(group, REBALANCE_IN_PROGRESS)
        group.pending_sync.clear()
        self.timers.cancel(("sync", group.group_id))
        initial = group.state == State.EMPTY
        if initial:
            # A new group: give the other members of a starting application time to join.
            delay = self.settings.initial_rebalance_delay_ms
            remaining = max(group.rebalance_timeout_ms() - delay, 0)
            self._schedule_initial(group.group_id, delay, remaining)
        group.transition(State.PREPARING_REBALANCE)
        log.info(
            "Kafka group %s: preparing to rebalance (generation %d): %s", group.group_id, group.generation_id, reason
        )
        if not initial:
            if group.has_all_joined():
                self.complete_join(group)
            else:
                self._schedule_join(group, group.rebalance_timeout_ms())

    def _schedule_join(self, group: Group, delay_ms: int) -> None:
        gid = group.group_id
        self._after(("join", gid), delay_ms, lambda: self._complete_join_by_id(gid))

    def _schedule_initial(self, gid: str, delay_ms: int, remaining_ms: int) -> None:
        self._after(("join", gid), delay_ms, lambda: self._initial_delay_over(gid, delay_ms, remaining_ms))

    def _initial_delay_over(self, gid: str, delay_ms: int, remaining_ms: int) -> None:
        group = self.groups.get(gid)
        if group is None:
            return
        if group.new_member_added and remaining_ms != 0:
            # Someone joined during the delay: wait once more, within the rebalance timeout.
            group.new_member_added = False
            new_delay = min(self.settings.initial_rebalance_delay_ms, remaining_ms)
            self._schedule_initial(gid, new_delay, max(remaining_ms - delay_ms, 0))
        else:
            self.complete_join(group)

    def maybe_complete_join_phase(self, group: Group) -> None:
        """Finish the join phase once everyone rejoined (not during the initial delay)."""
        if group.state == State.PREPARING_REBALANCE and group.previous_state != State.EMPTY and group.has_all_joined():
            self.complete_join(group)

    def _complete_join_by_id(self, gid: str) -> None:
        group = self.groups.get(gid)
        if group is not None:
            self.complete_join(group)

    def complete_join(self, group: Group) -> None:
        """End the join phase: drop dynamic members that did not rejoin, start the next generation."""
        self.timers.cancel(("join", group.group_id))
        late = [m for m in group.members.values() if not m.awaiting_join and m.group_instance_id is None]
        for member in late:
            group.remove(member.member_id)
            self.cancel_session(group, member.member_id)
        if late:
            log.info(
                "Kafka group %s: removed members that did not rejoin: %s", group.group_id, [m.member_id for m in late]
            )
        if group.state == State.DEAD:
            return
        if not group.elect_joined_leader() and group.members:
            # Only static members are left and none rejoined: wait for their sessions to end.
            self._schedule_join(group, group.rebalance_timeout_ms())
            return
        group.init_next_generation()
        if group.state == State.EMPTY:
            log.info("Kafka group %s: generation %d is empty", group.group_id, group.generation_id)
            return
        log.info(
            "Kafka group %s: generation %d with %d members", group.group_id, group.generation_id, len(group.members)
        )
        self._answer_joins(group)

    def _answer_joins(self, group: Group) -> None:
        members = group.leader_members()
        for member in group.members.values():
            mine = members if member.member_id == group.leader_id else []
            group.complete_join(member, group.join_response(member.member_id, mine, group.leader_id))
            self.renew_session(group, member)
            member.is_new = False
            group.pending_sync.add(member.member_id)
        gid, generation = group.group_id, group.generation_id
        self._after(("sync", gid), group.rebalance_timeout_ms(), lambda: self._sync_expired(gid, generation))

    # -- the sync phase -----------------------------------------------------------------

    def assign(self, group: Group, assignments: dict[str, bytes]) -> None:
        """The leader's SyncGroup: every member gets its part (empty if none), the group is stable."""
        for member in group.members.values():
            member.assignment = assignments.get(member.member_id, b"")
        self._propagate(group, NONE)
        group.transition(State.STABLE)

    def _propagate(self, group: Group, error: int) -> None:
        for member in group.members.values():
            response = error_sync(error)
            if error == NONE:
                response.update(
                    protocol_type=group.protocol_type, protocol_name=group.protocol_name, assignment=member.assignment
                )
            if group.complete_sync(member, response):
                # Sessions are not checked while a member waits in SyncGroup: restart them.
                self.renew_session(group, member)

    def synced(self, group: Group, member_id: str) -> None:
        """A member sent its SyncGroup for this generation."""
        group.pending_sync.discard(member_id)
        if not group.pending_sync:
            self.timers.cancel(("sync", group.group_id))

    def _sync_expired(self, gid: str, generation: int) -> None:
        group = self.groups.get(gid)
        if group is None or group.generation_id != generation:
            return
        if group.state not in (State.COMPLETING_REBALANCE, State.STABLE) or not group.pending_sync:
            return
        late = sorted(group.pending_sync)
        for mid in late:
            group.remove(mid)
            self.cancel_session(group, mid)
        self.prepare_rebalance(group, f"members {late} did not send SyncGroup in time")

    # -- leaving ------------------------------------------------------------------------

    def expire_session(self, gid: str, member_id: str) -> None:
        """A member's session ran out: remove it unless it is parked in a rebalance step."""
        group = self.groups.get(gid)
        if group is None:
            return
        if member_id in group.pending_join:
            log.info("Kafka group %s: pending member %s expired", gid, member_id)
            group.remove(member_id)
            if group.state == State.PREPARING_REBALANCE and group.has_all_joined():
                self.complete_join(group)
            return
        member = group.members.get(member_id)
        if member is not None and not member.has_satisfied_heartbeat():
            log.info("Kafka group %s: member %s session expired", gid, member_id)
            self.remove_member(group, member, f"session of {member_id} expired")

    def remove_member(self, group: Group, member: Member, reason: str) -> None:
        """Remove a member and rebalance (or finish the rebalance it was holding up)."""
        group.remove(member.member_id)  # answers its parked requests with UNKNOWN_MEMBER_ID
        self.cancel_session(group, member.member_id)
        if group.state in (State.STABLE, State.COMPLETING_REBALANCE):
            self.rebalance_or_complete_join(group, reason)
        elif group.state == State.PREPARING_REBALANCE and group.has_all_joined():
            self.complete_join(group)

    def summary(self, group: Group) -> dict[str, Any]:
        """One group for the dashboard and the CLI."""
        return {
            "group_id": group.group_id,
            "state": group.state.value,
            "generation_id": group.generation_id,
            "protocol_type": group.protocol_type or "",
            "protocol_name": group.protocol_name or "",
            "leader": group.leader_id or "",
            "members": [
                {
                    "member_id": m.member_id,
                    "group_instance_id": m.group_instance_id,
                    "client_id": m.client_id,
                    "client_host": m.client_host,
                    "assignment": m.assignment,
                }
                for m in group.members.values()
            ],
        }
