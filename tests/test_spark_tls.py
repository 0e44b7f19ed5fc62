"""The Spark reader's network mode against a secured cluster (issue 31): TLS on its
own blocking sockets and a SCRAM login before its first request, from the options
tlsCaFile, tlsCertFile, tlsKeyFile, user, password (the sink's names); a real local
SparkSession reads a topic of a TLS name server and broker with logins on, as a user
with READ on every topic and nothing more. A wrong password and a missing CA fail
with a message that says so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clmq.devtools import make_ca, make_cert
from clmq.protocol.transport import TlsSettings
from clmq.spark_connector._options import OptionError, parse_options
from tests.secured_cluster import Secured, cluster_acl, secured_cluster_in_thread, topic_acl

READER = ("reader", "reader-pw")
BODIES = [b"secret #%d" % i for i in range(60)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    root = tmp_path_factory.mktemp("spark-tls")
    ca = make_ca(root, "test-ca")
    server = make_cert(ca, root, "server", client=True)
    tls = {
        "tls_cert_file": str(server.cert_file),
        "tls_key_file": str(server.key_file),
        "tls_ca_file": str(ca.cert_file),
    }
    with secured_cluster_in_thread(
        root,
        [READER],
        [topic_acl("reader", "READ")],  # READ on every topic: what Spark's log reads need
        [cluster_acl("reader", "DESCRIBE")],  # the name server's list of brokers
        server_tls=tls,
        client_tls=TlsSettings(ca_file=str(ca.cert_file)),
        topics={"vault": 3},
        messages={"vault": BODIES},
    ) as s:
        yield s


def _options(s: Secured, **more: str) -> dict[str, str]:
    assert s.tls is not None
    return {"topics": "vault", "tlsCaFile": s.tls.ca_file, "user": READER[0], "password": READER[1], **more}


def test_the_reader_reads_a_topic_through_tls_with_a_login(spark: Any, secured: Secured) -> None:
    for where in ({"nameserver": secured.ns}, {"broker": secured.broker}):
        for extra in ({}, {"readPath": "index"}):
            df = spark.read.format("clmq").options(**_options(secured, **where, **extra)).load()
            rows = df.select("topic", "queue_id", "body").collect()
            assert sorted(bytes(r.body) for r in rows) == sorted(BODIES), (where, extra)
            assert {r.queue_id for r in rows} == {0, 1, 2}


def test_a_wrong_password_a_wrong_ca_or_no_tls_fail_with_a_clear_message(
    spark: Any, secured: Secured, tmp_path: Path
) -> None:
    def read(**options: str) -> None:
        spark.read.format("clmq").options(**options).load().collect()

    with pytest.raises(Exception, match=r"login as 'reader' to 127\.0\.0\.1:[0-9]+ failed: authentication failed"):
        read(**_options(secured, nameserver=secured.ns, password="wrong"))
    other_ca = make_ca(tmp_path, "another-ca")
    with pytest.raises(Exception, match=r"TLS handshake with 127\.0\.0\.1:[0-9]+ failed: certificate verify failed"):
        read(**_options(secured, broker=secured.broker, tlsCaFile=str(other_ca.cert_file)))
    plaintext = {k: v for k, v in _options(secured, broker=secured.broker).items() if k != "tlsCaFile"}
    with pytest.raises(Exception, match=r"127\.0\.0\.1:[0-9]+: TLS_REQUIRED: .*option: tlsCaFile"):
        read(**plaintext)


def test_without_a_login_the_broker_refuses_the_reader(spark: Any, secured: Secured) -> None:
    assert secured.tls is not None
    with pytest.raises(Exception, match="AUTHENTICATION_REQUIRED"):
        spark.read.format("clmq").options(
            broker=secured.broker, topics="vault", tlsCaFile=secured.tls.ca_file
        ).load().collect()


def test_security_options_are_parsed_and_the_password_kept_out_of_repr(tmp_path: Path) -> None:
    opts = parse_options({"broker": "127.0.0.1:10911", "TLSCAFILE": "/ca.pem", "user": "reader", "Password": "pw"})
    assert dict(opts.security) == {"tlsCaFile": "/ca.pem", "user": "reader", "password": "pw"}
    assert "pw" not in repr(opts)
    assert parse_options({"broker": "127.0.0.1:10911"}).security == ()
    with pytest.raises(OptionError, match="password without option user"):
        parse_options({"broker": "127.0.0.1:10911", "password": "pw"})
    with pytest.raises(OptionError, match="network mode"):
        parse_options({"path": str(tmp_path), "user": "reader"})
    from clmq.spark_connector._wire import client_security

    with pytest.raises(OptionError, match="tlsCaFile"):
        client_security((("tlsCaFile", "/nonexistent.pem"),))
