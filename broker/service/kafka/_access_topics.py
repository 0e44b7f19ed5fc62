"""The Kafka ACL rules of the topic APIs: Produce, InitProducerId, Fetch, ListOffsets,
OffsetForLeaderEpoch, Metadata, DescribeCluster, CreateTopics, DeleteTopics,
CreatePartitions, DescribeConfigs and the ACL APIs (DescribeAcls, CreateAcls,
DeleteAcls). ``_access.KAFKA_RULES`` names each.
"""

from __future__ import annotations

from typing import Any

from clmq.protocol.auth import CLUSTER_NAME, Operation
from clmq.protocol.kafka import ErrorCode, KafkaRequest

from ._access_check import (
    ALLOWED,
    ALTER,
    CLUSTER,
    CLUSTER_DENIED,
    CREATE,
    DELETE,
    DESCRIBE,
    READ,
    RESOURCE_BROKER,
    RESOURCE_TOPIC,
    TOPIC,
    TOPIC_DENIED,
    TXN,
    TXN_DENIED,
    WRITE,
    ZERO_UUID,
    Check,
    Verdict,
    in_order,
    refusal_text,
    split,
    topic_name_of,
)


# ---------------------------------------------------------------- producing
def produce(req: KafkaRequest, check: Check) -> Verdict:
    """WRITE on each topic; a transactional produce WRITE on its transactional id.
    Never refused whole: the handler runs (with no topics, if need be) so that the
    connection's later produce requests keep their turns."""
    body = req.body
    topics = body.get("topic_data") or []
    txn = body.get("transactional_id")
    kept: list[Any]
    if txn is not None and not check.allowed(WRITE, TXN, txn):
        kept, refused, code = [], list(topics), TXN_DENIED
    else:
        kept, refused = split(topics, lambda t: check.allowed(WRITE, TOPIC, t["name"]))
        code = TOPIC_DENIED
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["responses"] = [*answer.get("responses", []), *(_produce_refused(check, t, code) for t in refused)]
        return answer

    return Verdict(body={**body, "topic_data": kept}, merge=merge)


def _produce_refused(check: Check, topic: dict[str, Any], code: int) -> dict[str, Any]:
    """A refused topic's row of the Produce answer: ``code`` for each of its partitions."""
    return {
        "name": topic["name"],
        "partition_responses": [
            {
                "index": p["index"],
                "error_code": code,
                "base_offset": -1,
                "log_append_time_ms": -1,
                "log_start_offset": -1,
                "record_errors": [],
                "error_message": refusal_text(check, WRITE, TOPIC, topic["name"]),
            }
            for p in topic.get("partition_data") or []
        ],
    }


def init_producer_id(req: KafkaRequest, check: Check) -> Verdict:
    """A transactional id: WRITE on it. An idempotent producer: IDEMPOTENT_WRITE on the
    cluster, or WRITE on any topic (Kafka 3's rule, KIP-679)."""
    txn = req.body.get("transactional_id")
    if txn is not None:
        if check.allowed(WRITE, TXN, txn):
            return ALLOWED
        return Verdict(
            answer={"throttle_time_ms": 0, "error_code": TXN_DENIED, "producer_id": -1, "producer_epoch": -1}
        )
    if check.cluster(Operation.IDEMPOTENT_WRITE, quiet=True) or check.any_topic(WRITE):
        return ALLOWED
    check.deny(Operation.IDEMPOTENT_WRITE, CLUSTER, CLUSTER_NAME)
    return Verdict(
        answer={"throttle_time_ms": 0, "error_code": CLUSTER_DENIED, "producer_id": -1, "producer_epoch": -1}
    )


# ---------------------------------------------------------------- reading
def fetch(req: KafkaRequest, check: Check) -> Verdict:
    """READ on each topic (TOPIC_AUTHORIZATION_FAILED per partition); a follower's fetch
    (replica id >= 0) CLUSTER_ACTION on the cluster."""
    body = req.body
    if body.get("replica_id", -1) >= 0 and not check.cluster(Operation.CLUSTER_ACTION):
        return Verdict(answer={"throttle_time_ms": 0, "error_code": CLUSTER_DENIED, "session_id": 0, "responses": []})
    kept: list[dict[str, Any]] = []
    refused: list[tuple[dict[str, Any], str, int]] = []
    for t in body.get("topics") or []:
        name = topic_name_of(check, t, "topic")
        if name is None:
            refused.append((t, "", ErrorCode.UNKNOWN_TOPIC_ID))
        elif not check.allowed(READ, TOPIC, name):
            refused.append((t, name, TOPIC_DENIED))
        else:
            kept.append(t)
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["responses"] = [*answer.get("responses", []), *(_fetch_refused(*r) for r in refused)]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def _fetch_refused(topic: dict[str, Any], name: str, code: int) -> dict[str, Any]:
    """A refused topic's row of the Fetch answer: ``code`` for each of its partitions."""
    return {
        "topic": name,
        "topic_id": topic.get("topic_id") or ZERO_UUID,
        "partitions": [
            {
                "partition_index": p["partition"],
                "error_code": code,
                "high_watermark": -1,
                "last_stable_offset": -1,
                "log_start_offset": -1,
                "aborted_transactions": None,
                "preferred_read_replica": -1,
                "records": b"",
            }
            for p in topic.get("partitions") or []
        ],
    }


def list_offsets(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on each topic."""
    body = req.body
    kept, refused = split(body.get("topics") or [], lambda t: check.allowed(DESCRIBE, TOPIC, t["name"]))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["topics"] = [
            *answer.get("topics", []),
            *(
                {
                    "name": t["name"],
                    "partitions": [
                        {
                            "partition_index": p["partition_index"],
                            "error_code": TOPIC_DENIED,
                            "timestamp": -1,
                            "offset": -1,
                            "leader_epoch": -1,
                            "old_style_offsets": [],
                        }
                        for p in t.get("partitions") or []
                    ],
                }
                for t in refused
            ),
        ]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def offset_for_leader_epoch(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on each topic."""
    body = req.body
    kept, refused = split(body.get("topics") or [], lambda t: check.allowed(DESCRIBE, TOPIC, t["topic"]))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["topics"] = [
            *answer.get("topics", []),
            *(
                {
                    "topic": t["topic"],
                    "partitions": [
                        {"error_code": TOPIC_DENIED, "partition": p["partition"], "leader_epoch": -1, "end_offset": -1}
                        for p in t.get("partitions") or []
                    ],
                }
                for t in refused
            ),
        ]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


# ---------------------------------------------------------------- metadata
def metadata(req: KafkaRequest, check: Check) -> Verdict:
    """Every topic: only those the principal may DESCRIBE are listed. Topics by name (or
    id): TOPIC_AUTHORIZATION_FAILED for those it may not. Auto-creation needs CREATE on
    the cluster or on each missing topic: without it for every topic asked, none is
    created (they are answered UNKNOWN_TOPIC_OR_PARTITION)."""
    body = req.body
    asked = body.get("topics")
    if asked is None or (req.api_version == 0 and not asked):  # every topic (v0: an empty list)
        return _metadata_listed(check)

    def name_of(t: dict[str, Any]) -> str | None:
        return topic_name_of(check, t, "name")

    kept: list[dict[str, Any]] = []
    refused: list[tuple[dict[str, Any], int]] = []
    for t in asked:
        name = name_of(t)
        if name is None:
            refused.append((t, ErrorCode.UNKNOWN_TOPIC_ID))
        elif not check.allowed(DESCRIBE, TOPIC, name):
            refused.append((t, TOPIC_DENIED))
        else:
            kept.append(t)
    auto = bool(body.get("allow_auto_topic_creation", True))
    if auto and kept and not check.cluster(CREATE, quiet=True):
        auto = all(check.allowed(CREATE, TOPIC, n, quiet=True) for t in kept if (n := name_of(t)) is not None)
    if not refused and auto == bool(body.get("allow_auto_topic_creation", True)):
        return ALLOWED
    order = [name_of(t) for t in asked]

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = [*answer.get("topics", []), *(_metadata_refused(t, code, req.api_version) for t, code in refused)]
        answer["topics"] = in_order(rows, "name", order)
        return answer

    return Verdict(body={**body, "topics": kept, "allow_auto_topic_creation": auto}, merge=merge)


def _metadata_listed(check: Check) -> Verdict:
    """Metadata of every topic: the answer lists only the topics the principal may describe."""

    def listed(answer: dict[str, Any]) -> dict[str, Any]:
        answer["topics"] = [
            t for t in answer.get("topics", []) if check.allowed(DESCRIBE, TOPIC, t["name"], quiet=True)
        ]
        return answer

    return Verdict(merge=listed)


def _metadata_refused(topic: dict[str, Any], code: int, version: int) -> dict[str, Any]:
    """A refused topic's row of the Metadata answer (one asked by id has no name: ``""`` before v12)."""
    return {
        "error_code": code,
        "name": topic["name"] if topic.get("name") is not None else ("" if version < 12 else None),
        "topic_id": topic.get("topic_id") or ZERO_UUID,
        "is_internal": False,
        "partitions": [],
    }


def describe_cluster(req: KafkaRequest, check: Check) -> Verdict:
    if check.cluster(DESCRIBE):
        return ALLOWED
    text = refusal_text(check, DESCRIBE, CLUSTER)
    return Verdict(answer={"throttle_time_ms": 0, "error_code": CLUSTER_DENIED, "error_message": text})


# ---------------------------------------------------------------- topics
def create_topics(req: KafkaRequest, check: Check) -> Verdict:
    """CREATE on the cluster, or on each topic."""
    body = req.body
    topics = body.get("topics") or []
    if check.cluster(CREATE, quiet=True):
        for t in topics:
            check.admin(CREATE, TOPIC, t["name"])
        return ALLOWED
    kept, refused = split(topics, lambda t: check.allowed(CREATE, TOPIC, t["name"]))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = [
            *answer.get("topics", []),
            *(
                {
                    "name": t["name"],
                    "error_code": TOPIC_DENIED,
                    "error_message": refusal_text(check, CREATE, TOPIC, t["name"]),
                    "num_partitions": -1,
                    "replication_factor": -1,
                    "configs": [],
                }
                for t in refused
            ),
        ]
        answer["topics"] = in_order(rows, "name", [t["name"] for t in topics])
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def delete_topics(req: KafkaRequest, check: Check) -> Verdict:
    """DELETE on each topic (named, or by id from v6)."""
    body = req.body
    by_name = body.get("topic_names")
    entries: list[Any] = list(by_name) if by_name is not None else list(body.get("topics") or [])

    def name_of(e: Any) -> str | None:
        return e if isinstance(e, str) else topic_name_of(check, e, "name")

    kept: list[Any] = []
    refused: list[tuple[Any, int]] = []
    for e in entries:
        name = name_of(e)
        if name is None:
            refused.append((e, ErrorCode.UNKNOWN_TOPIC_ID))
        elif not check.allowed(DELETE, TOPIC, name):
            refused.append((e, TOPIC_DENIED))
        else:
            kept.append(e)
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["responses"] = [
            *answer.get("responses", []),
            *(
                {
                    "name": name_of(e),
                    "topic_id": ZERO_UUID if isinstance(e, str) else e.get("topic_id") or ZERO_UUID,
                    "error_code": code,
                    "error_message": refusal_text(check, DELETE, TOPIC, name_of(e) or ""),
                }
                for e, code in refused
            ),
        ]
        return answer

    key = "topic_names" if by_name is not None else "topics"
    return Verdict(body={**body, key: kept}, merge=merge)


def create_partitions(req: KafkaRequest, check: Check) -> Verdict:
    """ALTER on each topic."""
    body = req.body
    kept, refused = split(body.get("topics") or [], lambda t: check.allowed(ALTER, TOPIC, t["name"]))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["results"] = [
            *answer.get("results", []),
            *(
                {
                    "name": t["name"],
                    "error_code": TOPIC_DENIED,
                    "error_message": refusal_text(check, ALTER, TOPIC, t["name"]),
                }
                for t in refused
            ),
        ]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def describe_configs(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE_CONFIGS on each topic (TOPIC_AUTHORIZATION_FAILED) or on the cluster for
    a broker (CLUSTER_AUTHORIZATION_FAILED)."""
    body = req.body
    resources = body.get("resources") or []
    op = Operation.DESCRIBE_CONFIGS

    def ok(r: dict[str, Any]) -> bool:
        if r["resource_type"] == RESOURCE_TOPIC:
            return check.allowed(op, TOPIC, r["resource_name"])
        if r["resource_type"] == RESOURCE_BROKER:
            return check.cluster(op)
        return True  # the handler refuses the other types

    kept, refused = split(resources, ok)
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = list(answer.get("results", []))
        for r in refused:
            topic = r["resource_type"] == RESOURCE_TOPIC
            rows.append(
                {
                    "error_code": TOPIC_DENIED if topic else CLUSTER_DENIED,
                    "error_message": refusal_text(
                        check, op, TOPIC if topic else CLUSTER, r["resource_name"] if topic else ""
                    ),
                    "resource_type": r["resource_type"],
                    "resource_name": r["resource_name"],
                    "configs": [],
                }
            )
        rank = {(r["resource_type"], r["resource_name"]): i for i, r in enumerate(resources)}
        answer["results"] = sorted(rows, key=lambda r: rank.get((r["resource_type"], r["resource_name"]), len(rank)))
        return answer

    return Verdict(body={**body, "resources": kept}, merge=merge)


# ---------------------------------------------------------------- ACLs
def describe_acls(req: KafkaRequest, check: Check) -> Verdict:
    if check.cluster(DESCRIBE):
        return ALLOWED
    text = refusal_text(check, DESCRIBE, CLUSTER)
    return Verdict(answer={"throttle_time_ms": 0, "error_code": CLUSTER_DENIED, "error_message": text, "resources": []})


def create_acls(req: KafkaRequest, check: Check) -> Verdict:
    if check.cluster(ALTER):
        return ALLOWED
    text = refusal_text(check, ALTER, CLUSTER)
    results = [{"error_code": CLUSTER_DENIED, "error_message": text} for _c in req.body.get("creations") or []]
    return Verdict(answer={"throttle_time_ms": 0, "results": results})


def delete_acls(req: KafkaRequest, check: Check) -> Verdict:
    if check.cluster(ALTER):
        return ALLOWED
    text = refusal_text(check, ALTER, CLUSTER)
    rows = [
        {"error_code": CLUSTER_DENIED, "error_message": text, "matching_acls": []}
        for _f in req.body.get("filters") or []
    ]
    return Verdict(answer={"throttle_time_ms": 0, "filter_results": rows})
