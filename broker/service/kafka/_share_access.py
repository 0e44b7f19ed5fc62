"""The ACL rules of share groups (KIP-932), as Kafka's authorizer asks them: READ on the
group for ShareGroupHeartbeat, ShareFetch and ShareAcknowledge (refused whole:
GROUP_AUTHORIZATION_FAILED), and READ on each topic a ShareFetch or ShareAcknowledge
names (its partitions refused: TOPIC_AUTHORIZATION_FAILED, the others served). A
heartbeat's subscription needs DESCRIBE on each topic it names (refused whole:
TOPIC_AUTHORIZATION_FAILED)."""

from __future__ import annotations

from typing import Any

from clmq.protocol.kafka import KafkaRequest

from ._access_check import DESCRIBE, GROUP, GROUP_DENIED, READ, TOPIC, TOPIC_DENIED, Check, Verdict


def _refused(code: int, message: str) -> dict[str, Any]:
    return {
        "throttle_time_ms": 0,
        "error_code": code,
        "error_message": message,
        "acquisition_lock_timeout_ms": 0,
        "responses": [],
        "node_endpoints": [],
        "member_epoch": -1,
        "heartbeat_interval_ms": 0,
    }


def share_heartbeat(req: KafkaRequest, check: Check) -> Verdict:
    group = str(req.body.get("group_id") or "")
    if not check.allowed(READ, GROUP, group):
        return Verdict(answer={**_refused(GROUP_DENIED, f"READ on group {group!r} denied"), "member_id": None})
    for topic in req.body.get("subscribed_topic_names") or []:
        if not check.allowed(DESCRIBE, TOPIC, topic):
            return Verdict(answer={**_refused(TOPIC_DENIED, f"DESCRIBE on topic {topic!r} denied"), "member_id": None})
    return Verdict()


def share_read(req: KafkaRequest, check: Check) -> Verdict:
    """ShareFetch and ShareAcknowledge: READ on the group, READ on each topic named."""
    body = req.body
    group = str(body.get("group_id") or "")
    if not check.allowed(READ, GROUP, group):
        return Verdict(answer=_refused(GROUP_DENIED, f"READ on group {group!r} denied"))
    kept: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for t in body.get("topics", []):
        name = check.topic_name(t["topic_id"])
        (kept if name is None or check.allowed(READ, TOPIC, name) else refused).append(t)
    if not refused:
        return Verdict()

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = [
            {
                "topic_id": t["topic_id"],
                "partitions": [
                    {
                        "partition_index": p["partition_index"],
                        "error_code": TOPIC_DENIED,
                        "acknowledge_error_code": TOPIC_DENIED,
                    }
                    for p in t.get("partitions", [])
                ],
            }
            for t in refused
        ]
        answer["responses"] = [*answer.get("responses", []), *rows]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)
