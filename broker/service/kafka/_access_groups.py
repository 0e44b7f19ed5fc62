"""The Kafka ACL rules of the group APIs: FindCoordinator, the group member APIs
(JoinGroup, SyncGroup, Heartbeat, LeaveGroup), OffsetCommit, OffsetFetch,
DescribeGroups, ListGroups and DeleteGroups. ``_access.KAFKA_RULES`` names each.
"""

from __future__ import annotations

from typing import Any

from clmq.protocol.kafka import KafkaRequest

from ._access_check import (
    ALLOWED,
    DELETE,
    DESCRIBE,
    GROUP,
    GROUP_DENIED,
    NO_AUTHORIZED_OPERATIONS,
    READ,
    TOPIC,
    TOPIC_DENIED,
    TXN,
    TXN_DENIED,
    Check,
    Verdict,
    in_order,
    refusal_text,
    split,
)


# ---------------------------------------------------------------- coordinator
def find_coordinator(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on the group (a transactional id: on it)."""
    body = req.body
    txn = body.get("key_type", 0) == 1
    rtype, code = (TXN, TXN_DENIED) if txn else (GROUP, GROUP_DENIED)
    if req.api_version < 4:
        key = body.get("key", "")
        if check.allowed(DESCRIBE, rtype, key):
            return ALLOWED
        answer = {"throttle_time_ms": 0, "error_code": code, "error_message": refusal_text(check, DESCRIBE, rtype, key)}
        return Verdict(answer={**answer, "node_id": -1, "host": "", "port": -1})
    keys = body.get("coordinator_keys") or []
    kept, refused = split(keys, lambda k: check.allowed(DESCRIBE, rtype, k))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = [
            *answer.get("coordinators", []),
            *(
                {
                    "key": k,
                    "node_id": -1,
                    "host": "",
                    "port": -1,
                    "error_code": code,
                    "error_message": refusal_text(check, DESCRIBE, rtype, k),
                }
                for k in refused
            ),
        ]
        answer["coordinators"] = in_order(rows, "key", keys)
        return answer

    return Verdict(body={**body, "coordinator_keys": kept}, merge=merge)


# ---------------------------------------------------------------- groups
def group_member(req: KafkaRequest, check: Check) -> Verdict:
    """JoinGroup, SyncGroup, Heartbeat, LeaveGroup: READ on the group."""
    group = req.body.get("group_id") or ""
    if check.allowed(READ, GROUP, group):
        return ALLOWED
    return Verdict(
        answer={"throttle_time_ms": 0, "error_code": GROUP_DENIED, "member_id": req.body.get("member_id") or ""}
    )


def offset_commit(req: KafkaRequest, check: Check) -> Verdict:
    """READ on the group (else every partition GROUP_AUTHORIZATION_FAILED), then READ on
    each topic (TOPIC_AUTHORIZATION_FAILED per partition)."""
    body = req.body
    topics = body.get("topics") or []

    def rows(ts: list[dict[str, Any]], code: int) -> list[dict[str, Any]]:
        return [
            {
                "name": t["name"],
                "partitions": [{"partition_index": p["partition_index"], "error_code": code} for p in t["partitions"]],
            }
            for t in ts
        ]

    if not check.allowed(READ, GROUP, body.get("group_id") or ""):
        return Verdict(answer={"throttle_time_ms": 0, "topics": rows(topics, GROUP_DENIED)})
    kept, refused = split(topics, lambda t: check.allowed(READ, TOPIC, t["name"]))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["topics"] = [*answer.get("topics", []), *rows(refused, TOPIC_DENIED)]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def offset_fetch(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on the group (GROUP_AUTHORIZATION_FAILED), then DESCRIBE on each topic
    asked (TOPIC_AUTHORIZATION_FAILED per partition); all of a group's topics: only
    those the principal may describe."""
    body = req.body
    if "groups" in body:  # v8+: several groups
        return _offset_fetch_groups(body, check)
    plan = _fetch_plan(check, body.get("group_id") or "", body.get("topics"))
    if plan is None:
        topics = [
            {
                "name": t["name"],
                "partitions": [_fetched_row(i, GROUP_DENIED) for i in t.get("partition_indexes") or []],
            }
            for t in body.get("topics") or []
        ]
        return Verdict(answer={"throttle_time_ms": 0, "error_code": GROUP_DENIED, "topics": topics})
    if plan.body is None:
        return plan
    return Verdict(body={**body, "topics": plan.body["topics"]}, merge=plan.merge)


def _offset_fetch_groups(body: dict[str, Any], check: Check) -> Verdict:
    plans: dict[str, Verdict] = {}
    denied: list[str] = []
    kept: list[dict[str, Any]] = []
    for g in body["groups"]:
        plan = _fetch_plan(check, g["group_id"], g.get("topics"))
        if plan is None:
            denied.append(g["group_id"])
            continue
        plans[g["group_id"]] = plan
        kept.append(g if plan.body is None else {**g, "topics": plan.body["topics"]})
    if not denied and all(p is ALLOWED for p in plans.values()):
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = []
        for row in answer.get("groups", []):
            plan = plans.get(row["group_id"])
            rows.append(plan.merge(row) if plan is not None and plan.merge is not None else row)
        rows += [{"group_id": g, "topics": [], "error_code": GROUP_DENIED} for g in denied]
        answer["groups"] = in_order(rows, "group_id", [g["group_id"] for g in body["groups"]])
        return answer

    return Verdict(body={**body, "groups": kept}, merge=merge)


def _fetch_plan(check: Check, group: str, topics: list[dict[str, Any]] | None) -> Verdict | None:
    """One group of an OffsetFetch: None if the group is refused; else what to take out
    (``body`` is ``{"topics": kept}``) and how to merge into the group's answer row."""
    if not check.allowed(DESCRIBE, GROUP, group):
        return None
    if topics is None:  # all the group's topics: only those the principal may describe

        def listed(row: dict[str, Any]) -> dict[str, Any]:
            row["topics"] = [t for t in row.get("topics", []) if check.allowed(DESCRIBE, TOPIC, t["name"], quiet=True)]
            return row

        return Verdict(merge=listed)
    kept, refused = split(topics, lambda t: check.allowed(DESCRIBE, TOPIC, t["name"]))
    if not refused:
        return ALLOWED

    def merge(row: dict[str, Any]) -> dict[str, Any]:
        row["topics"] = [
            *row.get("topics", []),
            *(
                {"name": t["name"], "partitions": [_fetched_row(i, TOPIC_DENIED) for i in t["partition_indexes"]]}
                for t in refused
            ),
        ]
        return row

    return Verdict(body={"topics": kept}, merge=merge)


def _fetched_row(index: int, code: int) -> dict[str, Any]:
    return {
        "partition_index": index,
        "committed_offset": -1,
        "committed_leader_epoch": -1,
        "metadata": "",
        "error_code": code,
    }


def describe_groups(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on each group."""
    body = req.body
    groups = body.get("groups") or []
    kept, refused = split(groups, lambda g: check.allowed(DESCRIBE, GROUP, g))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = [
            *answer.get("groups", []),
            *(
                {
                    "error_code": GROUP_DENIED,
                    "group_id": g,
                    "group_state": "",
                    "protocol_type": "",
                    "protocol_data": "",
                    "members": [],
                    "authorized_operations": NO_AUTHORIZED_OPERATIONS,
                }
                for g in refused
            ),
        ]
        answer["groups"] = in_order(rows, "group_id", groups)
        return answer

    return Verdict(body={**body, "groups": kept}, merge=merge)


def list_groups(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on the cluster lists every group; else only those the principal may describe."""
    if check.cluster(DESCRIBE, quiet=True):
        return ALLOWED

    def listed(answer: dict[str, Any]) -> dict[str, Any]:
        answer["groups"] = [
            g for g in answer.get("groups", []) if check.allowed(DESCRIBE, GROUP, g["group_id"], quiet=True)
        ]
        return answer

    return Verdict(merge=listed)


def delete_groups(req: KafkaRequest, check: Check) -> Verdict:
    """DELETE on each group."""
    body = req.body
    names = body.get("groups_names") or []
    kept, refused = split(names, lambda g: check.allowed(DELETE, GROUP, g))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = [*answer.get("results", []), *({"group_id": g, "error_code": GROUP_DENIED} for g in refused)]
        answer["results"] = in_order(rows, "group_id", names)
        return answer

    return Verdict(body={**body, "groups_names": kept}, merge=merge)
