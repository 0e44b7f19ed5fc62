"""The name server's logins and ACLs. It keeps no users of its own: they are read from
``security_file`` (the same format as a broker's ``security.json``, written by
``clmq user add --file`` and ``clmq acl add --file``) and read again when the file
changes, so rotating a password needs no restart.

Rules: registering or unregistering a broker is a CLUSTER_ACTION on the cluster
(brokers' users hold it; nobody else should), a route is DESCRIBE on its topic (what
a producer's WRITE or a consumer's READ implies), the cluster's listing DESCRIBE on
the cluster.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from clmq.protocol import RequestCode
from clmq.protocol.auth import CLUSTER_NAME, Operation, ResourceType, SecurityState, load_security
from clmq.protocol.transport import AccessControl, Rule, open_audit_log

log = logging.getLogger("clmq.security")
RECHECK_S = 1.0  # the file's modification time is looked at no more often than this


def _cluster(op: Operation) -> Rule:
    return lambda fields: [(op, ResourceType.CLUSTER, CLUSTER_NAME)]


NAMESERVER_RULES: dict[int, Rule] = {
    RequestCode.REGISTER_BROKER: _cluster(Operation.CLUSTER_ACTION),
    RequestCode.UNREGISTER_BROKER: _cluster(Operation.CLUSTER_ACTION),
    RequestCode.GET_ROUTE: lambda fields: [(Operation.DESCRIBE, ResourceType.TOPIC, fields["topic"])],
    RequestCode.GET_CLUSTER: _cluster(Operation.DESCRIBE),
}


class SecurityFile:
    """``security_file`` as last read; a file that cannot be read keeps the last good
    state (logged), so a half-copied file never locks everyone out."""

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self.state = SecurityState()
        self._stamp: Any = None
        self._checked = 0.0
        self.reload()

    def reload(self) -> None:
        if self.path is None:
            return
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        try:
            self.state = load_security(self.path)
        except Exception as e:  # MetadataError, ValueError: keep serving with the last state
            log.error(
                "name server: cannot read security_file %s (keeping the users and ACLs read before): %s", self.path, e
            )
            return
        self._stamp = stamp
        log.info("name server: %d users and %d ACLs from %s", len(self.state.users), len(self.state.acls), self.path)

    def current(self) -> SecurityState:
        now = time.monotonic()
        if now - self._checked >= RECHECK_S:
            self._checked = now
            self.reload()
        return self.state


def nameserver_access(
    enabled: bool, security_file: str, super_users: list[str], failure_delay_ms: int, audit: str = ""
) -> tuple[AccessControl, logging.Handler | None]:
    """The name server's access control, and the handler of its audit file (``audit``:
    a path, or "" for none)."""
    if enabled and not security_file:
        raise ValueError("auth_enabled on a name server needs security_file (its users and ACLs)")
    source = SecurityFile(security_file)
    access = AccessControl(
        "nameserver", enabled=enabled, state=source.current, super_users=super_users, failure_delay_ms=failure_delay_ms
    )
    return access, (open_audit_log(audit, access.name) if audit else None)
