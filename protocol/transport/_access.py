"""Logins and access control for any :class:`RpcServer` (the broker and the name
server share it): the AUTHENTICATE handler (a SCRAM exchange at the start of a
connection), the guard every other handler sits behind (a login first, then the
request's fields, then the ACLs, all before the handler does anything), failed logins
(answered late, counted, logged with the peer's address, never saying which of user
or password was wrong) and the audit log (JSON lines).

A server says which resources and operations each request touches in a table of
*rules* (request code -> :data:`Rule`); a code without a rule cannot be served with
authentication on, so a new request cannot be added without deciding its ACL.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import trio

from clmq.common import RETRY_PREFIX
from clmq.protocol import SUPPORTED_VERSIONS, ErrorCode, Frame, check_request
from clmq.protocol.auth import (
    CLUSTER_NAME,
    MECHANISMS,
    Authorizer,
    Operation,
    ResourceType,
    ScramError,
    ScramServer,
    SecurityState,
)

from ._handler import Handler, Later, Peer, Reply

log = logging.getLogger("clmq.security")
audit_log = logging.getLogger("clmq.audit")
audit_log.propagate = False  # audit lines go only to the audit file a server opens (open_audit_log)
ADMIN_OPERATIONS = frozenset({Operation.CREATE, Operation.DELETE, Operation.ALTER, Operation.ALTER_CONFIGS})
"""Operations whose allowed requests are written to the audit log (administrative actions)."""


def open_audit_log(path: str, server: str) -> logging.Handler:
    """Send ``server``'s audit lines to ``path`` (appended); the caller removes the
    handler at stop. Several servers of one process (``clmq dev``, tests) each get their
    own lines only."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(lambda record: getattr(record, "clmq_server", None) == server)
    audit_log.addHandler(handler)
    audit_log.setLevel(logging.INFO)
    return handler


Need = tuple[Operation, ResourceType, str]  # one operation on one resource
Rule = Callable[[dict[str, Any]], Iterable[Need]]  # a request's fields -> what it needs (after the fields are checked)
OPEN: Rule = lambda fields: ()  # noqa: E731  # any logged-in principal


@dataclass
class LoginStats:
    """Counters of logins since start (exported as metrics)."""

    succeeded: int = 0
    failed: int = 0
    denied: int = 0  # requests the ACLs refused


def group_owned(op: Operation, rtype: ResourceType, name: str) -> tuple[Operation, ResourceType, str]:
    """A group's retry topic ``%RETRY%<group>`` belongs to the group: reading or
    describing it needs READ on the group (its consumers read it as part of their
    subscription), as in RocketMQ. Everything else is asked as it is."""
    if rtype is ResourceType.TOPIC and name.startswith(RETRY_PREFIX) and op in (Operation.READ, Operation.DESCRIBE):
        return Operation.READ, ResourceType.GROUP, name[len(RETRY_PREFIX) :]
    return op, rtype, name


class AccessControl:
    """One server's logins and decisions over a :class:`SecurityState` that the server
    supplies (``state()``: the broker's replicated state, the name server's file)."""

    def __init__(
        self,
        name: str,
        *,
        enabled: bool,
        state: Callable[[], SecurityState],
        super_users: Iterable[str] = (),
        failure_delay_ms: int = 1000,
    ) -> None:
        self.name = name
        self.enabled = enabled
        self._state = state
        self.super_users = frozenset(super_users)
        self.failure_delay_s = failure_delay_ms / 1000
        self.stats = LoginStats()
        self._authorizer: tuple[SecurityState, Authorizer] | None = None

    # ------------------------------------------------------------ decisions
    def authorizer(self) -> Authorizer:
        """The decisions of the current state (made again whenever the state is another
        object: the cache holds the state itself, never its id, which a new state may reuse)."""
        state = self._state()
        cached = self._authorizer
        if cached is None or cached[0] is not state:
            self._authorizer = cached = (state, state.authorizer(self.super_users))
        return cached[1]

    def state(self) -> SecurityState:
        """The users and ACLs decided by now."""
        return self._state()

    def principal(self, peer: Peer) -> str | None:
        """The peer's principal: a finished login, else a verified client certificate's user."""
        s = peer.session
        if s.principal is None and s.cert_user is not None and s.exchange is None:
            s.principal = f"User:{s.cert_user}"
        return s.principal

    def refusal(self, peer: Peer, needs: Iterable[Need], what: str) -> Reply | None:
        """None if ``peer`` may do all of ``needs``; else the NOT_AUTHORIZED reply (audited)."""
        principal = self.principal(peer) or "User:ANONYMOUS"
        authorizer = self.authorizer()
        for op, rtype, name in needs:
            if not authorizer.allowed(principal, peer.host, *group_owned(op, rtype, name)) and not (
                (op, rtype) == (Operation.CREATE, ResourceType.TOPIC)  # Kafka's rule: CREATE on the
                and authorizer.allowed(principal, peer.host, op, ResourceType.CLUSTER, CLUSTER_NAME)  # cluster too
            ):
                self.stats.denied += 1
                text = f"{principal} may not {op.name} {rtype.name.lower()} {name!r}"
                self.audit("denied", peer, principal, what, op.name, rtype.name, name)
                return Reply(error_code=ErrorCode.NOT_AUTHORIZED, error_text=text)
        return None

    def guard(self, handler: Handler, rule: Rule, what: str) -> Handler:
        """``handler`` behind the login check, :func:`check_request` and ``rule``'s ACLs."""

        async def guarded(frame: Frame, peer: Peer) -> Reply | Later:
            if self.enabled and self.principal(peer) is None:
                return Reply(
                    error_code=ErrorCode.AUTHENTICATION_REQUIRED,
                    error_text=f"{self.name} requires a login (AUTHENTICATE) before {what}",
                )
            problem = check_request(frame)
            if problem is not None:
                code, text = problem
                fields = {"versions": sorted(SUPPORTED_VERSIONS)} if code is ErrorCode.UNSUPPORTED_VERSION else {}
                return Reply(fields, error_code=code, error_text=text)
            if self.enabled:
                needs = list(rule(frame.fields))
                asker = self.on_behalf_of(frame.fields, peer, what)
                if isinstance(asker, Reply):
                    return asker
                refused = self.refusal(asker, needs, what)
                if refused is not None:
                    return refused
                for op, rtype, name in needs:
                    if op in ADMIN_OPERATIONS:
                        self.audit("admin", asker, asker.session.principal or "", what, op.name, rtype.name, name)
            return await handler(frame, peer)

        return guarded

    def on_behalf_of(self, fields: dict[str, Any], peer: Peer, what: str) -> Peer | Reply:
        """Whom a request's ACLs are decided for: its sender, or, for a request a broker
        forwards for its own client (field ``on_behalf_of``: [principal, host], as the
        Kafka listener forwards a commit to another broker group's leader; Kafka's
        envelope, KIP-590), that client, provided the sender holds CLUSTER_ACTION on
        the cluster (only brokers' users should). Anyone else asking so is refused."""
        behalf = fields.get("on_behalf_of")
        if behalf is None:
            return peer
        cluster = [(Operation.CLUSTER_ACTION, ResourceType.CLUSTER, CLUSTER_NAME)]
        refused = self.refusal(peer, cluster, f"{what} on behalf of another principal")
        if refused is not None:
            return refused
        if not (isinstance(behalf, list) and len(behalf) == 2 and all(type(x) is str for x in behalf)):
            text = "field 'on_behalf_of' must be [principal, host]"
            return Reply(error_code=ErrorCode.MALFORMED_REQUEST, error_text=text)
        forwarded = Peer(behalf[1], 0)
        forwarded.session.principal = behalf[0]
        return forwarded

    def guard_all(
        self, handlers: dict[int, Handler], rules: dict[int, Rule], names: Callable[[int], str]
    ) -> dict[int, Handler]:
        """Every handler behind :meth:`guard`; a code without a rule is an error here."""
        missing = sorted(set(handlers) - set(rules))
        if missing:
            raise AssertionError(f"{self.name}: request codes without an ACL rule: {missing}")
        return {code: self.guard(h, rules[code], names(code)) for code, h in handlers.items()}

    # ------------------------------------------------------------ logins
    async def authenticate(self, frame: Frame, peer: Peer) -> Reply:
        """AUTHENTICATE: one step of a SCRAM exchange (see protocol/_codes.py)."""
        s = peer.session
        data = frame.fields.get("data")
        if not self.enabled:  # a client configured with a user goes on without a login
            return Reply(error_code=ErrorCode.REQUEST_NOT_SUPPORTED, error_text=f"{self.name} has no logins")
        if type(data) is not bytes:
            return Reply(error_code=ErrorCode.MALFORMED_REQUEST, error_text="field 'data' missing or not bytes")
        if s.failed_logins:  # its failure's answer is being delayed, then it closes: no new try meanwhile
            return self._failure("a login of this connection failed: it is closing")
        if s.principal is not None and s.exchange is None:
            return self._failure(f"this connection is already logged in as {s.principal}")
        exchange = s.exchange
        try:
            if exchange is None:
                mechanism = frame.fields.get("mechanism")
                if mechanism not in MECHANISMS:
                    raise ScramError(f"unknown mechanism {mechanism!r:.40}")
                s.exchange = exchange = self.scram_server(str(mechanism))
                return Reply({"data": exchange.first(data), "done": False})
            s.exchange = None
            answer = exchange.final(data)
        except ScramError as e:
            s.exchange = None
            return await self.login_failed(peer, getattr(exchange, "user", ""), "native", str(e))
        s.principal = f"User:{exchange.user}"
        self.stats.succeeded += 1
        return Reply({"data": answer, "done": True, "principal": s.principal})

    def scram_server(self, mechanism: str, *, accept_doubled_client_nonce: bool = False) -> ScramServer:
        """A SCRAM exchange over the current users (``accept_doubled_client_nonce``:
        old librdkafka's form, for the Kafka listener; see :class:`ScramServer`)."""
        state = self._state()
        return ScramServer(
            mechanism,
            lambda user: state.credential(user, mechanism),
            lambda user: state.decoy(mechanism, user),
            accept_doubled_client_nonce=accept_doubled_client_nonce,
        )

    async def login_failed(self, peer: Peer, user: str, protocol: str, why: str) -> Reply:
        """A failed login: counted, logged with the peer address, audited, answered
        after ``failure_delay_ms`` with no hint of what was wrong."""
        self.stats.failed += 1
        peer.session.failed_logins += 1
        log.warning(
            "%s: failed login from %s:%d (%s, user %r): %s", self.name, peer.host, peer.port, protocol, user[:64], why
        )
        self.audit("login_failed", peer, f"User:{user[:64]}", f"{protocol} login", "", "", "")
        await trio.sleep(self.failure_delay_s)
        reply = self._failure("authentication failed")
        reply.close_after = True
        return reply

    def _failure(self, text: str) -> Reply:
        return Reply(error_code=ErrorCode.AUTHENTICATION_FAILED, error_text=text)

    # ------------------------------------------------------------ audit
    def audit(self, event: str, peer: Peer, principal: str, what: str, op: str, rtype: str, name: str) -> None:
        """One JSON line on the ``clmq.audit`` logger (the server points it at its file)."""
        if not audit_log.handlers:
            return
        line = {
            "time": round(time.time(), 3),
            "server": self.name,
            "event": event,
            "principal": principal,
            "peer": f"{peer.host}:{peer.port}",
            "request": what,
            "operation": op,
            "resource_type": rtype,
            "resource": name,
        }
        audit_log.info(json.dumps(line, sort_keys=True), extra={"clmq_server": self.name})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only;
    a host name other than ``localhost`` is assumed reachable from elsewhere."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def exposure_problem(what: str, host: str, auth_enabled: bool, allow_anonymous: bool) -> str | None:
    """Why ``what`` must not start: it would listen on a non-loopback ``host`` with no
    authentication, and ``allow_anonymous`` does not say that is meant."""
    if auth_enabled or allow_anonymous or is_loopback(host):
        return None
    return (
        f"{what} would listen on {host!r}, reachable from other machines, with no authentication: "
        "anyone could produce, read, delete topics and promote replicas. Set auth_enabled = true "
        "(docs/security.md), or allow_anonymous = true to accept that"
    )


def warn_if_anonymous(what: str, host: str, auth_enabled: bool) -> None:
    """At every start of a service allowed to listen openly: say so."""
    if not auth_enabled and not is_loopback(host):
        log.warning(
            "%s listens on %s with no authentication (allow_anonymous = true): anyone can do anything", what, host
        )
