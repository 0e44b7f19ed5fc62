"""A broker's users and ACLs: kept in ``<data_dir>/security.json`` (the durable
metadata format), changed on the group's leader only (USER_*/ACL_* requests, Kafka's
CreateAcls/DeleteAcls), copied by followers with the rest of the metadata, and the
:class:`AccessControl` both listeners decide by."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

import trio

from clmq.protocol import ErrorCode
from clmq.protocol.auth import SECURITY_FILE, SecurityState, load_security, save_security
from clmq.protocol.transport import AccessControl, Need, Peer, RequestError, open_audit_log

from ._config import BrokerConfig

log = logging.getLogger("clmq.security")


class BrokerSecurity:
    """The state, its file, its changes; ``access`` decides."""

    def __init__(self, config: BrokerConfig, directory: Path, bump: Callable[[], None]) -> None:
        self.path = directory / SECURITY_FILE
        self.state = load_security(self.path)  # MetadataError if no generation checks
        self._bump = bump  # followers copy the change (ReplicatedMetadata.bump)
        self._lock = trio.Lock()  # one change at a time (read, change, write, swap)
        self._file_lock = threading.Lock()  # the file's writers: changes and copies, both in worker threads
        self.access = AccessControl(
            f"broker {config.broker_name}",
            enabled=config.auth_enabled,
            state=lambda: self.state,
            super_users=config.super_users,
            failure_delay_ms=config.auth_failure_delay_ms,
        )
        self._audit_handler: logging.Handler | None = None
        audit = config.audit_log or (str(directory / "audit.log") if config.auth_enabled else "-")
        if audit != "-":
            self._audit_handler = open_audit_log(audit, self.access.name)

    def check(self, peer: Peer, needs: Iterable[Need], what: str) -> None:
        """Raise NOT_AUTHORIZED unless ``peer`` may do all of ``needs`` (nothing with
        authentication off). For handlers whose resources are known only once they
        read them (a record's topic, the topics of the whole log, a client's groups)."""
        if self.access.enabled:
            refused = self.access.refusal(peer, needs, what)
            if refused is not None:
                raise RequestError(ErrorCode.NOT_AUTHORIZED, refused.error_text)

    def close(self) -> None:
        if self._audit_handler is not None:
            logging.getLogger("clmq.audit").removeHandler(self._audit_handler)
            self._audit_handler.close()

    async def change(self, make: Callable[[SecurityState], SecurityState]) -> SecurityState:
        """Apply ``make`` to the state, durably, then decide by the new state (the caller
        checked that this broker is its group's leader)."""
        async with self._lock:
            new = make(self.state)
            if new is not self.state:
                await trio.to_thread.run_sync(self._save, new)
                self.state = new
                self._bump()
            return new

    def _save(self, state: SecurityState) -> None:
        """Write the file (in a worker thread): one writer at a time, whether a change
        on the leader or a copy from it (a broker stepping down may do both at once)."""
        with self._file_lock:
            save_security(self.path, state)

    # ------------------------------------------------------------ replication
    def snapshot(self) -> dict[str, Any]:
        return self.state.to_json()

    def adopt(self, value: dict[str, Any]) -> None:
        """A follower makes the leader's state its own (runs in a worker thread)."""
        new = SecurityState.from_json(value)
        if new.to_json() != self.state.to_json():
            self._save(new)
            self.state = new
            log.info("users and ACLs copied from the leader (version %d)", new.version)
