"""A secured cluster for the tests of the pages and readers that must log in: a name
server and a broker with logins on (``auth_enabled``), optionally TLS on both, users
seeded offline as an operator would (security.json, the name server's file), run by
trio in a thread so that subprocesses and Spark can reach it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from clmq.client import NoRouteError, Routes, open_admin
from clmq.nameserver import NameServerConfig
from clmq.nameserver import serve as serve_nameserver
from clmq.protocol.auth import AclBinding, SecurityState, make_credential, save_security
from clmq.protocol.transport import ClientSecurity, TlsSettings
from tests.service_helpers import Cluster
from tests.waiting import await_until

BROKER_USER = ("broker", "broker-pw")
ADMIN = ("admin", "admin-pw")


def cluster_acl(user: str, operation: str) -> AclBinding:
    return AclBinding.from_json(["CLUSTER", "kafka-cluster", "LITERAL", f"User:{user}", "*", operation, "ALLOW"])


def topic_acl(user: str, operation: str, topic: str = "*") -> AclBinding:
    return AclBinding.from_json(["TOPIC", topic, "LITERAL", f"User:{user}", "*", operation, "ALLOW"])


def seed(path: Path, users: list[tuple[str, str]], acls: list[AclBinding]) -> None:
    state = SecurityState()
    for user, password in users:
        state = state.with_user(user, [make_credential("SCRAM-SHA-256", password, iterations=4096)])
    path.parent.mkdir(parents=True, exist_ok=True)
    save_security(path, state.with_acls(acls))


@dataclass
class Secured:
    cluster: Cluster
    tls: TlsSettings | None  # a client's (the CA), when the cluster speaks TLS
    topics: dict[str, int] = field(default_factory=dict)

    @property
    def ns(self) -> str:
        return self.cluster.ns[0]

    @property
    def broker(self) -> str:
        return next(iter(self.cluster.brokers.values())).addr

    def security(self, user: tuple[str, str]) -> ClientSecurity:
        return ClientSecurity(self.tls, *user)


@contextlib.contextmanager
def secured_cluster_in_thread(
    root: Path,
    users: list[tuple[str, str]],
    broker_acls: list[AclBinding],
    ns_acls: list[AclBinding],
    *,
    server_tls: dict[str, str] | None = None,
    client_tls: TlsSettings | None = None,
    topics: dict[str, int] | None = None,
    messages: dict[str, list[bytes]] | None = None,
) -> Iterator[Secured]:
    """A name server and a broker (``broker-a``) with logins on: ``admin`` a super user
    of both, ``broker`` the broker's own user (CLUSTER_ACTION on the name server), and
    ``users`` with the given ACLs; ``server_tls``: the ``tls_*`` settings of both,
    ``client_tls`` what clients trust. ``topics`` are created and ``messages`` sent as
    admin."""
    seed(root / "broker-a" / "security.json", [ADMIN, BROKER_USER, *users], broker_acls)
    seed(root / "ns-security.json", [ADMIN, BROKER_USER, *users], [cluster_acl("broker", "CLUSTER_ACTION"), *ns_acls])
    tls = server_tls or {}
    stop, started, ready = threading.Event(), threading.Event(), []

    async def serve() -> None:
        try:
            async with trio.open_nursery() as n:
                c = Cluster(n, root)
                c.nameserver = await n.start(
                    serve_nameserver,
                    NameServerConfig(
                        listen_port=0,
                        broker_expiry_ms=1500,
                        scan_interval_ms=100,
                        auth_enabled=True,
                        security_file=str(root / "ns-security.json"),
                        super_users=["User:admin"],
                        auth_failure_delay_ms=200,
                        **tls,
                    ),
                )
                await c.start_broker(
                    auth_enabled=True,
                    super_users=["User:admin"],
                    broker_user=BROKER_USER[0],
                    broker_password=BROKER_USER[1],
                    auth_failure_delay_ms=200,
                    **tls,
                )
                secured = Secured(c, client_tls, dict(topics or {}))
                await _fill(secured, messages or {})
                ready.append(secured)
                started.set()
                await trio.to_thread.run_sync(stop.wait, 300)
                n.cancel_scope.cancel()
        finally:
            started.set()

    server = threading.Thread(target=trio.run, args=(serve,))
    server.start()
    try:
        started.wait(60)
        assert ready, "the secured cluster did not start"
        yield ready[0]
    finally:
        stop.set()
        server.join(30)


async def _fill(s: Secured, messages: dict[str, list[bytes]]) -> None:
    from clmq.client import open_producer

    security = s.security(ADMIN)
    async with open_admin(s.cluster.ns, security=security) as admin:

        async def registered() -> bool:
            return len(await admin.brokers()) >= 1

        await await_until(registered, 10, "the broker registered with the name server")
        routes = Routes(admin.rpc, s.cluster.ns)
        for topic, queues in s.topics.items():
            await admin.create_topic(topic, queues)

            async def routed(topic: str = topic) -> bool:
                try:
                    return bool(await routes.queues(topic, refresh=True))
                except NoRouteError:
                    return False

            await await_until(routed, 10, f"topic {topic!r} routed")
    if messages:
        async with open_producer(s.cluster.ns, security=security) as producer:
            for topic, bodies in messages.items():
                for body in bodies:
                    await producer.send(topic, body)
        # Log readers (Spark) see what is durable and dispatched: wait for both, or a
        # read right after this would see a snapshot without the messages.
        store = next(iter(s.cluster.brokers.values())).store

        def readable() -> bool:
            return store.durable_offset >= store.end_offset and store.dispatch_lag_bytes == 0

        await await_until(readable, 10, "the messages durable and dispatched")
