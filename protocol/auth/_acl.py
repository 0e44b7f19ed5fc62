"""Access control lists, as Kafka defines them (KIP-11, KIP-290 prefixes), sans-IO.

A binding allows or denies one *principal* (``User:alice``, or ``User:*``) from one
*host* (an IP, or ``*``) one *operation* on *resources* of one type whose names match
its *pattern* (the literal name, ``*`` for all, or a prefix). A request is allowed
when the principal is a super user, or some ALLOW binding matches and no DENY binding
does: DENY wins. Nothing matching is a denial (deny by default).

Operations imply others as in Kafka: READ, WRITE, DELETE and ALTER each imply
DESCRIBE; ALTER_CONFIGS implies DESCRIBE_CONFIGS; ALL matches every operation.
clmq adds one: CLUSTER_ACTION implies DESCRIBE (brokers read the cluster's listing).
clmq's own actions map onto these (docs/security.md): produce is TOPIC WRITE,
consume TOPIC READ plus GROUP READ, promote and leader transfer CLUSTER ALTER,
replication CLUSTER CLUSTER_ACTION.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable


class ResourceType(enum.IntEnum):  # Kafka's codes (AclResourceType)
    ANY = 1  # filters only
    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5


class PatternType(enum.IntEnum):  # Kafka's codes (PatternType)
    ANY = 1  # filters only
    MATCH = 2  # filters only: every binding that would apply to the filter's name
    LITERAL = 3
    PREFIXED = 4


class Operation(enum.IntEnum):  # Kafka's codes (AclOperation)
    ANY = 1  # filters only
    ALL = 2
    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    ALTER = 7
    DESCRIBE = 8
    CLUSTER_ACTION = 9
    DESCRIBE_CONFIGS = 10
    ALTER_CONFIGS = 11
    IDEMPOTENT_WRITE = 12


class Permission(enum.IntEnum):  # Kafka's codes (AclPermissionType)
    ANY = 1  # filters only
    DENY = 2
    ALLOW = 3


CLUSTER_NAME = "kafka-cluster"  # the one CLUSTER resource's name (Kafka's)
WILDCARD = "*"

# An ALLOW of the key grants the values too (Kafka's AclEntry.supportedOperations rules).
_IMPLIES: dict[Operation, frozenset[Operation]] = {
    Operation.READ: frozenset({Operation.DESCRIBE}),
    Operation.WRITE: frozenset({Operation.DESCRIBE}),
    Operation.DELETE: frozenset({Operation.DESCRIBE}),
    Operation.ALTER: frozenset({Operation.DESCRIBE}),
    Operation.ALTER_CONFIGS: frozenset({Operation.DESCRIBE_CONFIGS}),
    # clmq's addition: a broker's user (replication, registration) also reads the
    # cluster's description (the Kafka listener's view of the brokers).
    Operation.CLUSTER_ACTION: frozenset({Operation.DESCRIBE}),
}


def _enum(kind: type[enum.IntEnum], value: Any) -> Any:
    """An enum member from its name (any case) or code; ValueError naming the choices."""
    if isinstance(value, kind):
        return value
    try:
        return kind[str(value).upper()] if isinstance(value, str) else kind(value)
    except (KeyError, ValueError):
        names = ", ".join(m.name.lower() for m in kind)
        raise ValueError(f"{kind.__name__} must be one of {names}, got {value!r}") from None


def check_principal(principal: str) -> str:
    """``principal`` if it is ``User:<name>`` (or ``User:*``); ValueError otherwise."""
    kind, sep, name = principal.partition(":")
    if not sep or kind != "User" or not name:
        raise ValueError(f"a principal must be 'User:<name>' (or 'User:*'), got {principal!r}")
    return principal


@dataclass(frozen=True, order=True)
class AclBinding:
    """One rule. Its fields are checked when made (ValueError naming the field)."""

    resource_type: ResourceType
    name: str
    pattern: PatternType
    principal: str
    host: str
    operation: Operation
    permission: Permission

    def __post_init__(self) -> None:
        for attr, kind in (
            ("resource_type", ResourceType),
            ("pattern", PatternType),
            ("operation", Operation),
            ("permission", Permission),
        ):
            object.__setattr__(self, attr, _enum(kind, getattr(self, attr)))
        if ResourceType.ANY in (self.resource_type,) or self.pattern in (PatternType.ANY, PatternType.MATCH):
            raise ValueError("a binding names one resource type and a literal or prefixed pattern (ANY/MATCH: filters)")
        if self.operation is Operation.ANY or self.permission is Permission.ANY:
            raise ValueError("a binding names one operation and allow or deny (ANY: filters only)")
        if not self.name:
            raise ValueError("a binding's resource name must not be empty")
        if self.resource_type is ResourceType.CLUSTER and self.name != CLUSTER_NAME:
            raise ValueError(f"the cluster resource is named {CLUSTER_NAME!r}, got {self.name!r}")
        check_principal(self.principal)
        if not self.host:
            raise ValueError("a binding's host must be an address or '*'")

    def to_json(self) -> list[Any]:
        return [
            self.resource_type.name,
            self.name,
            self.pattern.name,
            self.principal,
            self.host,
            self.operation.name,
            self.permission.name,
        ]

    @classmethod
    def from_json(cls, row: Any) -> AclBinding:
        if not isinstance(row, list) or len(row) != 7 or not all(isinstance(c, str) for c in row):
            raise ValueError(f"an ACL row must be 7 strings, got {row!r:.100}")
        return cls(*row)  # names checked in __post_init__

    def names(self, resource_name: str) -> bool:
        """Does this binding's pattern cover ``resource_name``?"""
        if self.pattern is PatternType.PREFIXED:
            return resource_name.startswith(self.name)
        return self.name == WILDCARD or self.name == resource_name

    def grants(self, operation: Operation) -> bool:
        mine = self.operation
        if mine is Operation.ALL or mine is operation:
            return True
        # DENY of an operation does not deny the operations it implies (Kafka's rule);
        # an ALLOW grants them.
        return self.permission is Permission.ALLOW and operation in _IMPLIES.get(mine, frozenset())


@dataclass(frozen=True)
class AclFilter:
    """A filter of DescribeAcls/DeleteAcls and ``clmq acl list``: None or ANY matches
    anything; a MATCH pattern matches the bindings that would apply to its name."""

    resource_type: ResourceType = ResourceType.ANY
    name: str | None = None
    pattern: PatternType = PatternType.ANY
    principal: str | None = None
    host: str | None = None
    operation: Operation = Operation.ANY
    permission: Permission = Permission.ANY

    def matches(self, b: AclBinding) -> bool:
        """Whether this filter selects binding ``b``."""
        if self.resource_type is not ResourceType.ANY and b.resource_type is not self.resource_type:
            return False
        if not self._name_matches(b):
            return False
        return (
            (self.principal is None or self.principal == b.principal)
            and (self.host is None or self.host == b.host)
            and (self.operation is Operation.ANY or self.operation is b.operation)
            and (self.permission is Permission.ANY or self.permission is b.permission)
        )

    def _name_matches(self, b: AclBinding) -> bool:
        if self.pattern is PatternType.MATCH:
            return self.name is None or b.names(self.name)
        if self.pattern is not PatternType.ANY and b.pattern is not self.pattern:
            return False
        return self.name is None or self.name == b.name


class Authorizer:
    """Decisions over a set of bindings and super users; immutable (a change makes a
    new one: the service swaps it in one assignment, so a decision never sees half a
    change). Decisions are cached per question: the hot path (every produce) is one
    dictionary look-up."""

    def __init__(self, bindings: Iterable[AclBinding], super_users: Iterable[str] = ()) -> None:
        self.bindings = tuple(sorted(set(bindings)))
        self.super_users = frozenset(super_users)
        self._by_type: dict[ResourceType, list[AclBinding]] = {}
        for b in self.bindings:
            self._by_type.setdefault(b.resource_type, []).append(b)
        self._cache: dict[tuple[str, str, Operation, ResourceType, str], bool] = {}

    def allowed(self, principal: str, host: str, operation: Operation, rtype: ResourceType, name: str) -> bool:
        """Whether ``principal`` connecting from ``host`` may do ``operation`` on the
        resource ``rtype``/``name``: a super user, or an ALLOW and no DENY matching."""
        key = (principal, host, operation, rtype, name)
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) > 100_000:  # bounded: names are chosen by clients
                self._cache.clear()
            found = self._cache[key] = self._decide(principal, host, operation, rtype, name)
        return found

    def _decide(self, principal: str, host: str, operation: Operation, rtype: ResourceType, name: str) -> bool:
        if principal in self.super_users:
            return True
        allow = False
        for b in self._by_type.get(rtype, ()):
            if (
                b.principal in (principal, "User:*")
                and b.host in (host, WILDCARD)
                and b.names(name)
                and b.grants(operation)
            ):
                if b.permission is Permission.DENY:
                    return False
                allow = True
        return allow
