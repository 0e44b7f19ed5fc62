"""What every request of the native protocol needs of the ACLs (docs/security.md's
table): the operation and resource each touches, read from its checked fields. A
request code without a rule here cannot be served with authentication on
(:meth:`AccessControl.guard_all` refuses to build the table), so adding a request
means deciding its ACL."""

from __future__ import annotations

from typing import Any, Iterable

from clmq.common import TIMER_TOPIC, TRANS_HALF_TOPIC
from clmq.protocol import RequestCode
from clmq.protocol.auth import CLUSTER_NAME, WILDCARD, Operation, ResourceType
from clmq.protocol.transport import OPEN, Need, Rule

TOPIC, GROUP, CLUSTER = ResourceType.TOPIC, ResourceType.GROUP, ResourceType.CLUSTER
READ, WRITE, DESCRIBE = Operation.READ, Operation.WRITE, Operation.DESCRIBE


def _on_cluster(op: Operation) -> Rule:
    return lambda fields: [(op, CLUSTER, CLUSTER_NAME)]


def _topic(op: Operation) -> Rule:
    return lambda fields: [(op, TOPIC, fields["topic"])]


def _group(op: Operation) -> Rule:
    return lambda fields: [(op, GROUP, fields["group"])]


def _every_topic(op: Operation) -> Rule:
    """Requests that read the raw log, whatever the topic (Spark's log reads): a binding
    on every topic (``*``) first; the handler then checks each topic the log holds, so
    that a DENY on one holds."""
    return lambda fields: [(op, TOPIC, WILDCARD)]


def _pull(fields: dict[str, Any]) -> Iterable[Need]:
    yield (READ, TOPIC, fields["topic"])
    if fields.get("group"):
        yield (READ, GROUP, fields["group"])


def _pull_many(fields: dict[str, Any]) -> Iterable[Need]:
    topics = {row[0] for row in fields["queues"] if isinstance(row, list) and row and isinstance(row[0], str)}
    return [(READ, TOPIC, t) for t in sorted(topics)]


def _commit(fields: dict[str, Any]) -> Iterable[Need]:
    yield (READ, GROUP, fields["group"])
    for t in sorted({row[0] for row in fields["offsets"]}):
        yield (READ, TOPIC, t)


def _queue_offsets(fields: dict[str, Any]) -> Iterable[Need]:
    """The group's commits and each queue's bounds: DESCRIBE on the group and the topics."""
    yield (DESCRIBE, GROUP, fields["group"])
    topics = {row[0] for row in fields["queues"] if isinstance(row, list) and row and isinstance(row[0], str)}
    for t in sorted(topics):
        yield (DESCRIBE, TOPIC, t)


def _heartbeat(fields: dict[str, Any]) -> Iterable[Need]:
    groups = fields["groups"]
    return [(READ, GROUP, g["group"]) for g in groups if isinstance(g, dict) and isinstance(g.get("group"), str)]


def _send(fields: dict[str, Any]) -> Iterable[Need]:
    """WRITE on the topic; a scheduled batch (to ``%TIMER%``) and a transactional one (to
    ``%TRANS_HALF%``) are checked per real topic at the door."""
    return [] if fields["topic"] in (TIMER_TOPIC, TRANS_HALF_TOPIC) else [(WRITE, TOPIC, fields["topic"])]


def _transactional_id(fields: dict[str, Any]) -> Iterable[Need]:
    return [(WRITE, ResourceType.TRANSACTIONAL_ID, fields["group"])]


def _create_topic(fields: dict[str, Any]) -> Iterable[Need]:
    return [(Operation.CREATE, TOPIC, fields["topic"])]


BROKER_RULES: dict[int, Rule] = {
    RequestCode.SEND_MESSAGE: _send,
    RequestCode.PULL_MESSAGE: _pull,
    RequestCode.PULL_MESSAGES: _pull_many,
    RequestCode.QUERY_OFFSETS: _topic(DESCRIBE),
    RequestCode.SEARCH_OFFSET: _topic(DESCRIBE),
    RequestCode.COMMIT_OFFSET: _commit,  # also how offsets are reset: Kafka's rule (READ on the group)
    RequestCode.QUERY_CONSUMER_OFFSET: _group(DESCRIBE),
    RequestCode.QUERY_QUEUE_OFFSETS: _queue_offsets,
    RequestCode.HEARTBEAT: _heartbeat,
    RequestCode.UNREGISTER_CLIENT: OPEN,  # READ on each group the client is in: checked by the handler
    RequestCode.GET_GROUP_MEMBERS: _group(DESCRIBE),
    RequestCode.LIST_GROUPS: _on_cluster(DESCRIBE),
    RequestCode.DESCRIBE_GROUP: _group(DESCRIBE),
    RequestCode.DELETE_GROUP: _group(Operation.DELETE),
    RequestCode.CONSUMER_SEND_BACK: _group(READ),  # and READ on each record's topic (the handler, once read)
    RequestCode.POP_MESSAGE: _pull,  # READ on the topic and on the group
    RequestCode.ACK_MESSAGE: _group(READ),
    RequestCode.CHANGE_INVISIBLE_TIME: _group(READ),
    RequestCode.LOCK_QUEUES: _group(READ),
    RequestCode.UNLOCK_QUEUES: _group(READ),
    RequestCode.CREATE_TOPIC: _create_topic,
    RequestCode.DELETE_TOPIC: _topic(Operation.DELETE),
    RequestCode.LIST_TOPICS: _on_cluster(DESCRIBE),
    RequestCode.DESCRIBE_TOPIC: _topic(DESCRIBE),
    RequestCode.GET_MESSAGE: OPEN,  # READ on the record's topic: checked once it is read
    RequestCode.QUERY_INDEX: _topic(READ),
    RequestCode.CANCEL_MESSAGE: lambda fields: [(WRITE, TOPIC, TIMER_TOPIC)],
    # A producer group is a transactional id (Kafka's rule: WRITE on it); END also needs WRITE
    # on the half's real topic (checked once it is read), CHECK offers only such halves.
    RequestCode.END_TRANSACTION: _transactional_id,
    RequestCode.CHECK_TRANSACTIONS: _transactional_id,
    RequestCode.LIST_TRANSACTIONS: _on_cluster(DESCRIBE),
    RequestCode.BROKER_INFO: _on_cluster(DESCRIBE),
    RequestCode.GET_LOG_LAYOUT: _every_topic(READ),
    RequestCode.READ_LOG: _every_topic(READ),
    RequestCode.REPLICA_JOIN: _on_cluster(Operation.CLUSTER_ACTION),
    RequestCode.REPLICA_FETCH: _on_cluster(Operation.CLUSTER_ACTION),
    RequestCode.REPLICA_METADATA: _on_cluster(Operation.CLUSTER_ACTION),
    RequestCode.PROMOTE: _on_cluster(Operation.ALTER),
    RequestCode.TRANSFER_LEADERSHIP: _on_cluster(Operation.ALTER),
    RequestCode.REPLICA_STATUS: _on_cluster(DESCRIBE),
    RequestCode.USER_UPSERT: _on_cluster(Operation.ALTER),
    RequestCode.USER_DELETE: _on_cluster(Operation.ALTER),
    RequestCode.USER_LIST: _on_cluster(DESCRIBE),
    RequestCode.ACL_CREATE: _on_cluster(Operation.ALTER),
    RequestCode.ACL_DESCRIBE: _on_cluster(DESCRIBE),
    RequestCode.ACL_DELETE: _on_cluster(Operation.ALTER),
}
