"""Throw-away certificates for development and tests (``clmq dev --tls``, tests/test_tls.py):
a CA, server and client certificates signed by it, and the broken kinds a test needs
(expired, self-signed, signed by another CA). Made with the ``cryptography`` package;
keys are EC P-256 (fast to make), PEM files, the key files readable by their owner only.

Never for production: the CA's key lies next to its certificate, unencrypted.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
DEFAULT_DAYS = 30


@dataclass(frozen=True)
class Ca:
    """A certificate authority: its certificate (``cert_file``, what peers trust: a
    ``tls_ca_file``) and its key (signs the certificates of :func:`make_cert`)."""

    name: str
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class CertFiles:
    """A certificate and its key (``tls_cert_file``, ``tls_key_file``), and the CA file
    that verifies it (the issuer's certificate; for a self-signed one, itself)."""

    name: str
    cert_file: Path
    key_file: Path
    ca_file: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "clmq dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def make_ca(directory: str | os.PathLike[str], name: str = "clmq-dev-ca", *, days: int = DEFAULT_DAYS) -> Ca:
    """A new CA in ``directory``: ``<name>.crt`` and ``<name>.key``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    key = _key()
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    ca = Ca(name, out / f"{name}.crt", out / f"{name}.key")
    _write_cert(ca.cert_file, cert)
    _write_key(ca.key_file, key)
    return ca


def _load_ca(ca: Ca) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(ca.cert_file.read_bytes())
    key = serialization.load_pem_private_key(ca.key_file.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_cert(
    ca: Ca | None,
    directory: str | os.PathLike[str],
    name: str,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    *,
    client: bool = False,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    self_signed: bool = False,
) -> CertFiles:
    """A certificate named ``name`` (its common name: for a client certificate, the user
    it names under mutual TLS) in ``directory`` (``<name>.crt``, ``<name>.key``).

    ``hosts``: the addresses and names a server certificate is valid for (subject
    alternative names). ``client``: made for client authentication (it is then valid
    for ``hosts`` as a server too, harmless). ``not_after`` in the past: an expired
    certificate. ``self_signed`` (or ``ca`` None): signed by its own key, not by ``ca``.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    key = _key()
    now = _now()
    start = not_before or now - dt.timedelta(minutes=5)
    end = not_after or now + dt.timedelta(days=DEFAULT_DAYS)
    if end <= start:
        start = end - dt.timedelta(days=1)
    if self_signed or ca is None:
        issuer_name, signing_key, issuer_ca_file = _name(name), key, out / f"{name}.crt"
        issuer_ski = None
    else:
        ca_cert, signing_key = _load_ca(ca)
        issuer_name, issuer_ca_file = ca_cert.subject, ca.cert_file
        issuer_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    if issuer_ski is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(issuer_ski), critical=False
        )
    cert = builder.sign(signing_key, hashes.SHA256())
    files = CertFiles(name, out / f"{name}.crt", out / f"{name}.key", issuer_ca_file)
    _write_cert(files.cert_file, cert)
    _write_key(files.key_file, key)
    return files


@dataclass(frozen=True)
class DevCerts:
    """What ``clmq dev --tls`` makes: a CA, one server certificate shared by the
    name server and the brokers (they also present it as clients to each other), and
    a client certificate for mutual TLS."""

    ca: Ca
    server: CertFiles
    client: CertFiles


def make_dev_certs(
    directory: str | os.PathLike[str], hosts: Sequence[str] = DEFAULT_HOSTS, *, client_name: str = "dev-client"
) -> DevCerts:
    """A CA and certificates for a development cluster on ``hosts``, in ``directory``
    (made anew each time: they are throw-away)."""
    ca = make_ca(directory, "clmq-dev-ca")
    server = make_cert(ca, directory, "clmq-server", hosts, client=True)
    client = make_cert(ca, directory, client_name, hosts, client=True)
    return DevCerts(ca, server, client)
