"""JoinGroup for Kafka's classic groups (Kafka's ``classicGroupJoin*``): who may join, with which
member id, and whether the join triggers a rebalance, finishes one, or is answered at once.

Each function returns either the response or a :class:`Reply` that a later step completes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ._group_state import (
    GROUP_MAX_SIZE_REACHED,
    INCONSISTENT_GROUP_PROTOCOL,
    INVALID_GROUP_ID,
    INVALID_SESSION_TIMEOUT,
    MEMBER_ID_REQUIRED,
    NONE,
    UNKNOWN_MEMBER_ID,
    Group,
    Member,
    Protocols,
    Reply,
    State,
    error_join,
    new_member_id,
)
from ._rebalance import Rebalancer

log = logging.getLogger("clmq.broker")

# From JoinGroup v4 a new member first gets its id (MEMBER_ID_REQUIRED) and joins again with it.
KNOWN_MEMBER_ID_VERSION = 4
# From v9 a static member replacing itself in a stable group may be told to skip the assignment.
SKIP_ASSIGNMENT_VERSION = 9

Outcome = dict[str, Any] | Reply


@dataclass(frozen=True)
class Join:
    """A JoinGroup request with Kafka's defaults for the fields its version lacks."""

    group_id: str
    member_id: str
    group_instance_id: str | None
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocol_type: str
    protocols: Protocols
    reason: str
    version: int
    client_id: str
    client_host: str

    @classmethod
    def parse(cls, body: dict[str, Any], version: int, client_id: str, client_host: str) -> Join:
        session = int(body.get("session_timeout_ms", 0))
        rebalance = int(body.get("rebalance_timeout_ms", -1))
        return cls(
            group_id=body.get("group_id") or "",
            member_id=body.get("member_id") or "",
            group_instance_id=body.get("group_instance_id"),
            session_timeout_ms=session,
            # v0 has no rebalance timeout: Kafka uses the session timeout for both.
            rebalance_timeout_ms=rebalance if rebalance >= 0 else session,
            protocol_type=body.get("protocol_type") or "",
            protocols=[(p["name"], bytes(p.get("metadata") or b"")) for p in body.get("protocols") or []],
            reason=body.get("reason") or "not provided",
            version=version,
            client_id=client_id,
            client_host=client_host,
        )


def join_group(rb: Rebalancer, req: Join) -> Outcome:
    """Handle one JoinGroup (the native-members check is the caller's)."""
    if not req.group_id:
        return error_join(INVALID_GROUP_ID, req.member_id)
    bounds = rb.settings
    if not bounds.min_session_timeout_ms <= req.session_timeout_ms <= bounds.max_session_timeout_ms:
        return error_join(INVALID_SESSION_TIMEOUT, req.member_id)
    group = rb.groups.get(req.group_id)
    created = group is None
    if group is None:
        if req.member_id:
            # A member id for a group that is gone: the client must start over.
            return error_join(UNKNOWN_MEMBER_ID, req.member_id)
        group = rb.groups[req.group_id] = Group(req.group_id)
    if not _accepts(rb, group, req.member_id):
        group.remove(req.member_id)
        outcome: Outcome = error_join(GROUP_MAX_SIZE_REACHED)
    elif not req.member_id:
        outcome = _join_new(rb, group, req)
    else:
        outcome = _join_known(rb, group, req)
    if created and not group.members and not group.pending_join:
        # A refused first join leaves nothing behind (Kafka would keep an empty group record).
        del rb.groups[group.group_id]
    return outcome


def _accepts(rb: Rebalancer, group: Group, member_id: str) -> bool:
    """Kafka's acceptJoiningMember: known members always, new ones up to the size limit."""
    limit = rb.settings.max_group_size
    if group.state == State.EMPTY:
        return True
    if group.state == State.PREPARING_REBALANCE:
        # Counting the members already rejoined lets the last rejoiners be the ones refused
        # when the limit was lowered below the group's size.
        known = member_id in group.members and group.members[member_id].awaiting_join
        return known or group.num_awaiting_join() < limit
    return member_id in group.members or len(group.members) < limit


def _join_new(rb: Rebalancer, group: Group, req: Join) -> Outcome:
    if not group.supports_protocols(req.protocol_type, req.protocols):
        return error_join(INCONSISTENT_GROUP_PROTOCOL)
    member_id = new_member_id(req.client_id, req.group_instance_id)
    if req.group_instance_id is not None:
        known = group.static.get(req.group_instance_id)
        if known is not None:
            log.info(
                "Kafka group %s: static member %s rejoins as %s, replacing %s",
                group.group_id,
                req.group_instance_id,
                member_id,
                known,
            )
            return _replace_static(rb, group, req, known, member_id)
        return _add_member(rb, group, req, member_id)
    if req.version >= KNOWN_MEMBER_ID_VERSION:
        group.pending_join.add(member_id)
        rb.renew_pending(group, member_id, req.session_timeout_ms)
        return error_join(MEMBER_ID_REQUIRED, member_id)
    return _add_member(rb, group, req, member_id)


def _join_known(rb: Rebalancer, group: Group, req: Join) -> Outcome:
    if not group.supports_protocols(req.protocol_type, req.protocols):
        return error_join(INCONSISTENT_GROUP_PROTOCOL, req.member_id)
    if req.member_id in group.pending_join and req.group_instance_id is None:
        return _add_member(rb, group, req, req.member_id)
    error = group.validate_member(req.member_id, req.group_instance_id)
    if error != NONE:
        return error_join(error, req.member_id)
    member = group.members[req.member_id]
    if group.state == State.PREPARING_REBALANCE:
        return _update_member(rb, group, member, req, "member rejoins during the rebalance")
    if group.state == State.COMPLETING_REBALANCE and member.matches(req.protocols):
        # The member missed its JoinGroup response: send it again.
        rb.renew_session(group, member)
        mine = group.leader_members() if req.member_id == group.leader_id else []
        return group.join_response(req.member_id, mine, group.leader_id)
    if group.state == State.STABLE and req.member_id != group.leader_id and member.matches(req.protocols):
        # A follower with unchanged metadata: nothing to rebalance, just the generation again.
        rb.renew_session(group, member)
        return group.join_response(req.member_id, [], group.leader_id)
    if group.state in (State.COMPLETING_REBALANCE, State.STABLE):
        # The leader's rejoin asks for a rebalance on purpose (e.g. topic metadata changed).
        return _update_member(rb, group, member, req, "member rejoins with new metadata, or the leader rejoins")
    return error_join(UNKNOWN_MEMBER_ID, req.member_id)


def _add_member(rb: Rebalancer, group: Group, req: Join, member_id: str) -> Reply:
    member = Member(
        member_id,
        req.group_instance_id,
        req.client_id,
        req.client_host,
        req.rebalance_timeout_ms,
        req.session_timeout_ms,
        req.protocol_type,
        req.protocols,
        is_new=True,
    )
    if group.state == State.PREPARING_REBALANCE and group.previous_state == State.EMPTY:
        group.new_member_added = True
    reply = Reply()
    group.add(member, reply)
    # A new member cannot heartbeat while its join is parked: bound the wait on its own.
    rb.renew_session(group, member, rb.settings.new_member_join_timeout_ms)
    rb.rebalance_or_complete_join(group, f"new member {member_id} joins; client reason: {req.reason}")
    return reply


def _update_member(rb: Rebalancer, group: Group, member: Member, req: Join, why: str) -> Reply:
    reply = Reply()
    group.update_member(member, req.protocols, req.rebalance_timeout_ms, req.session_timeout_ms, reply)
    rb.rebalance_or_complete_join(group, f"{why} ({member.member_id}); client reason: {req.reason}")
    return reply


def _replace_static(rb: Rebalancer, group: Group, req: Join, old_id: str, new_id: str) -> Outcome:
    """A static member restarted: its new id replaces the old one, without a rebalance if stable."""
    old_leader = group.leader_id
    member = group.replace_static(req.group_instance_id or "", old_id, new_id)
    rb.cancel_session(group, old_id)
    rb.renew_session(group, member)
    reply = Reply()
    group.update_member(member, req.protocols, req.rebalance_timeout_ms, req.session_timeout_ms, reply)
    reason = f"static member {req.group_instance_id} rejoins as {new_id}; client reason: {req.reason}"
    if group.state == State.STABLE:
        if group.protocol_name != group.select_protocol():
            rb.rebalance_or_complete_join(group, reason + " with other protocols")
            return reply
        if req.version >= SKIP_ASSIGNMENT_VERSION:
            leads = new_id == group.leader_id
            response = group.join_response(new_id, group.leader_members() if leads else [], group.leader_id)
            response["skip_assignment"] = leads
        else:
            # Older clients would start assigning if told they lead: keep the old leader's id.
            response = group.join_response(new_id, [], old_leader)
        group.complete_join(member, response)
        return reply
    if group.state == State.COMPLETING_REBALANCE:
        # The leader may already be assigning to the old id: rebalance so the new id gets a part.
        rb.prepare_rebalance(group, reason)
        return reply
    rb.maybe_complete_join_phase(group)
    return reply
