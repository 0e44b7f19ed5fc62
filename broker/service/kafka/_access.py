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
deciding its ACL. docs/security.md#kafka-clients has the table in words.

The rules are in ``_access_topics`` (producing, reading, metadata, topics, ACLs) and
``_access_groups`` (the coordinator and groups); what they share, :class:`Check` and
:class:`Verdict` first, in ``_access_check``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable

from clmq.protocol.kafka import ApiKey, KafkaRequest, api_name
from clmq.protocol.transport import AccessControl

from . import _access_groups, _access_topics, _share_access
from ._access_check import ALLOWED, CLUSTER_DENIED, GROUP_DENIED, TOPIC_DENIED, Check, Denials, Rule, Verdict
from ._listener import Peer
from ._sasl import session_peer

__all__ = ["DENIED_WITHOUT_ACLS", "KAFKA_RULES", "Denials", "guard", "guard_all"]

KafkaHandler = Callable[[KafkaRequest, Peer], Any]
BY_ID = frozenset(
    {ApiKey.FETCH, ApiKey.METADATA, ApiKey.DELETE_TOPICS, ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE}
)  # APIs that may name topics by id


def _open(req: KafkaRequest, check: Check) -> Verdict:
    """Asked before (or as) the login: ApiVersions, SaslHandshake, SaslAuthenticate."""
    return ALLOWED


KAFKA_RULES: dict[int, Rule] = {
    ApiKey.API_VERSIONS: _open,
    ApiKey.SASL_HANDSHAKE: _open,
    ApiKey.SASL_AUTHENTICATE: _open,
    ApiKey.PRODUCE: _access_topics.produce,
    ApiKey.INIT_PRODUCER_ID: _access_topics.init_producer_id,
    ApiKey.FETCH: _access_topics.fetch,
    ApiKey.LIST_OFFSETS: _access_topics.list_offsets,
    ApiKey.OFFSET_FOR_LEADER_EPOCH: _access_topics.offset_for_leader_epoch,
    ApiKey.METADATA: _access_topics.metadata,
    ApiKey.DESCRIBE_CLUSTER: _access_topics.describe_cluster,
    ApiKey.FIND_COORDINATOR: _access_groups.find_coordinator,
    ApiKey.JOIN_GROUP: _access_groups.group_member,
    ApiKey.SYNC_GROUP: _access_groups.group_member,
    ApiKey.HEARTBEAT: _access_groups.group_member,
    ApiKey.LEAVE_GROUP: _access_groups.group_member,
    ApiKey.OFFSET_COMMIT: _access_groups.offset_commit,
    ApiKey.OFFSET_FETCH: _access_groups.offset_fetch,
    ApiKey.DESCRIBE_GROUPS: _access_groups.describe_groups,
    ApiKey.LIST_GROUPS: _access_groups.list_groups,
    ApiKey.DELETE_GROUPS: _access_groups.delete_groups,
    ApiKey.CREATE_TOPICS: _access_topics.create_topics,
    ApiKey.DELETE_TOPICS: _access_topics.delete_topics,
    ApiKey.CREATE_PARTITIONS: _access_topics.create_partitions,
    ApiKey.DESCRIBE_CONFIGS: _access_topics.describe_configs,
    ApiKey.DESCRIBE_ACLS: _access_topics.describe_acls,
    ApiKey.CREATE_ACLS: _access_topics.create_acls,
    ApiKey.DELETE_ACLS: _access_topics.delete_acls,
    ApiKey.SHARE_GROUP_HEARTBEAT: _share_access.share_heartbeat,
    ApiKey.SHARE_FETCH: _share_access.share_read,
    ApiKey.SHARE_ACKNOWLEDGE: _share_access.share_read,
}
# What a principal without any ACL is answered, per API (docs/security.md#kafka-clients; the
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
    ApiKey.SHARE_GROUP_HEARTBEAT: GROUP_DENIED,
    ApiKey.SHARE_FETCH: GROUP_DENIED,
    ApiKey.SHARE_ACKNOWLEDGE: GROUP_DENIED,
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
        key: guard(h, KAFKA_RULES[key], access, api_name(key), topic_name, denials, prepare if key in BY_ID else None)
        for key, h in handlers.items()
    }
