"""SyncGroup, Heartbeat, LeaveGroup and the OffsetCommit check for Kafka's classic groups
(Kafka's ``classicGroupSync``/``Heartbeat``/``Leave`` and ``ClassicGroup.validateOffsetCommit``)."""

from __future__ import annotations

import logging
from typing import Any

from ._group_state import (
    ILLEGAL_GENERATION,
    INCONSISTENT_GROUP_PROTOCOL,
    INVALID_GROUP_ID,
    NONE,
    REBALANCE_IN_PROGRESS,
    UNKNOWN_MEMBER_ID,
    Group,
    Reply,
    State,
    error_sync,
)
from ._rebalance import Rebalancer

log = logging.getLogger("clmq.broker")

# LeaveGroup v3 names a list of members (by member id or group instance id); v0-2 one member id.
LEAVE_BATCH_VERSION = 3


def _check_member(group: Group, member_id: str, instance_id: str | None, generation_id: int) -> int:
    """The member checks shared by SyncGroup and Heartbeat: who first, then which generation."""
    error = group.validate_member(member_id, instance_id)
    if error != NONE:
        return error
    return ILLEGAL_GENERATION if generation_id != group.generation_id else NONE


def _inconsistent(asked: str | None, group_has: str | None) -> bool:
    return asked is not None and asked != group_has


def sync_group(rb: Rebalancer, body: dict[str, Any]) -> dict[str, Any] | Reply:
    """Handle one SyncGroup: park followers until the leader's assignments arrive."""
    gid = body.get("group_id") or ""
    if not gid:
        return error_sync(INVALID_GROUP_ID)
    group = rb.groups.get(gid)
    if group is None or group.state == State.EMPTY:
        return error_sync(UNKNOWN_MEMBER_ID)
    member_id = body.get("member_id") or ""
    error = _check_member(group, member_id, body.get("group_instance_id"), int(body.get("generation_id", -1)))
    if error == NONE and (
        _inconsistent(body.get("protocol_type"), group.protocol_type)
        or _inconsistent(body.get("protocol_name"), group.protocol_name)
    ):
        error = INCONSISTENT_GROUP_PROTOCOL
    if error != NONE:
        return error_sync(error)
    if group.state == State.PREPARING_REBALANCE:
        return error_sync(REBALANCE_IN_PROGRESS)
    member = group.members[member_id]
    rb.renew_session(group, member)
    rb.synced(group, member_id)
    if group.state == State.STABLE:
        response = error_sync(NONE)
        response.update(protocol_type=group.protocol_type, protocol_name=group.protocol_name)
        response["assignment"] = member.assignment
        return response
    # CompletingRebalance: a sync parked earlier by the same member is stale.
    group.complete_sync(member, error_sync(REBALANCE_IN_PROGRESS))
    reply = member.sync = Reply()
    if member_id == group.leader_id:
        log.info("Kafka group %s: assignment from leader %s for generation %d", gid, member_id, group.generation_id)
        assignments = {a["member_id"]: bytes(a.get("assignment") or b"") for a in body.get("assignments") or []}
        rb.assign(group, assignments)
    return reply


def heartbeat(rb: Rebalancer, body: dict[str, Any]) -> dict[str, Any]:
    """Handle one Heartbeat: renew the session and say whether a rebalance is going on."""
    gid = body.get("group_id") or ""
    group = rb.groups.get(gid)
    if not gid:
        error = INVALID_GROUP_ID
    elif group is None:
        error = UNKNOWN_MEMBER_ID
    else:
        member_id = body.get("member_id") or ""
        error = _check_member(group, member_id, body.get("group_instance_id"), int(body.get("generation_id", -1)))
        if error == NONE and group.state == State.EMPTY:
            error = UNKNOWN_MEMBER_ID
        elif error == NONE:
            rb.renew_session(group, group.members[member_id])
            if group.state == State.PREPARING_REBALANCE:
                error = REBALANCE_IN_PROGRESS
    return {"throttle_time_ms": 0, "error_code": error}


def leave_group(rb: Rebalancer, body: dict[str, Any], version: int) -> dict[str, Any]:
    """Handle one LeaveGroup; v3+ answers each named member, v0-2 carry its error at the top."""
    gid = body.get("group_id") or ""
    if version >= LEAVE_BATCH_VERSION:
        leaving = [(m.get("member_id") or "", m.get("group_instance_id")) for m in body.get("members") or []]
    else:
        leaving = [(body.get("member_id") or "", None)]
    group = rb.groups.get(gid)
    if not gid or group is None:
        return {"throttle_time_ms": 0, "error_code": INVALID_GROUP_ID if not gid else UNKNOWN_MEMBER_ID, "members": []}
    results = [
        {"member_id": mid, "group_instance_id": iid, "error_code": _leave_one(rb, group, mid, iid)}
        for mid, iid in leaving
    ]
    if any(r["error_code"] == NONE for r in results):
        if group.state in (State.STABLE, State.COMPLETING_REBALANCE):
            rb.rebalance_or_complete_join(group, "members left")
        elif group.state == State.PREPARING_REBALANCE:
            rb.maybe_complete_join_phase(group)
    top = results[0]["error_code"] if version < LEAVE_BATCH_VERSION else NONE
    return {"throttle_time_ms": 0, "error_code": top, "members": results}


def _leave_one(rb: Rebalancer, group: Group, member_id: str, instance_id: str | None) -> int:
    if not member_id:
        # An administrator removes a static member by its instance id alone.
        known = group.static.get(instance_id) if instance_id is not None else None
        if known is None:
            return UNKNOWN_MEMBER_ID
        member_id = known
    elif member_id in group.pending_join:
        group.remove(member_id)
        rb.cancel_session(group, member_id)
        return NONE
    else:
        error = group.validate_member(member_id, instance_id)
        if error != NONE:
            return error
    log.info("Kafka group %s: member %s leaves", group.group_id, member_id)
    group.remove(member_id)
    rb.cancel_session(group, member_id)
    return NONE


def check_commit(rb: Rebalancer, gid: str, generation_id: int, member_id: str, instance_id: str | None) -> int:
    """What an OffsetCommit by this member must answer (NONE: the commit may proceed)."""
    if not gid:
        return INVALID_GROUP_ID
    group = rb.groups.get(gid)
    if group is None:
        if generation_id >= 0:
            return ILLEGAL_GENERATION  # what Kafka answers to OffsetCommit before v9
        # A standalone consumer (or an admin) commits: Kafka creates a "simple" group for it.
        rb.groups[gid] = Group(gid)
        return NONE
    if generation_id < 0 and group.state == State.EMPTY:
        return NONE
    if generation_id >= 0 or member_id or instance_id is not None:
        error = _check_member(group, member_id, instance_id, generation_id)
        if error != NONE:
            return error
    elif group.state != State.EMPTY:
        return UNKNOWN_MEMBER_ID  # a commit without member id only while nobody is a member
    if group.state == State.COMPLETING_REBALANCE:
        # The member knows the new generation but has no assignment yet: it must sync first.
        return REBALANCE_IN_PROGRESS
    rb.renew_session(group, group.members[member_id])
    return NONE
