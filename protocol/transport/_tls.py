"""TLS settings and the ``ssl.SSLContext`` each end makes of them.

One dataclass for every end (broker and name server listeners, the Kafka listener,
the HTTP servers, clients, followers): certificate and key (PEM files), the CA that
peers' certificates must chain to, whether a server requires a client certificate
(mutual TLS), the lowest TLS version accepted. trio's ``SSLStream`` runs the
protocol over these contexts; sendfile cannot go through TLS, so a TLS connection's
stored bytes are read and sent (docs/security.md says what that costs).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from clmq.common import ConfigError

TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
DEFAULT_HANDSHAKE_TIMEOUT_MS = 10_000


class TlsSettingsError(ConfigError):
    """TLS settings that cannot work (a missing file, a key that does not match)."""


@dataclass(frozen=True)
class TlsSettings:
    """TLS for one end. A server needs ``cert_file`` and ``key_file``; a client needs
    ``ca_file`` (or the system's CAs) and, for mutual TLS, its own cert and key."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""  # "": the system's default CAs
    require_client_cert: bool = False  # server: mutual TLS
    min_version: str = "1.2"
    server_hostname: str = ""  # client: the name the server's certificate must carry ("": the host connected to)
    handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS

    def __post_init__(self) -> None:
        if self.min_version not in TLS_VERSIONS:
            raise TlsSettingsError(
                f"tls min_version must be one of {', '.join(TLS_VERSIONS)}, got {self.min_version!r}"
            )
        if bool(self.cert_file) != bool(self.key_file):
            raise TlsSettingsError("tls cert_file and key_file go together: set both or neither")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise TlsSettingsError(f"tls {name} {path!r} does not exist or is not a file")
        if self.handshake_timeout_ms < 1:
            raise TlsSettingsError("tls handshake_timeout_ms must be at least 1")

    def _base(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=self.ca_file or None)
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        if self.cert_file:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as e:
                raise TlsSettingsError(
                    f"cannot load tls cert_file {self.cert_file!r} with key_file {self.key_file!r}: {e}"
                ) from None
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """A listener's context: its certificate; client certificates verified against
        ``ca_file``: required with ``require_client_cert``; else, with a ``ca_file``,
        asked for but optional (Kafka's ``ssl.client.auth=requested``: a client that
        offers one is verified, and its certificate names its user); else not asked for."""
        if not self.cert_file:
            raise TlsSettingsError("a TLS listener needs tls cert_file and key_file")
        ctx = self._base(ssl.Purpose.CLIENT_AUTH)
        if self.require_client_cert:
            ctx.verify_mode = ssl.CERT_REQUIRED
        else:
            ctx.verify_mode = ssl.CERT_OPTIONAL if self.ca_file else ssl.CERT_NONE
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A client's context: the server's certificate verified against ``ca_file``
        and its name; its own certificate offered when set (mutual TLS)."""
        ctx = self._base(ssl.Purpose.SERVER_AUTH)
        ctx.check_hostname = True
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def tls_settings(
    *,
    cert_file: str = "",
    key_file: str = "",
    ca_file: str = "",
    require_client_cert: bool = False,
    min_version: str = "1.2",
) -> TlsSettings | None:
    """TLS settings from a service's flat settings, or None when none is set (plaintext).
    Every setting is checked either way: a wrong one is an error even while unused."""
    if min_version not in TLS_VERSIONS:
        raise TlsSettingsError(f"tls min_version must be one of {', '.join(TLS_VERSIONS)}, got {min_version!r}")
    if require_client_cert and not ca_file:
        raise TlsSettingsError("tls require_client_cert needs tls ca_file (the CA client certificates chain to)")
    if not (cert_file or key_file or ca_file):
        return None
    return TlsSettings(cert_file, key_file, ca_file, require_client_cert, min_version)


def tls_settings_of(config: object) -> TlsSettings | None:
    """:func:`tls_settings` of a service's config (its ``tls_cert_file``,
    ``tls_key_file``, ``tls_ca_file``, ``tls_require_client_cert``, ``tls_min_version``)."""
    names = ("cert_file", "key_file", "ca_file", "require_client_cert", "min_version")
    return tls_settings(**{name: getattr(config, f"tls_{name}") for name in names})


def peer_identity(cert: dict[str, object] | None) -> str | None:
    """The user a verified client certificate names: its subject's common name
    (mutual TLS identities map to users by CN, as Kafka's default principal builder
    maps them to ``User:CN=...``; clmq keeps the CN alone so that it names a user)."""
    if not cert:
        return None
    for rdn in cert.get("subject", ()):  # type: ignore[attr-defined]
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
