"""What the Kafka ACL rules share: :class:`Check` (one request's questions to the
authorizer, each denial counted and audited), :class:`Verdict` (a rule's decision),
:class:`Denials`, ``ALLOWED``, the resource, operation and error-code constants, and the
small helpers the rules of ``_access_topics`` and ``_access_groups`` use.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from clmq.protocol.auth import CLUSTER_NAME, WILDCARD, Operation, PatternType, Permission, ResourceType
from clmq.protocol.kafka import ErrorCode, KafkaRequest
from clmq.protocol.transport import ADMIN_OPERATIONS, AccessControl
from clmq.protocol.transport import Peer as SessionPeer

log = logging.getLogger("clmq.broker.kafka")


TOPIC, GROUP, CLUSTER, TXN = ResourceType.TOPIC, ResourceType.GROUP, ResourceType.CLUSTER, ResourceType.TRANSACTIONAL_ID
READ, WRITE, DESCRIBE = Operation.READ, Operation.WRITE, Operation.DESCRIBE
CREATE, DELETE, ALTER = Operation.CREATE, Operation.DELETE, Operation.ALTER
TOPIC_DENIED = ErrorCode.TOPIC_AUTHORIZATION_FAILED
GROUP_DENIED = ErrorCode.GROUP_AUTHORIZATION_FAILED
CLUSTER_DENIED = ErrorCode.CLUSTER_AUTHORIZATION_FAILED
TXN_DENIED = ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
NO_AUTHORIZED_OPERATIONS = -(2**31)
RESOURCE_TOPIC, RESOURCE_BROKER = 2, 4  # DescribeConfigs' resource types
ZERO_UUID = uuid.UUID(int=0)


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


def refusal_text(check: Check, op: Operation, rtype: ResourceType, name: str = "") -> str:
    """The error message of a refused part: who may not do what on which resource."""
    what = f"{rtype.name.lower()} {name!r}" if name else rtype.name.lower()
    return f"{check.principal} may not {op.name} {what}"


def split(items: Iterable[Any], allowed: Callable[[Any], bool]) -> tuple[list[Any], list[Any]]:
    """``items`` as (allowed, refused), each in the order asked."""
    kept: list[Any] = []
    refused: list[Any] = []
    for item in items:
        (kept if allowed(item) else refused).append(item)
    return kept, refused


def topic_name_of(check: Check, entry: dict[str, Any], key: str) -> str | None:
    """A request entry's topic name: ``entry[key]``, else the name of its topic id (None:
    an id unknown here, answered UNKNOWN_TOPIC_ID without asking the handler)."""
    name = entry.get(key)
    return name if name is not None else check.topic_name(entry.get("topic_id"))


def in_order(rows: list[dict[str, Any]], key: str, order: list[Any]) -> list[dict[str, Any]]:
    """``rows`` in the order their ``key`` was asked (rows never asked keep their place at the end)."""
    rank = {k: i for i, k in enumerate(order)}
    return sorted(rows, key=lambda r: rank.get(r.get(key), len(rank)))
