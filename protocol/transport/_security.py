"""How a client secures its connections: TLS (:class:`TlsSettings`, the server's
certificate checked against a CA, a client certificate for mutual TLS) and a login
(a SCRAM exchange with ``user`` and ``password`` right after connecting, before any
request of the application). One value for every client: the library's producers,
consumers and admin, the CLI, the Spark connector, and a broker's own outgoing
connections (registration, replication)."""

from __future__ import annotations

from dataclasses import dataclass, field

from clmq.protocol.auth import MECHANISMS

from ._tls import TlsSettings


@dataclass(frozen=True)
class ClientSecurity:
    """``tls``: None for plaintext. ``user`` empty: no login (anonymous, or the user a
    client certificate names). The password is kept out of ``repr``."""

    tls: TlsSettings | None = None
    user: str = ""
    password: str = field(default="", repr=False)
    mechanism: str = "SCRAM-SHA-256"

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism {self.mechanism!r}: must be one of {', '.join(MECHANISMS)}")
        if self.password and not self.user:
            raise ValueError("a password without a user: set user too")
