"""Who may read a service's metrics over HTTP: on loopback anyone (only this machine
reaches it); elsewhere, with logins on (``auth_enabled``), an HTTP Basic login of a
user whose password matches its stored SCRAM credential and who may DESCRIBE the
cluster (super users may). A wrong user or password is a failed login like any other
(answered after the failure delay, counted in ``clmq_login_failures_total``, logged
with the peer's address, audited); a user without DESCRIBE is a denial (counted in
``clmq_requests_denied_total``, audited)."""

from __future__ import annotations

import logging

import trio

from clmq.protocol.auth import CLUSTER_NAME, Operation, ResourceType, password_matches

from ._access import AccessControl, is_loopback
from ._handler import Peer, Session
from ._http import Login

log = logging.getLogger("clmq.security")
METRICS_NEEDS = ((Operation.DESCRIBE, ResourceType.CLUSTER, CLUSTER_NAME),)


def metrics_login_required(bind_host: str, auth_enabled: bool) -> bool:
    """Whether the metrics page on ``bind_host`` asks for a login (a non-loopback host
    without ``auth_enabled`` is refused at start, or allowed openly by ``allow_anonymous``)."""
    return auth_enabled and not is_loopback(bind_host)


def metrics_login(access: AccessControl, bind_host: str) -> Login | None:
    """The ``login`` of :func:`serve_http` for a service's metrics on ``bind_host``, or
    None where none is asked for (:func:`metrics_login_required`)."""
    if not metrics_login_required(bind_host, access.enabled):
        return None
    state = access.state  # the service's users (the broker's replicated state, the name server's file)

    async def login(user: str, password: str, host: str) -> bool:
        # The password is salted as its credential says (PBKDF2): off the event loop.
        if not await trio.to_thread.run_sync(password_matches, state(), user, password):
            await access.login_failed(Peer(host, 0), user, "metrics http", "wrong user or password")
            return False
        peer = Peer(host, 0, Session(principal=f"User:{user}"))
        if access.refusal(peer, METRICS_NEEDS, "GET /metrics") is not None:
            log.warning("%s: %s from %s may not read the metrics (DESCRIBE on the cluster)", access.name, user, host)
            return False
        access.stats.succeeded += 1
        return True

    return login
