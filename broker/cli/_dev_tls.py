"""``clmq dev --tls``: a throw-away CA and certificates in the dev data directory
(``<data-dir>/tls/``, made anew at each start), the name server and broker(s) serving
only TLS with them (the Kafka listener and the metrics too), and what a client needs
to connect: the CA file, the environment variables to export, a kcat line."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from clmq.broker.service import BrokerConfig
from clmq.nameserver import NameServerConfig

from ._common import environment
from ._output import console

if TYPE_CHECKING:  # cryptography loads only when certificates are made: `clmq broker` needs none
    from clmq.devtools import DevCerts


def with_dev_tls(base: BrokerConfig) -> tuple[BrokerConfig, DevCerts]:
    """``base`` with TLS on, and the certificates made for it (one server certificate
    for the name server and every replica, which also present it to each other)."""
    from clmq.devtools import make_dev_certs

    certs = make_dev_certs(Path(base.data_dir) / "tls", hosts=_hosts(base))
    config = dataclasses.replace(
        base,
        tls_cert_file=str(certs.server.cert_file),
        tls_key_file=str(certs.server.key_file),
        tls_ca_file=str(certs.ca.cert_file),
    )
    return config, certs


def _hosts(base: BrokerConfig) -> list[str]:
    hosts = ["127.0.0.1", "localhost"]
    for host in (base.listen_host, base.advertised_host):
        if host and host not in hosts and host not in ("0.0.0.0", "::"):
            hosts.append(host)
    return hosts


def dev_nameserver_config(port: int, broker: BrokerConfig) -> NameServerConfig:
    """The dev name server's settings: its port, and the broker's TLS settings."""
    return NameServerConfig(
        listen_port=port,
        tls_cert_file=broker.tls_cert_file,
        tls_key_file=broker.tls_key_file,
        tls_ca_file=broker.tls_ca_file,
    )


def client_env(certs: DevCerts) -> dict[str, str]:
    """What a client exports to connect (the library and the CLI read these)."""
    return {"CLMQ_TLS_CA_FILE": str(certs.ca.cert_file)}


@contextlib.contextmanager
def dev_client_env(certs: DevCerts | None) -> Iterator[None]:
    """The dev command's own clients (the demo, its waits) connect through TLS too."""
    if certs is None:
        yield
        return
    with environment(client_env(certs)):
        yield


def tls_ready(certs: DevCerts, kafka: str) -> dict[str, Any]:
    """The TLS part of the ready block (and of its JSON)."""
    env = client_env(certs)
    info: dict[str, Any] = {
        "ca_file": str(certs.ca.cert_file),
        "client_cert_file": str(certs.client.cert_file),
        "client_key_file": str(certs.client.key_file),
        "env": env,
    }
    if kafka:
        info["kcat"] = f"kcat -b {kafka} -X security.protocol=ssl -X ssl.ca.location={certs.ca.cert_file} -L"
    return info


def print_tls_ready(info: dict[str, Any]) -> None:
    console.print(f"TLS on every port; the CA: {info['ca_file']}", highlight=False)
    console.print(
        "clients connect with: " + " ".join(f"export {k}={v};" for k, v in info["env"].items()),
        highlight=False,
    )
    console.print(
        f"  (mutual TLS, if the broker requires it: CLMQ_TLS_CERT_FILE={info['client_cert_file']} "
        f"CLMQ_TLS_KEY_FILE={info['client_key_file']})",
        highlight=False,
    )
    if "kcat" in info:
        console.print(f"kcat: {info['kcat']}", highlight=False)
