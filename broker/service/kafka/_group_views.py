"""DescribeGroups, ListGroups and DeleteGroups over Kafka's classic groups."""

from __future__ import annotations

import logging
from typing import Any, Callable

from ._group_state import (
    GROUP_ID_NOT_FOUND,
    GROUP_TYPE,
    INVALID_GROUP_ID,
    NON_EMPTY_GROUP,
    NONE,
    Group,
    State,
)
from ._rebalance import Rebalancer

log = logging.getLogger("clmq.broker")

# DescribeGroups' "not asked for" value of authorized operations (Kafka's INT32 minimum).
NO_AUTHORIZED_OPERATIONS = -(2**31)


def describe_groups(rb: Rebalancer, body: dict[str, Any]) -> dict[str, Any]:
    """Each asked-for group; an unknown one is reported Dead (no error), as Kafka does."""
    return {"throttle_time_ms": 0, "groups": [_describe(rb.groups.get(gid), gid) for gid in body.get("groups") or []]}


def _describe(group: Group | None, gid: str) -> dict[str, Any]:
    described: dict[str, Any] = {
        "error_code": NONE if gid else INVALID_GROUP_ID,
        "group_id": gid,
        "group_state": State.DEAD.value,
        "protocol_type": "",
        "protocol_data": "",
        "members": [],
        "authorized_operations": NO_AUTHORIZED_OPERATIONS,
    }
    if group is None:
        return described
    # Metadata and assignments mean something only once the generation's assignment is done.
    stable = group.state == State.STABLE
    described.update(
        group_state=group.state.value,
        protocol_type=group.protocol_type or "",
        protocol_data=(group.protocol_name or "") if stable else "",
        members=[
            {
                "member_id": m.member_id,
                "group_instance_id": m.group_instance_id,
                "client_id": m.client_id,
                "client_host": m.client_host,
                "member_metadata": m.metadata(group.protocol_name) if stable else b"",
                "member_assignment": m.assignment if stable else b"",
            }
            for m in group.members.values()
        ],
    )
    return described


def list_groups(rb: Rebalancer, body: dict[str, Any]) -> dict[str, Any]:
    """Every group, filtered by state (v4+, case-insensitive) and type (v5+: only "classic" here)."""
    states = {s.strip().lower() for s in body.get("states_filter") or []}
    types = {t.strip().lower() for t in body.get("types_filter") or []}
    listed = []
    if not types or GROUP_TYPE in types:
        listed = [
            {
                "group_id": g.group_id,
                "protocol_type": g.protocol_type or "",
                "group_state": g.state.value,
                "group_type": GROUP_TYPE,
            }
            for g in rb.groups.values()
            if not states or g.state.value.lower() in states
        ]
    return {"throttle_time_ms": 0, "error_code": NONE, "groups": listed}


def delete_groups(rb: Rebalancer, body: dict[str, Any], drop_offsets: Callable[[str], None]) -> dict[str, Any]:
    """Delete groups without members; their committed offsets go with them."""
    results = []
    for gid in body.get("groups_names") or []:
        group = rb.groups.get(gid)
        if not gid:
            error = INVALID_GROUP_ID
        elif group is None:
            error = GROUP_ID_NOT_FOUND
        elif group.state != State.EMPTY:
            error = NON_EMPTY_GROUP
        else:
            rb.forget(group)
            drop_offsets(gid)
            log.info("Kafka group %s deleted", gid)
            error = NONE
        results.append({"group_id": gid, "error_code": error})
    return {"throttle_time_ms": 0, "results": results}
