"""DescribeAcls, CreateAcls and DeleteAcls: Kafka's admin clients manage the same ACLs
as ``clmq acl`` (the broker's users-and-ACLs state: changed on its group's leader,
copied by the followers, decided by on both listeners).

Filters mean what they mean in Kafka (:class:`clmq.protocol.auth.AclFilter`): ANY
matches anything, a MATCH pattern every binding that would apply to the name given,
LITERAL and PREFIXED the bindings of that pattern and exactly that name. A change on a
follower is answered NOT_CONTROLLER (ACLs change on the group's leader). A broker
group keeps its own users and ACLs: in a cluster of several groups, ``clmq acl add``
writes every group's leader, while a Kafka admin client changes the group of the
broker it reached.
"""

from __future__ import annotations

import logging
from typing import Any

from clmq.protocol import ErrorCode as ClmqError
from clmq.protocol.auth import AclBinding, AclFilter, Operation, PatternType, Permission, ResourceType, SecurityState
from clmq.protocol.kafka import ErrorCode, KafkaRequest
from clmq.protocol.transport import RequestError

from .._context import BrokerContext
from ._listener import Peer

log = logging.getLogger("clmq.broker.kafka")

LITERAL = int(PatternType.LITERAL)  # the pattern of requests before v1


class _Invalid(Exception):
    pass


def _code(kind: type[Any], value: Any, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise _Invalid(f"unknown or unsupported {what} {value!r}") from None


def acl_filter(f: dict[str, Any], prefix: str = "") -> AclFilter:
    """An :class:`AclFilter` from a DescribeAcls body or a DeleteAcls filter."""
    return AclFilter(
        _code(ResourceType, f.get(f"resource_type{prefix}"), "resource type"),
        f.get(f"resource_name{prefix}"),
        _code(PatternType, f.get(f"pattern_type{prefix}", LITERAL), "pattern type"),
        f.get(f"principal{prefix}"),
        f.get(f"host{prefix}"),
        _code(Operation, f.get("operation"), "operation"),
        _code(Permission, f.get("permission_type"), "permission type"),
    )


def binding(c: dict[str, Any]) -> AclBinding:
    """An :class:`AclBinding` from a CreateAcls creation."""
    try:
        return AclBinding(
            _code(ResourceType, c.get("resource_type"), "resource type"),
            c.get("resource_name") or "",
            _code(PatternType, c.get("resource_pattern_type", LITERAL), "pattern type"),
            c.get("principal") or "",
            c.get("host") or "",
            _code(Operation, c.get("operation"), "operation"),
            _code(Permission, c.get("permission_type"), "permission type"),
        )
    except ValueError as e:
        raise _Invalid(str(e)) from None


def _row(b: AclBinding) -> dict[str, Any]:
    return {"principal": b.principal, "host": b.host, "operation": b.operation, "permission_type": b.permission}


class KafkaAcls:
    """The three ACL APIs over one broker's security state."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx

    def _writable(self) -> tuple[int, str] | None:
        """None on the leader; else the error a change is answered with."""
        try:
            self.ctx.replica.check_writable()
        except RequestError as e:
            if e.code == ClmqError.NOT_LEADER:
                return ErrorCode.NOT_CONTROLLER, f"ACLs are changed on the broker group's leader: {e.text}"
            return ErrorCode.UNKNOWN_SERVER_ERROR, e.text
        return None

    async def describe_acls(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        try:
            match = acl_filter(req.body, "_filter")
        except _Invalid as e:
            return {"throttle_time_ms": 0, "error_code": ErrorCode.INVALID_REQUEST, "error_message": str(e)}
        groups: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
        for b in self.ctx.security.state.acls:
            if match.matches(b):
                groups.setdefault((b.resource_type, b.name, b.pattern), []).append(_row(b))
        resources = [
            {"resource_type": rtype, "resource_name": name, "pattern_type": pattern, "acls": acls}
            for (rtype, name, pattern), acls in groups.items()
        ]
        return {"throttle_time_ms": 0, "error_code": 0, "error_message": None, "resources": resources}

    async def create_acls(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        creations = req.body.get("creations") or []
        results: list[dict[str, Any]] = []
        made: list[AclBinding] = []
        for c in creations:
            try:
                made.append(binding(c))
                results.append({"error_code": 0, "error_message": None})
            except _Invalid as e:
                results.append({"error_code": ErrorCode.INVALID_REQUEST, "error_message": str(e)})
        problem = self._writable() if made else None
        if problem is not None:
            results = [{"error_code": problem[0], "error_message": problem[1]} for _c in creations]
        elif made:
            await self.ctx.security.change(lambda s: s.with_acls(made))
            log.info("kafka: %s:%d created %d ACLs", peer.host, peer.port, len(made))
        return {"throttle_time_ms": 0, "results": results}

    async def delete_acls(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        filters = req.body.get("filters") or []
        parsed: list[AclFilter | str] = []
        for f in filters:
            try:
                parsed.append(acl_filter(f, "_filter"))
            except _Invalid as e:
                parsed.append(str(e))
        problem = self._writable() if any(isinstance(p, AclFilter) for p in parsed) else None
        if problem is not None:
            rows = [{"error_code": problem[0], "error_message": problem[1], "matching_acls": []} for _f in filters]
            return {"throttle_time_ms": 0, "filter_results": rows}
        gone: list[list[AclBinding]] = [[] for _p in parsed]

        def make(state: SecurityState) -> SecurityState:
            # Each filter reports every binding it matches (as Kafka does), though an
            # earlier filter of the request removes it too.
            for i, p in enumerate(parsed):
                if isinstance(p, AclFilter):
                    gone[i] = [b for b in state.acls if p.matches(b)]
            for p in parsed:
                if isinstance(p, AclFilter):
                    state, _removed = state.without_acls(p)
            return state

        await self.ctx.security.change(make)
        rows = []
        for p, removed in zip(parsed, gone):
            if isinstance(p, str):
                rows.append({"error_code": ErrorCode.INVALID_REQUEST, "error_message": p, "matching_acls": []})
                continue
            matching = [
                {
                    "error_code": 0,
                    "error_message": None,
                    "resource_type": b.resource_type,
                    "resource_name": b.name,
                    "pattern_type": b.pattern,
                    **_row(b),
                }
                for b in removed
            ]
            rows.append({"error_code": 0, "error_message": None, "matching_acls": matching})
        if any(gone):
            log.info("kafka: %s:%d deleted %d ACLs", peer.host, peer.port, sum(len(g) for g in gone))
        return {"throttle_time_ms": 0, "filter_results": rows}
