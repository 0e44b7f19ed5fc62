"""What every Kafka API needs of the ACLs, asked as Kafka's own authorizer asks it
(``kafka.server.KafkaApis``), before the handler does anything.

A *rule* reads a request and answers a :class:`Verdict`: the request refused whole
(the answer Kafka gives, e.g. GROUP_AUTHORIZATION_FAILED to a JoinGroup), or the
request as the handler may see it, the refused parts taken out (a Produce's topics
without WRITE), and how to put the refused parts' errors into the handler's answer
(TOPIC_AUTHORIZATION_FAILED per partition). Lists are filtered the way Kafka filters
them: Metadata of every topic lists only the topics the principal may describe,
ListGroups only its groups. Every denial is counted (``clmq_requests_denied_total``)
and audited; admin actions allowed are audited too.

``KAFKA_RULES`` has a rule for every API the listener serves: :func:`guard_all`
refuses to build a handler table with an API missing (``tests/test_kafka_security.py``
checks it against the service's table), so a new API cannot be served without
deciding its ACL. docs/security-kafka.md has the table in words.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

from clmq.protocol.auth import CLUSTER_NAME, WILDCARD, Operation, PatternType, Permission, ResourceType
from clmq.protocol.kafka import ApiKey, ErrorCode, KafkaRequest
from clmq.protocol.transport import AccessControl
from clmq.protocol.transport import Peer as SessionPeer

from ._listener import Peer
from ._sasl import session_peer

log = logging.getLogger("clmq.broker.kafka")

TOPIC, GROUP, CLUSTER, TXN = ResourceType.TOPIC, ResourceType.GROUP, ResourceType.CLUSTER, ResourceType.TRANSACTIONAL_ID
READ, WRITE, DESCRIBE = Operation.READ, Operation.WRITE, Operation.DESCRIBE
CREATE, DELETE, ALTER = Operation.CREATE, Operation.DELETE, Operation.ALTER
TOPIC_DENIED = ErrorCode.TOPIC_AUTHORIZATION_FAILED
GROUP_DENIED = ErrorCode.GROUP_AUTHORIZATION_FAILED
CLUSTER_DENIED = ErrorCode.CLUSTER_AUTHORIZATION_FAILED
TXN_DENIED = ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
ADMIN_OPERATIONS = frozenset({CREATE, DELETE, ALTER, Operation.ALTER_CONFIGS})
NO_AUTHORIZED_OPERATIONS = -(2**31)
RESOURCE_TOPIC, RESOURCE_BROKER = 2, 4  # DescribeConfigs' resource types
ZERO_UUID = uuid.UUID(int=0)
KafkaHandler = Callable[[KafkaRequest, Peer], Any]
BY_ID = frozenset({ApiKey.FETCH, ApiKey.METADATA, ApiKey.DELETE_TOPICS})  # APIs that may name topics by id


@dataclass
class Verdict:
    """A rule's decision on one request (all None: allowed as it is)."""

    answer: dict[str, Any] | None = None  # refused whole: this is the answer, the handler is not called
    body: dict[str, Any] | None = None  # the request's body with the refused parts taken out
    merge: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # the refused parts into the answer


ALLOWED = Verdict()


class Denials:
    """Denials on the Kafka listener since start (the access control counts both listeners')."""

    count = 0


class Check:
    """One request's questions to the authorizer, as its principal from its host."""

    def __init__(
        self,
        access: AccessControl,
        peer: SessionPeer,
        principal: str,
        api: str,
        topic_name: Callable[[Any], str | None],
        denials: Denials | None = None,
    ) -> None:
        self.access = access
        self.denials = denials
        self.authorizer = access.authorizer()
        self.peer = peer
        self.principal = principal
        self.api = api
        self.topic_name = topic_name  # a topic id's name (None: unknown)
        self.denied = 0

    def allowed(self, op: Operation, rtype: ResourceType, name: str, *, quiet: bool = False) -> bool:
        """May the principal do ``op`` on the resource? A denial is counted and audited
        unless ``quiet`` (a list filtered, a question with a fallback)."""
        if self.authorizer.allowed(self.principal, self.peer.host, op, rtype, name):
            if op in ADMIN_OPERATIONS and not quiet:
                self.admin(op, rtype, name)
            return True
        if not quiet:
            self.deny(op, rtype, name)
        return False

    def cluster(self, op: Operation, *, quiet: bool = False) -> bool:
        return self.allowed(op, CLUSTER, CLUSTER_NAME, quiet=quiet)

    def deny(self, op: Operation, rtype: ResourceType, name: str) -> None:
        self.denied += 1
        self.access.stats.denied += 1
        if self.denials is not None:
            self.denials.count += 1
        log.debug("kafka %s: %s may not %s %s %r", self.api, self.principal, op.name, rtype.name.lower(), name)
        self.access.audit("denied", self.peer, self.principal, f"kafka {self.api}", op.name, rtype.name, name)

    def admin(self, op: Operation, rtype: ResourceType, name: str) -> None:
        self.access.audit("admin", self.peer, self.principal, f"kafka {self.api}", op.name, rtype.name, name)

    def any_topic(self, op: Operation) -> bool:
        """Kafka's ``authorizeByResourceType``: may the principal do ``op`` on some topic
        (an ALLOW that no DENY wholly covers)?"""
        a = self.authorizer
        if self.principal in a.super_users:
            return True
        mine = [
            b
            for b in a.bindings
            if b.resource_type is TOPIC
            and b.principal in (self.principal, "User:*")
            and b.host in (self.peer.host, WILDCARD)
            and b.grants(op)
        ]
        denies = [b for b in mine if b.permission is Permission.DENY]
        if any(d.pattern is PatternType.LITERAL and d.name == WILDCARD for d in denies):
            return False

        def covered(name: str, pattern: PatternType) -> bool:
            return any(
                (d.pattern is PatternType.PREFIXED and name.startswith(d.name))
                or (d.pattern is PatternType.LITERAL and pattern is PatternType.LITERAL and d.name == name)
                for d in denies
            )

        return any(b.permission is Permission.ALLOW and not covered(b.name, b.pattern) for b in mine)


Rule = Callable[[KafkaRequest, Check], Verdict]


def _text(check: Check, op: Operation, rtype: ResourceType, name: str = "") -> str:
    what = f"{rtype.name.lower()} {name!r}" if name else rtype.name.lower()
    return f"{check.principal} may not {op.name} {what}"


def _split(items: Iterable[Any], allowed: Callable[[Any], bool]) -> tuple[list[Any], list[Any]]:
    kept: list[Any] = []
    refused: list[Any] = []
    for item in items:
        (kept if allowed(item) else refused).append(item)
    return kept, refused


def _name_of(check: Check, entry: dict[str, Any], key: str) -> str | None:
    """A request entry's topic name: ``entry[key]``, else the name of its topic id (None:
    an id unknown here, answered UNKNOWN_TOPIC_ID without asking the handler)."""
    name = entry.get(key)
    return name if name is not None else check.topic_name(entry.get("topic_id"))


def _in_order(rows: list[dict[str, Any]], key: str, order: list[Any]) -> list[dict[str, Any]]:
    """``rows`` in the order their ``key`` was asked (rows never asked keep their place at the end)."""
    rank = {k: i for i, k in enumerate(order)}
    return sorted(rows, key=lambda r: rank.get(r.get(key), len(rank)))


# ---------------------------------------------------------------- open
def _open(req: KafkaRequest, check: Check) -> Verdict:
    """Asked before (or as) the login: ApiVersions, SaslHandshake, SaslAuthenticate."""
    return ALLOWED


# ---------------------------------------------------------------- producing
def _produce(req: KafkaRequest, check: Check) -> Verdict:
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
        kept, refused = _split(topics, lambda t: check.allowed(WRITE, TOPIC, t["name"]))
        code = TOPIC_DENIED
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["responses"] = [
            *answer.get("responses", []),
            *(
                {
                    "name": t["name"],
                    "partition_responses": [
                        {
                            "index": p["index"],
                            "error_code": code,
                            "base_offset": -1,
                            "log_append_time_ms": -1,
                            "log_start_offset": -1,
                            "record_errors": [],
                            "error_message": _text(check, WRITE, TOPIC, t["name"]),
                        }
                        for p in t.get("partition_data") or []
                    ],
                }
                for t in refused
            ),
        ]
        return answer

    return Verdict(body={**body, "topic_data": kept}, merge=merge)


def _init_producer_id(req: KafkaRequest, check: Check) -> Verdict:
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
def _fetch(req: KafkaRequest, check: Check) -> Verdict:
    """READ on each topic (TOPIC_AUTHORIZATION_FAILED per partition); a follower's fetch
    (replica id >= 0) CLUSTER_ACTION on the cluster."""
    body = req.body
    if body.get("replica_id", -1) >= 0 and not check.cluster(Operation.CLUSTER_ACTION):
        return Verdict(answer={"throttle_time_ms": 0, "error_code": CLUSTER_DENIED, "session_id": 0, "responses": []})
    kept: list[dict[str, Any]] = []
    refused: list[tuple[dict[str, Any], str, int]] = []
    for t in body.get("topics") or []:
        name = _name_of(check, t, "topic")
        if name is None:
            refused.append((t, "", ErrorCode.UNKNOWN_TOPIC_ID))
        elif not check.allowed(READ, TOPIC, name):
            refused.append((t, name, TOPIC_DENIED))
        else:
            kept.append(t)
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["responses"] = [
            *answer.get("responses", []),
            *(
                {
                    "topic": name,
                    "topic_id": t.get("topic_id") or ZERO_UUID,
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
                        for p in t.get("partitions") or []
                    ],
                }
                for t, name, code in refused
            ),
        ]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def _list_offsets(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on each topic."""
    body = req.body
    kept, refused = _split(body.get("topics") or [], lambda t: check.allowed(DESCRIBE, TOPIC, t["name"]))
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


def _offset_for_leader_epoch(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on each topic."""
    body = req.body
    kept, refused = _split(body.get("topics") or [], lambda t: check.allowed(DESCRIBE, TOPIC, t["topic"]))
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
def _metadata(req: KafkaRequest, check: Check) -> Verdict:
    """Every topic: only those the principal may DESCRIBE are listed. Topics by name (or
    id): TOPIC_AUTHORIZATION_FAILED for those it may not. Auto-creation needs CREATE on
    the cluster or on each missing topic: without it for every topic asked, none is
    created (they are answered UNKNOWN_TOPIC_OR_PARTITION)."""
    body = req.body
    asked = body.get("topics")
    if asked is None or (req.api_version == 0 and not asked):  # every topic (v0: an empty list)

        def listed(answer: dict[str, Any]) -> dict[str, Any]:
            answer["topics"] = [
                t for t in answer.get("topics", []) if check.allowed(DESCRIBE, TOPIC, t["name"], quiet=True)
            ]
            return answer

        return Verdict(merge=listed)

    def name_of(t: dict[str, Any]) -> str | None:
        return _name_of(check, t, "name")

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
        rows = [
            *answer.get("topics", []),
            *(
                {
                    "error_code": code,
                    "name": t["name"] if t.get("name") is not None else ("" if req.api_version < 12 else None),
                    "topic_id": t.get("topic_id") or ZERO_UUID,
                    "is_internal": False,
                    "partitions": [],
                }
                for t, code in refused
            ),
        ]
        answer["topics"] = _in_order(rows, "name", order)
        return answer

    return Verdict(body={**body, "topics": kept, "allow_auto_topic_creation": auto}, merge=merge)


def _describe_cluster(req: KafkaRequest, check: Check) -> Verdict:
    if check.cluster(DESCRIBE):
        return ALLOWED
    text = _text(check, DESCRIBE, CLUSTER)
    return Verdict(answer={"throttle_time_ms": 0, "error_code": CLUSTER_DENIED, "error_message": text})


def _find_coordinator(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on the group (a transactional id: on it)."""
    body = req.body
    txn = body.get("key_type", 0) == 1
    rtype, code = (TXN, TXN_DENIED) if txn else (GROUP, GROUP_DENIED)
    if req.api_version < 4:
        key = body.get("key", "")
        if check.allowed(DESCRIBE, rtype, key):
            return ALLOWED
        answer = {"throttle_time_ms": 0, "error_code": code, "error_message": _text(check, DESCRIBE, rtype, key)}
        return Verdict(answer={**answer, "node_id": -1, "host": "", "port": -1})
    keys = body.get("coordinator_keys") or []
    kept, refused = _split(keys, lambda k: check.allowed(DESCRIBE, rtype, k))
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
                    "error_message": _text(check, DESCRIBE, rtype, k),
                }
                for k in refused
            ),
        ]
        answer["coordinators"] = _in_order(rows, "key", keys)
        return answer

    return Verdict(body={**body, "coordinator_keys": kept}, merge=merge)


# ---------------------------------------------------------------- groups
def _group_member(req: KafkaRequest, check: Check) -> Verdict:
    """JoinGroup, SyncGroup, Heartbeat, LeaveGroup: READ on the group."""
    group = req.body.get("group_id") or ""
    if check.allowed(READ, GROUP, group):
        return ALLOWED
    return Verdict(
        answer={"throttle_time_ms": 0, "error_code": GROUP_DENIED, "member_id": req.body.get("member_id") or ""}
    )


def _offset_commit(req: KafkaRequest, check: Check) -> Verdict:
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
    kept, refused = _split(topics, lambda t: check.allowed(READ, TOPIC, t["name"]))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["topics"] = [*answer.get("topics", []), *rows(refused, TOPIC_DENIED)]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def _offset_fetch(req: KafkaRequest, check: Check) -> Verdict:
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
        answer["groups"] = _in_order(rows, "group_id", [g["group_id"] for g in body["groups"]])
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
    kept, refused = _split(topics, lambda t: check.allowed(DESCRIBE, TOPIC, t["name"]))
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


def _describe_groups(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on each group."""
    body = req.body
    groups = body.get("groups") or []
    kept, refused = _split(groups, lambda g: check.allowed(DESCRIBE, GROUP, g))
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
        answer["groups"] = _in_order(rows, "group_id", groups)
        return answer

    return Verdict(body={**body, "groups": kept}, merge=merge)


def _list_groups(req: KafkaRequest, check: Check) -> Verdict:
    """DESCRIBE on the cluster lists every group; else only those the principal may describe."""
    if check.cluster(DESCRIBE, quiet=True):
        return ALLOWED

    def listed(answer: dict[str, Any]) -> dict[str, Any]:
        answer["groups"] = [
            g for g in answer.get("groups", []) if check.allowed(DESCRIBE, GROUP, g["group_id"], quiet=True)
        ]
        return answer

    return Verdict(merge=listed)


def _delete_groups(req: KafkaRequest, check: Check) -> Verdict:
    """DELETE on each group."""
    body = req.body
    names = body.get("groups_names") or []
    kept, refused = _split(names, lambda g: check.allowed(DELETE, GROUP, g))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = [*answer.get("results", []), *({"group_id": g, "error_code": GROUP_DENIED} for g in refused)]
        answer["results"] = _in_order(rows, "group_id", names)
        return answer

    return Verdict(body={**body, "groups_names": kept}, merge=merge)


# ---------------------------------------------------------------- topics
def _create_topics(req: KafkaRequest, check: Check) -> Verdict:
    """CREATE on the cluster, or on each topic."""
    body = req.body
    topics = body.get("topics") or []
    if check.cluster(CREATE, quiet=True):
        for t in topics:
            check.admin(CREATE, TOPIC, t["name"])
        return ALLOWED
    kept, refused = _split(topics, lambda t: check.allowed(CREATE, TOPIC, t["name"]))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = [
            *answer.get("topics", []),
            *(
                {
                    "name": t["name"],
                    "error_code": TOPIC_DENIED,
                    "error_message": _text(check, CREATE, TOPIC, t["name"]),
                    "num_partitions": -1,
                    "replication_factor": -1,
                    "configs": [],
                }
                for t in refused
            ),
        ]
        answer["topics"] = _in_order(rows, "name", [t["name"] for t in topics])
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def _delete_topics(req: KafkaRequest, check: Check) -> Verdict:
    """DELETE on each topic (named, or by id from v6)."""
    body = req.body
    by_name = body.get("topic_names")
    entries: list[Any] = list(by_name) if by_name is not None else list(body.get("topics") or [])

    def name_of(e: Any) -> str | None:
        return e if isinstance(e, str) else _name_of(check, e, "name")

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
                    "error_message": _text(check, DELETE, TOPIC, name_of(e) or ""),
                }
                for e, code in refused
            ),
        ]
        return answer

    key = "topic_names" if by_name is not None else "topics"
    return Verdict(body={**body, key: kept}, merge=merge)


def _create_partitions(req: KafkaRequest, check: Check) -> Verdict:
    """ALTER on each topic."""
    body = req.body
    kept, refused = _split(body.get("topics") or [], lambda t: check.allowed(ALTER, TOPIC, t["name"]))
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        answer["results"] = [
            *answer.get("results", []),
            *(
                {"name": t["name"], "error_code": TOPIC_DENIED, "error_message": _text(check, ALTER, TOPIC, t["name"])}
                for t in refused
            ),
        ]
        return answer

    return Verdict(body={**body, "topics": kept}, merge=merge)


def _describe_configs(req: KafkaRequest, check: Check) -> Verdict:
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

    kept, refused = _split(resources, ok)
    if not refused:
        return ALLOWED

    def merge(answer: dict[str, Any]) -> dict[str, Any]:
        rows = list(answer.get("results", []))
        for r in refused:
            topic = r["resource_type"] == RESOURCE_TOPIC
            rows.append(
                {
                    "error_code": TOPIC_DENIED if topic else CLUSTER_DENIED,
                    "error_message": _text(check, op, TOPIC if topic else CLUSTER, r["resource_name"] if topic else ""),
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
def _describe_acls(req: KafkaRequest, check: Check) -> Verdict:
    if check.cluster(DESCRIBE):
        return ALLOWED
    text = _text(check, DESCRIBE, CLUSTER)
    return Verdict(answer={"throttle_time_ms": 0, "error_code": CLUSTER_DENIED, "error_message": text, "resources": []})


def _create_acls(req: KafkaRequest, check: Check) -> Verdict:
    if check.cluster(ALTER):
        return ALLOWED
    text = _text(check, ALTER, CLUSTER)
    results = [{"error_code": CLUSTER_DENIED, "error_message": text} for _c in req.body.get("creations") or []]
    return Verdict(answer={"throttle_time_ms": 0, "results": results})


def _delete_acls(req: KafkaRequest, check: Check) -> Verdict:
    if check.cluster(ALTER):
        return ALLOWED
    text = _text(check, ALTER, CLUSTER)
    rows = [
        {"error_code": CLUSTER_DENIED, "error_message": text, "matching_acls": []}
        for _f in req.body.get("filters") or []
    ]
    return Verdict(answer={"throttle_time_ms": 0, "filter_results": rows})


KAFKA_RULES: dict[int, Rule] = {
    ApiKey.API_VERSIONS: _open,
    ApiKey.SASL_HANDSHAKE: _open,
    ApiKey.SASL_AUTHENTICATE: _open,
    ApiKey.PRODUCE: _produce,
    ApiKey.INIT_PRODUCER_ID: _init_producer_id,
    ApiKey.FETCH: _fetch,
    ApiKey.LIST_OFFSETS: _list_offsets,
    ApiKey.OFFSET_FOR_LEADER_EPOCH: _offset_for_leader_epoch,
    ApiKey.METADATA: _metadata,
    ApiKey.DESCRIBE_CLUSTER: _describe_cluster,
    ApiKey.FIND_COORDINATOR: _find_coordinator,
    ApiKey.JOIN_GROUP: _group_member,
    ApiKey.SYNC_GROUP: _group_member,
    ApiKey.HEARTBEAT: _group_member,
    ApiKey.LEAVE_GROUP: _group_member,
    ApiKey.OFFSET_COMMIT: _offset_commit,
    ApiKey.OFFSET_FETCH: _offset_fetch,
    ApiKey.DESCRIBE_GROUPS: _describe_groups,
    ApiKey.LIST_GROUPS: _list_groups,
    ApiKey.DELETE_GROUPS: _delete_groups,
    ApiKey.CREATE_TOPICS: _create_topics,
    ApiKey.DELETE_TOPICS: _delete_topics,
    ApiKey.CREATE_PARTITIONS: _create_partitions,
    ApiKey.DESCRIBE_CONFIGS: _describe_configs,
    ApiKey.DESCRIBE_ACLS: _describe_acls,
    ApiKey.CREATE_ACLS: _create_acls,
    ApiKey.DELETE_ACLS: _delete_acls,
}
# What a principal without any ACL is answered, per API (docs/security-kafka.md; the
# table-driven test checks each): the error code, or "filtered" (listed without what it
# may not see), or "open".
DENIED_WITHOUT_ACLS: dict[int, int | str] = {
    ApiKey.API_VERSIONS: "open",
    ApiKey.SASL_HANDSHAKE: "open",
    ApiKey.SASL_AUTHENTICATE: "open",
    ApiKey.PRODUCE: TOPIC_DENIED,
    ApiKey.INIT_PRODUCER_ID: CLUSTER_DENIED,
    ApiKey.FETCH: TOPIC_DENIED,
    ApiKey.LIST_OFFSETS: TOPIC_DENIED,
    ApiKey.OFFSET_FOR_LEADER_EPOCH: TOPIC_DENIED,
    ApiKey.METADATA: TOPIC_DENIED,
    ApiKey.DESCRIBE_CLUSTER: CLUSTER_DENIED,
    ApiKey.FIND_COORDINATOR: GROUP_DENIED,
    ApiKey.JOIN_GROUP: GROUP_DENIED,
    ApiKey.SYNC_GROUP: GROUP_DENIED,
    ApiKey.HEARTBEAT: GROUP_DENIED,
    ApiKey.LEAVE_GROUP: GROUP_DENIED,
    ApiKey.OFFSET_COMMIT: GROUP_DENIED,
    ApiKey.OFFSET_FETCH: GROUP_DENIED,
    ApiKey.DESCRIBE_GROUPS: GROUP_DENIED,
    ApiKey.LIST_GROUPS: "filtered",
    ApiKey.DELETE_GROUPS: GROUP_DENIED,
    ApiKey.CREATE_TOPICS: TOPIC_DENIED,
    ApiKey.DELETE_TOPICS: TOPIC_DENIED,
    ApiKey.CREATE_PARTITIONS: TOPIC_DENIED,
    ApiKey.DESCRIBE_CONFIGS: TOPIC_DENIED,
    ApiKey.DESCRIBE_ACLS: CLUSTER_DENIED,
    ApiKey.CREATE_ACLS: CLUSTER_DENIED,
    ApiKey.DELETE_ACLS: CLUSTER_DENIED,
}


def guard(
    handler: KafkaHandler,
    rule: Rule,
    access: AccessControl,
    api: str,
    topic_name: Callable[[Any], str | None],
    denials: Denials | None = None,
    prepare: Callable[[], Awaitable[Any]] | None = None,
) -> KafkaHandler:
    """``handler`` behind ``rule``: the verdict taken before the handler runs
    (``prepare`` first: the cluster view the handler will use, so that the rule names
    topic ids as the handler will)."""

    async def guarded(req: KafkaRequest, peer: Peer) -> Any:
        if prepare is not None:
            await prepare()
        speer = session_peer(peer)
        principal = access.principal(speer) or "User:ANONYMOUS"
        verdict = rule(req, Check(access, speer, principal, api, topic_name, denials))
        if verdict.answer is not None:
            return verdict.answer
        if verdict.body is not None:
            req = dataclasses.replace(req, body=verdict.body)
        answer = await handler(req, peer)
        if verdict.merge is not None and isinstance(answer, dict):
            answer = verdict.merge(answer)
        return answer

    return guarded


def guard_all(
    handlers: dict[int, KafkaHandler],
    access: AccessControl,
    topic_name: Callable[[Any], str | None],
    denials: Denials | None = None,
    prepare: Callable[[], Awaitable[Any]] | None = None,
) -> dict[int, KafkaHandler]:
    """Every handler behind its rule (with authentication on); an API without a rule is
    an error here. ``prepare`` is awaited before the rules of APIs naming topics by id."""
    missing = sorted(set(handlers) - set(KAFKA_RULES))
    if missing:
        raise AssertionError(f"Kafka APIs without an ACL rule: {missing}")
    if not access.enabled:
        return dict(handlers)
    return {
        key: guard(h, KAFKA_RULES[key], access, _api_name(key), topic_name, denials, prepare if key in BY_ID else None)
        for key, h in handlers.items()
    }


def _api_name(key: int) -> str:
    try:
        return ApiKey(key).name
    except ValueError:
        return str(key)
