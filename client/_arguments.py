"""What the clients' entry points share about their arguments: addresses given as one
string or a list, ``CLMQ_NAMESRV`` read when none is given (here only: every client,
trio, asyncio or blocking, resolves its addresses through :func:`resolve_addrs`), the
security (TLS, a login) read from ``CLMQ_TLS_*``, ``CLMQ_USER`` and ``CLMQ_PASSWORD``
when none is given (:func:`resolve_security`), and options dataclasses filled from the
keyword parameters that name each option."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence, TypeVar

from clmq.protocol.transport import ClientSecurity, tls_settings

NAMESRV_ENV = "CLMQ_NAMESRV"
TLS_CA_FILE_ENV = "CLMQ_TLS_CA_FILE"  # the CA the servers' certificates chain to: TLS on
TLS_CERT_FILE_ENV = "CLMQ_TLS_CERT_FILE"  # with CLMQ_TLS_KEY_FILE: this client's certificate (mutual TLS)
TLS_KEY_FILE_ENV = "CLMQ_TLS_KEY_FILE"
USER_ENV = "CLMQ_USER"
PASSWORD_ENV = "CLMQ_PASSWORD"

T = TypeVar("T")


def addr_list(addrs: str | Sequence[str] | None, what: str = "address") -> list[str]:
    """``"h1:9876,h2:9876"`` or ``["h1:9876", "h2:9876"]`` (or None) as a list of
    ``host:port``; ``ValueError`` naming ``what`` for anything else."""
    if addrs is None:
        return []
    if isinstance(addrs, str):
        parts = addrs.split(",")
    else:
        parts = []
        for addr in addrs:
            if not isinstance(addr, str):
                raise ValueError(f"{what}: {addr!r} is not an address (give 'host:port' strings)")
            parts += addr.split(",")
    found = [part.strip() for part in parts if part.strip()]
    for addr in found:
        _check_addr(addr, what)
    return found


def _check_addr(addr: str, what: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: {addr!r} is not host:port (e.g. 127.0.0.1:9876)")


def resolve_addrs(
    namesrv_addrs: str | Sequence[str] | None, broker_addrs: str | Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """A client's name servers and brokers as lists. Given neither, the name servers are
    ``$CLMQ_NAMESRV`` (comma separated), as for the ``clmq`` command; ``ValueError`` if
    that is not set either."""
    namesrv = addr_list(namesrv_addrs, "namesrv_addrs")
    brokers = addr_list(broker_addrs, "broker_addrs")
    if not namesrv and not brokers:
        namesrv = addr_list(os.environ.get(NAMESRV_ENV), f"${NAMESRV_ENV}")
        if not namesrv:
            raise ValueError(
                f"no address: give name server addresses (or set ${NAMESRV_ENV}), "
                "or broker addresses for a direct connection"
            )
    return namesrv, brokers


def resolve_security(security: ClientSecurity | None) -> ClientSecurity | None:
    """A client's security: ``security`` if given, else what the environment says
    (``$CLMQ_TLS_CA_FILE``, ``$CLMQ_TLS_CERT_FILE``, ``$CLMQ_TLS_KEY_FILE`` for TLS;
    ``$CLMQ_USER`` and ``$CLMQ_PASSWORD`` for a login), else None (plaintext, no
    login). ``ValueError`` naming the variables for settings that cannot work."""
    if security is not None:
        if not isinstance(security, ClientSecurity):
            raise ValueError(f"security={security!r}: must be a ClientSecurity")
        return security
    env = os.environ
    try:
        tls = tls_settings(
            cert_file=env.get(TLS_CERT_FILE_ENV, ""),
            key_file=env.get(TLS_KEY_FILE_ENV, ""),
            ca_file=env.get(TLS_CA_FILE_ENV, ""),
        )
        user = env.get(USER_ENV, "")
        if tls is None and not user:
            return None
        return ClientSecurity(tls, user, env.get(PASSWORD_ENV, "") if user else "")
    except ValueError as e:
        raise ValueError(
            f"${TLS_CA_FILE_ENV}, ${TLS_CERT_FILE_ENV}, ${TLS_KEY_FILE_ENV}, ${USER_ENV}, ${PASSWORD_ENV}: {e}"
        ) from None


def options_from(cls: type[T], values: Mapping[str, Any]) -> T:
    """The options dataclass ``cls`` made of an entry point's keyword parameters
    (``locals()`` at its start). Why: every entry point names each option in its
    signature (typed, with its default: an IDE completes them, a misspelt one is a
    TypeError at the call), and this picks them up without a list repeated per entry
    point; tests/test_client_options.py checks that each signature names every option."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{name: values[name] for name in names})
