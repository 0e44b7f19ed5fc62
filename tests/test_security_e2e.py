"""The whole stack secured, through the public library: a name server and a broker
with TLS and logins on (the broker registering as its own user), an application user
whose ACLs allow exactly its topic and group, a user refused what it may not do, and
a mutual-TLS certificate that logs its connection in as the user it names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from clmq import ClientSecurity, TlsSettings, open_admin, open_consumer, open_producer
from clmq.client import NoRouteError
from clmq.devtools.certs import make_ca, make_cert
from clmq.nameserver import NameServerConfig
from clmq.nameserver import serve as serve_nameserver
from clmq.protocol.auth import AclBinding, SecurityState, make_credential, save_security
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until


def acl(*cells: str) -> AclBinding:
    return AclBinding.from_json(list(cells))


def users(*pairs: tuple[str, str], acls: list[AclBinding] = ()) -> SecurityState:  # type: ignore[assignment]
    state = SecurityState()
    for user, password in pairs:
        mechanisms = ["SCRAM-SHA-512"] if user == "app" else ["SCRAM-SHA-256", "SCRAM-SHA-512"]
        state = state.with_user(user, [make_credential(m, password, iterations=4096) for m in mechanisms])
    return state.with_acls(list(acls))


@pytest.fixture
async def secured(nursery: trio.Nursery, tmp_path: Path) -> dict[str, Any]:
    ca = make_ca(tmp_path, "ca")
    server = make_cert(ca, tmp_path, "server", client=True)
    alice_cert = make_cert(ca, tmp_path, "alice", client=True)
    tls = {
        "tls_cert_file": str(server.cert_file),
        "tls_key_file": str(server.key_file),
        "tls_ca_file": str(ca.cert_file),
    }
    broker_right = acl("CLUSTER", "kafka-cluster", "LITERAL", "User:broker", "*", "CLUSTER_ACTION", "ALLOW")
    app_rights = [
        acl("TOPIC", "orders", "LITERAL", "User:app", "*", "WRITE", "ALLOW"),
        acl("TOPIC", "orders", "LITERAL", "User:app", "*", "READ", "ALLOW"),
        acl("GROUP", "billing", "LITERAL", "User:app", "*", "READ", "ALLOW"),
        acl("TOPIC", "orders", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"),
    ]
    everyone = (("admin", "admin-pw"), ("broker", "broker-pw"), ("app", "app-pw"), ("eve", "eve-pw"))
    save_security(tmp_path / "ns-security.json", users(*everyone, acls=[broker_right, *app_rights]))
    (tmp_path / "broker-a").mkdir()
    save_security(tmp_path / "broker-a" / "security.json", users(*everyone, acls=[broker_right, *app_rights]))
    cluster = Cluster(nursery, tmp_path)
    auth = {"auth_enabled": True, "super_users": ["User:admin"], "auth_failure_delay_ms": 50}
    cluster.nameserver = await nursery.start(
        serve_nameserver,
        NameServerConfig(
            listen_port=0,
            broker_expiry_ms=1500,
            scan_interval_ms=100,
            security_file=str(tmp_path / "ns-security.json"),
            **tls,
            **auth,
        ),
    )
    await cluster.start_broker("broker-a", broker_user="broker", broker_password="broker-pw", **tls, **auth)
    client_tls = TlsSettings(ca_file=str(ca.cert_file))
    admin = ClientSecurity(client_tls, "admin", "admin-pw", "SCRAM-SHA-512")
    async with open_admin(cluster.ns, security=admin) as a:
        await await_until(a.brokers, 10, "the broker registers (logged in as its own user)")
        await a.create_topic("orders", 2)
        await a.create_topic("payments", 1)
    return {
        "cluster": cluster,
        "app": ClientSecurity(client_tls, "app", "app-pw", "SCRAM-SHA-512"),
        "eve": ClientSecurity(client_tls, "eve", "eve-pw", "SCRAM-SHA-512"),
        "alice_cert": ClientSecurity(
            TlsSettings(str(alice_cert.cert_file), str(alice_cert.key_file), str(ca.cert_file))
        ),
    }


async def test_an_application_user_produces_and_consumes_what_its_acls_allow(secured: dict[str, Any]) -> None:
    ns = secured["cluster"].ns
    async with open_producer(ns, security=secured["app"]) as producer:
        for i in range(10):
            await producer.send("orders", f"o{i}".encode())
        with pytest.raises(NoRouteError, match="NOT_AUTHORIZED: User:app may not DESCRIBE topic 'payments'"):
            await producer.send("payments", b"not mine")
    got: list[bytes] = []
    async with open_consumer(ns, "billing", {"orders": "*"}, security=secured["app"], **FAST_CONSUMER) as consumer:
        with trio.fail_after(20):
            while len(got) < 10:
                records = await consumer.receive()
                got += [r.body for r in records]
                if b"o3" in [r.body for r in records]:
                    # A failed message comes back through the group's retry topic, which
                    # READ on the group covers (no ACL on %RETRY%billing needed).
                    await consumer.nack([r for r in records if r.body == b"o3"], delay_ms=100)
            while got.count(b"o3") < 2:
                got += [r.body for r in await consumer.receive()]
    assert sorted(set(got)) == sorted(f"o{i}".encode() for i in range(10))


async def test_a_user_without_acls_is_refused_and_stores_nothing(secured: dict[str, Any]) -> None:
    ns = secured["cluster"].ns
    with pytest.raises(NoRouteError, match="NOT_AUTHORIZED"):
        async with open_producer(ns, security=secured["eve"]) as producer:
            await producer.send("orders", b"eve was here")
    broker = secured["cluster"].brokers["broker-a"]
    assert broker.store.max_offset("orders", 0) + broker.store.max_offset("orders", 1) == 0


async def test_a_client_certificate_logs_in_as_the_user_it_names(secured: dict[str, Any]) -> None:
    """mutual TLS without SCRAM: the certificate's CN (alice) is the principal; alice
    may write orders (an ACL), nothing else."""
    ns = secured["cluster"].ns
    async with open_producer(ns, security=secured["alice_cert"]) as producer:
        result = await producer.send("orders", b"from alice's certificate")
        assert result.queue_offset >= 0
        with pytest.raises(NoRouteError, match="NOT_AUTHORIZED"):
            await producer.send("payments", b"not hers")


async def test_a_consumer_without_the_right_acls_is_told_at_once(secured: dict[str, Any]) -> None:
    ns = secured["cluster"].ns
    with trio.fail_after(10), pytest.raises(NoRouteError, match="NOT_AUTHORIZED") as refused:
        async with open_consumer(ns, "billing", {"orders": "*"}, security=secured["eve"], **FAST_CONSUMER) as consumer:
            await consumer.receive()
    assert "User:eve" in str(refused.value)
