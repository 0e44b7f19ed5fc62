"""SaslHandshake and SaslAuthenticate: Kafka clients log in (docs/security.md#kafka-clients).

A connection to a broker with ``auth_enabled`` asks ApiVersions, then SaslHandshake
(v1: which mechanism; v0, listed because librdkafka requires it, is refused: after
it the SASL tokens would come as bare length-prefixed blobs, which only Kafka clients
before 1.0 send), then SaslAuthenticate requests carrying the mechanism's bytes:
SCRAM-SHA-256/512 in two rounds (RFC 5802/7677, the exchange of
:class:`clmq.protocol.auth.ScramServer`, the same users as the native protocol), or
PLAIN in one (``authzid NUL user NUL password``, checked against the user's SCRAM
credential by salting the password again). PLAIN is offered on TLS connections only:
on a plaintext one it would send the password in the clear.

A failed login is answered SASL_AUTHENTICATION_FAILED with the same words whatever was
wrong (user or password), ``auth_failure_delay_ms`` late, counted, logged with the
peer's address, audited, and the connection is closed, as Kafka does. So is a
handshake naming a mechanism not offered (UNSUPPORTED_SASL_MECHANISM, with the list)
and any SASL request out of turn (ILLEGAL_SASL_STATE). Until a login succeeds, any
other API but ApiVersions closes the connection (``KafkaService.dispatch``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import trio

from clmq.protocol.auth import MECHANISMS, ScramError, ScramServer, SecurityState, password_matches
from clmq.protocol.kafka import ErrorCode, KafkaRequest
from clmq.protocol.transport import AccessControl
from clmq.protocol.transport import Peer as SessionPeer

from ._listener import Closing, Peer

log = logging.getLogger("clmq.broker.kafka")

PLAIN = "PLAIN"
KNOWN_MECHANISMS = (*MECHANISMS, PLAIN)
MAX_PLAIN_BYTES = 4096  # a PLAIN message longer than this is refused unread


def session_peer(peer: Peer) -> SessionPeer:
    """The transport's view of a Kafka peer (what :class:`AccessControl` takes)."""
    return SessionPeer(peer.host, peer.port, peer.session)


@dataclass
class SaslLogin:
    """A login in progress on one connection (kept in its session's ``exchange``)."""

    mechanism: str
    scram: ScramServer | None = None  # after the first SCRAM message


def failed_text(mechanism: str) -> str:
    """Kafka's own words for a failed login: never which of user or password was wrong."""
    return f"Authentication failed during authentication due to invalid credentials with SASL mechanism {mechanism}"


class KafkaSasl:
    """The two SASL APIs over one broker's :class:`AccessControl`."""

    def __init__(self, access: AccessControl, state: Callable[[], SecurityState], mechanisms: list[str]) -> None:
        self.access = access
        self._state = state  # the users the access control decides by
        self.mechanisms = [m for m in mechanisms if m in KNOWN_MECHANISMS]
        self.failed = 0  # logins failed on the Kafka listener (the access control counts both listeners')

    def offered(self, peer: Peer) -> list[str]:
        """The mechanisms this connection may use: PLAIN only over TLS."""
        return [m for m in self.mechanisms if m != PLAIN or peer.session.tls]

    def logged_in(self, peer: Peer) -> bool:
        return not self.access.enabled or self.access.principal(session_peer(peer)) is not None

    # ------------------------------------------------------------ SaslHandshake
    async def handshake(self, req: KafkaRequest, peer: Peer) -> dict[str, Any] | Closing:
        asked = str(req.body.get("mechanism") or "")
        s = peer.session
        if not self.access.enabled:
            _closing(peer, f"SASL ({asked[:40]}) asked, but this broker has no authentication (auth_enabled = false)")
            return Closing({"error_code": ErrorCode.ILLEGAL_SASL_STATE, "mechanisms": []})
        offered = self.offered(peer)
        if req.api_version < 1:  # listed because librdkafka requires it; v1 is what clients send
            _closing(peer, "SaslHandshake v0 (bare SASL tokens, clients before Kafka 1.0) is not supported")
            return Closing({"error_code": ErrorCode.UNSUPPORTED_VERSION, "mechanisms": offered})
        if s.exchange is not None or (s.principal is not None and s.cert_user is None):
            _closing(peer, "SaslHandshake out of turn (a login is done or under way)")
            return Closing({"error_code": ErrorCode.ILLEGAL_SASL_STATE, "mechanisms": offered})
        if asked not in offered:
            why = "PLAIN is offered on TLS connections only (SASL_SSL)" if asked == PLAIN else "not offered"
            _closing(peer, f"SASL mechanism {asked[:40]!r} asked: {why}; offered: {', '.join(offered) or 'none'}")
            return Closing({"error_code": ErrorCode.UNSUPPORTED_SASL_MECHANISM, "mechanisms": offered})
        s.exchange = SaslLogin(asked)
        return {"error_code": 0, "mechanisms": offered}

    # ------------------------------------------------------------ SaslAuthenticate
    async def authenticate(self, req: KafkaRequest, peer: Peer) -> dict[str, Any] | Closing:
        s = peer.session
        login = s.exchange
        if not self.access.enabled or not isinstance(login, SaslLogin):
            text = (
                "SASL is not enabled on this Kafka listener (the broker's auth_enabled is false)"
                if not self.access.enabled
                else "SaslAuthenticate without a SaslHandshake first, or after the login"
            )
            _closing(peer, text)
            return Closing(_auth_answer(ErrorCode.ILLEGAL_SASL_STATE, text))
        data = req.body.get("auth_bytes") or b""
        try:
            if login.mechanism == PLAIN:
                s.exchange = None
                user = await self._plain(data)
            elif login.scram is None:
                login.scram = self.access.scram_server(login.mechanism, accept_doubled_client_nonce=True)
                answer = login.scram.first(data)
                return _auth_answer(0, None, answer)
            else:
                s.exchange = None
                answer = login.scram.final(data)
                user = login.scram.user
                s.principal = f"User:{user}"
                self.access.stats.succeeded += 1
                log.debug("kafka: %s:%d logged in as %s (%s)", peer.host, peer.port, s.principal, login.mechanism)
                return _auth_answer(0, None, answer)
        except ScramError as e:
            s.exchange = None
            user = login.scram.user if login.scram is not None else _plain_user(data)
            return await self._failed(peer, login.mechanism, user, str(e))
        s.principal = f"User:{user}"
        self.access.stats.succeeded += 1
        log.debug("kafka: %s:%d logged in as %s (PLAIN)", peer.host, peer.port, s.principal)
        return _auth_answer(0, None, b"")

    async def _plain(self, data: bytes) -> str:
        """The user a PLAIN message proves; ScramError when it does not."""
        if len(data) > MAX_PLAIN_BYTES:
            raise ScramError(f"a PLAIN message of {len(data)} bytes")
        parts = data.split(b"\0")
        if len(parts) != 3:
            raise ScramError("a PLAIN message that is not authzid NUL user NUL password")
        try:
            authzid, user, password = (p.decode() for p in parts)
        except UnicodeDecodeError:
            raise ScramError("a PLAIN message that is not UTF-8") from None
        if not user or not password:
            raise ScramError("a PLAIN message with an empty user or password")
        if authzid and authzid != user:
            raise ScramError(f"a PLAIN message asking to act as {authzid[:64]!r} (authorization ids are not supported)")
        if not await trio.to_thread.run_sync(self._plain_ok, user, password):
            raise ScramError(f"wrong password for {user!r}, or no such user")
        return user

    def _plain_ok(self, user: str, password: str) -> bool:
        """Does ``password`` salt to the user's stored key? (An unknown user costs the
        same salting, against a decoy: no timing hint.)"""
        return password_matches(self._state(), user, password)

    async def _failed(self, peer: Peer, mechanism: str, user: str, why: str) -> Closing:
        self.failed += 1
        await self.access.login_failed(session_peer(peer), user, f"kafka {mechanism}", why)
        return Closing(_auth_answer(ErrorCode.SASL_AUTHENTICATION_FAILED, failed_text(mechanism)))


def _closing(peer: Peer, why: str) -> None:
    log.warning("kafka: closing the connection from %s:%d: %s", peer.host, peer.port, why)


def _plain_user(data: bytes) -> str:
    parts = data.split(b"\0")
    return parts[1].decode(errors="replace") if len(parts) == 3 else ""


def _auth_answer(code: int, text: str | None, data: bytes = b"") -> dict[str, Any]:
    return {"error_code": code, "error_message": text, "auth_bytes": data, "session_lifetime_ms": 0}
