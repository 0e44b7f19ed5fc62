"""Logins and ACLs on the native protocol, against a running broker: every request
code refused before a login (AUTHENTICATION_REQUIRED) and, for a user without the
right ACL, refused (NOT_AUTHORIZED) with nothing stored and nothing changed; the
same requests allowed once an ACL grants them; failed logins slowed, counted, logged
and audited; users and ACLs copied to followers."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import ConnectionFailed, RpcClient
from clmq.client._routes import MessageQueue
from clmq.client.producer._scheduled import encode_scheduled
from clmq.common import TIMER_TOPIC, Message
from clmq.protocol import ErrorCode, RequestCode, encode_batch
from clmq.protocol.auth import Operation, ResourceType, ScramClient, SecurityState, make_credential, save_security
from tests.service_helpers import Cluster
from tests.test_validation import GOOD_BROKER, GOOD_NAMESERVER
from tests.waiting import await_until

ADMIN, ALICE = ("admin", "admin-pw"), ("alice", "alice-pw")
OPEN_CODES = {RequestCode.AUTHENTICATE, RequestCode.UNREGISTER_CLIENT}  # any logged-in user


def seed_users(data_dir: Path, *users: tuple[str, str], name: str = "security.json") -> None:
    state = SecurityState()
    for user, password in users:
        state = state.with_user(user, [make_credential("SCRAM-SHA-256", password, iterations=4096)])
    data_dir.mkdir(parents=True, exist_ok=True)
    save_security(data_dir / name, state)


async def login(rpc: RpcClient, addr: str, user: str, password: str, mechanism: str = "SCRAM-SHA-256") -> Any:
    """The SCRAM exchange on ``rpc``'s connection to ``addr``; the last reply."""
    client = ScramClient(mechanism, user, password)
    first = await rpc.request(addr, RequestCode.AUTHENTICATE, {"mechanism": mechanism, "data": client.first()})
    final = await rpc.request(addr, RequestCode.AUTHENTICATE, {"data": client.final(first.fields["data"])}, check=False)
    if final.error_code == 0:
        client.check(final.fields["data"])
    return final


async def start_secured(cluster: Cluster, tmp_path: Path, **settings: Any) -> str:
    seed_users(tmp_path / "broker-a", ADMIN, ALICE)
    await cluster.start_nameserver()
    broker = await cluster.start_broker(
        "broker-a", auth_enabled=True, super_users=["User:admin"], auth_failure_delay_ms=200, **settings
    )
    return broker.addr


def request_body(code: int) -> bytes:
    return encode_batch([Message("v", 0, b"x")]) if code == RequestCode.SEND_MESSAGE else b""


async def test_every_request_needs_a_login_then_an_acl(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    addr = await start_secured(cluster, tmp_path)
    broker = cluster.brokers["broker-a"]
    assert set(GOOD_BROKER) == set(broker.rpc.handlers)  # the table covers every code served
    async with trio.open_nursery() as n:
        admin, alice, anonymous = RpcClient(n), RpcClient(n), RpcClient(n)
        assert (await login(admin, addr, *ADMIN)).error_code == 0
        await admin.request(addr, RequestCode.CREATE_TOPIC, {"topic": "v", "queue_count": 1})
        body = request_body(RequestCode.SEND_MESSAGE)
        await admin.request(addr, RequestCode.SEND_MESSAGE, {"topic": "v"}, body)  # GET_MESSAGE finds a record
        for code, fields in GOOD_BROKER.items():
            if code == RequestCode.AUTHENTICATE:
                continue
            reply = await anonymous.request(addr, code, fields, request_body(code), check=False)
            assert reply.error_code == ErrorCode.AUTHENTICATION_REQUIRED, (RequestCode(code).name, reply)
        assert (await login(alice, addr, *ALICE)).fields["principal"] == "User:alice"
        for code, fields in GOOD_BROKER.items():
            if code in OPEN_CODES:
                continue
            reply = await alice.request(addr, code, fields, request_body(code), check=False)
            assert reply.error_code == ErrorCode.NOT_AUTHORIZED, (RequestCode(code).name, reply)
            assert "User:alice may not" in reply.error_text
        # Nothing stored, nothing changed (asked as the super user).
        offsets = await admin.request(addr, RequestCode.QUERY_OFFSETS, {"topic": "v", "queue_id": 0})
        assert offsets.fields["max_offset"] == 1  # the admin's one message
        topics = await admin.request(addr, RequestCode.LIST_TOPICS)
        assert topics.fields["topics"] == {"v": 1}
        users = await admin.request(addr, RequestCode.USER_LIST)
        assert [u for u, _ in users.fields["users"]] == ["admin", "alice"]
        assert broker.handlers.ctx.security.state.acls == ()
        # An ACL grants exactly what it names.
        grant = [["TOPIC", "v", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"]]
        await admin.request(addr, RequestCode.ACL_CREATE, {"acls": grant})
        sent = await alice.request(
            addr, RequestCode.SEND_MESSAGE, {"topic": "v"}, request_body(RequestCode.SEND_MESSAGE)
        )
        assert sent.fields["queue_offsets"] == [1]
        pulled = await alice.request(
            addr, RequestCode.PULL_MESSAGE, {"topic": "v", "queue_id": 0, "offset": 0}, check=False
        )
        assert pulled.error_code == ErrorCode.NOT_AUTHORIZED
        # A scheduled message is a produce to its real topic: WRITE there, not on %TIMER%.
        await admin.request(addr, RequestCode.CREATE_TOPIC, {"topic": "w", "queue_count": 1})
        due = int(time.time() * 1000) + 60_000
        for topic, expected in (("v", 0), ("w", ErrorCode.NOT_AUTHORIZED)):
            body = encode_scheduled([Message(topic, 0, b"later")], MessageQueue(topic, "broker-a", 0, addr), due)
            reply = await alice.request(addr, RequestCode.SEND_MESSAGE, {"topic": TIMER_TOPIC}, body, check=False)
            assert reply.error_code == expected, (topic, reply)
        # DENY wins over ALLOW.
        deny = [["TOPIC", "v", "LITERAL", "User:alice", "*", "WRITE", "DENY"]]
        await admin.request(addr, RequestCode.ACL_CREATE, {"acls": deny})
        again = await alice.request(
            addr, RequestCode.SEND_MESSAGE, {"topic": "v"}, request_body(RequestCode.SEND_MESSAGE), check=False
        )
        assert again.error_code == ErrorCode.NOT_AUTHORIZED
        for rpc in (admin, alice, anonymous):
            await rpc.aclose()
    assert broker.handlers.ctx.security.access.stats.denied >= len(GOOD_BROKER) - len(OPEN_CODES) + 2


async def test_failed_logins_are_slow_alike_counted_logged_and_audited(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = Cluster(nursery, tmp_path)
    audit = tmp_path / "audit.log"
    addr = await start_secured(cluster, tmp_path, audit_log=str(audit))
    other_audit = tmp_path / "other-audit.log"  # another server of this process: its file gets its own lines only
    await cluster.start_broker("broker-b", audit_log=str(other_audit))
    access = cluster.brokers["broker-a"].handlers.ctx.security.access
    texts = []
    with caplog.at_level(logging.WARNING, logger="clmq.security"):
        for user, password in (("alice", "wrong"), ("nobody", "alice-pw")):
            async with trio.open_nursery() as n:
                rpc = RpcClient(n)
                started = trio.current_time()
                reply = await login(rpc, addr, user, password)
                assert trio.current_time() - started >= 0.2  # auth_failure_delay_ms
                assert reply.error_code == ErrorCode.AUTHENTICATION_FAILED
                texts.append(reply.error_text)
                # The server closes the connection after a failed login.
                conn = rpc._conns[addr]
                await await_until(lambda: conn.closed, 5, "the connection closed")  # noqa: B023
                await rpc.aclose()
    assert texts[0] == texts[1] == "authentication failed"  # no hint which part was wrong
    assert access.stats.failed == 2
    assert sum("failed login from 127.0.0.1:" in r.getMessage() for r in caplog.records) == 2
    assert other_audit.read_text() == ""
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    assert {x["server"] for x in lines} == {"broker broker-a"}
    assert [(x["event"], x["principal"]) for x in lines if x["event"] == "login_failed"] == [
        ("login_failed", "User:alice"),
        ("login_failed", "User:nobody"),
    ]


async def test_a_brute_force_loop_is_slowed(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    addr = await start_secured(cluster, tmp_path)
    started = trio.current_time()
    async with trio.open_nursery() as n:
        for i in range(5):
            rpc = RpcClient(n)
            assert (await login(rpc, addr, "alice", f"guess{i}")).error_code == ErrorCode.AUTHENTICATION_FAILED
            await rpc.aclose()
    assert trio.current_time() - started >= 5 * 0.2
    assert cluster.brokers["broker-a"].handlers.ctx.security.access.stats.failed == 5


async def test_a_logged_in_connection_cannot_log_in_again_and_open_brokers_have_no_logins(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    cluster = Cluster(nursery, tmp_path)
    addr = await start_secured(cluster, tmp_path)
    open_broker = await cluster.start_broker("broker-b")
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        assert (await login(rpc, addr, *ALICE)).error_code == 0
        again = await rpc.request(
            addr, RequestCode.AUTHENTICATE, {"mechanism": "SCRAM-SHA-256", "data": b"n,,n=x,r=y"}, check=False
        )
        assert again.error_code == ErrorCode.AUTHENTICATION_FAILED and "already logged in" in again.error_text
        other = await rpc.request(
            open_broker.addr,
            RequestCode.AUTHENTICATE,
            {"mechanism": "SCRAM-SHA-256", "data": b"n,,n=x,r=y"},
            check=False,
        )
        assert other.error_code == ErrorCode.REQUEST_NOT_SUPPORTED and "has no logins" in other.error_text
        await rpc.aclose()


def test_a_broker_on_an_open_address_without_auth_refuses_to_start(tmp_path: Path) -> None:
    from clmq.broker.service import BrokerConfig

    with pytest.raises(ValueError, match="allow_anonymous"):
        BrokerConfig(listen_host="0.0.0.0", data_dir=str(tmp_path))
    BrokerConfig(listen_host="0.0.0.0", data_dir=str(tmp_path), allow_anonymous=True)
    BrokerConfig(listen_host="0.0.0.0", data_dir=str(tmp_path), auth_enabled=True)
    BrokerConfig(listen_host="127.0.0.1", data_dir=str(tmp_path))


async def test_users_and_acls_reach_followers_and_survive_restarts(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    fast = {"replica_metadata_interval_ms": 100, "replica_fetch_wait_ms": 100}
    lead = await cluster.start_broker("g", key="g0", broker_id=0, **fast)
    follower = await cluster.start_broker("g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **fast)
    cred = make_credential("SCRAM-SHA-512", "pw", iterations=4096)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(
            lead.addr, RequestCode.USER_UPSERT, {"user": "bob", "credentials": {cred.mechanism: cred.to_json()}}
        )
        grant = [["GROUP", "app-", "PREFIXED", "User:bob", "*", "READ", "ALLOW"]]
        await rpc.request(lead.addr, RequestCode.ACL_CREATE, {"acls": grant})
        # Changes go to the leader only.
        refused = await rpc.request(follower.addr, RequestCode.USER_DELETE, {"user": "bob"}, check=False)
        assert refused.error_code == ErrorCode.NOT_LEADER

        async def copied() -> bool:
            users = await rpc.request(follower.addr, RequestCode.USER_LIST)
            acls = await rpc.request(follower.addr, RequestCode.ACL_DESCRIBE, {"filter": [""] * 7})
            return users.fields["users"] == [["bob", ["SCRAM-SHA-512"]]] and acls.fields["acls"] == grant

        await await_until(copied, 10, "the follower copies the users and ACLs")
        await rpc.aclose()
    state = follower.handlers.ctx.security.state
    await cluster.stop_broker("g1")
    restarted = await cluster.start_broker("g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **fast)
    assert restarted.handlers.ctx.security.state.to_json() == state.to_json()  # kept on disk


async def test_name_server_logins_and_acls_from_its_security_file(nursery: trio.Nursery, tmp_path: Path) -> None:
    from clmq.nameserver import NameServerConfig
    from clmq.nameserver import serve as serve_nameserver
    from clmq.protocol.auth import AclBinding

    path = tmp_path / "ns-security.json"
    seed_users(tmp_path, ("broker", "b-pw"), ALICE, name=path.name)
    from clmq.protocol.auth import load_security

    state = load_security(path).with_acls(
        [AclBinding.from_json(["CLUSTER", "kafka-cluster", "LITERAL", "User:broker", "*", "CLUSTER_ACTION", "ALLOW"])]
    )
    save_security(path, state)
    ns = await nursery.start(
        serve_nameserver,
        NameServerConfig(
            listen_port=0,
            auth_enabled=True,
            security_file=str(path),
            auth_failure_delay_ms=50,
            audit_log=str(tmp_path / "ns-audit.log"),
        ),
    )
    register = {"broker_name": "b", "addr": "127.0.0.1:1", "topics": {"t": 1}}
    assert set(GOOD_NAMESERVER) == set(ns.rpc.handlers)
    async with trio.open_nursery() as n:
        anonymous, alice, broker = RpcClient(n), RpcClient(n), RpcClient(n)
        assert (await login(alice, ns.addr, *ALICE)).error_code == 0
        for code, fields in GOOD_NAMESERVER.items():
            if code == RequestCode.AUTHENTICATE:
                continue
            reply = await anonymous.request(ns.addr, code, fields, check=False)
            assert reply.error_code == ErrorCode.AUTHENTICATION_REQUIRED, (RequestCode(code).name, reply)
            reply = await alice.request(ns.addr, code, fields, check=False)
            assert reply.error_code == ErrorCode.NOT_AUTHORIZED, (RequestCode(code).name, reply)
        assert (await login(broker, ns.addr, "broker", "b-pw")).error_code == 0
        assert (await broker.request(ns.addr, RequestCode.GET_CLUSTER)).fields["brokers"] == []  # nothing registered
        await broker.request(ns.addr, RequestCode.REGISTER_BROKER, register)
        route = await alice.request(ns.addr, RequestCode.GET_ROUTE, {"topic": "t"}, check=False)
        assert route.error_code == ErrorCode.NOT_AUTHORIZED  # no DESCRIBE on t yet
        # The file changes: read again without a restart.
        grant = AclBinding.from_json(["TOPIC", "t", "LITERAL", "User:alice", "*", "READ", "ALLOW"])
        save_security(path, load_security(path).with_acls([grant]))

        async def routed() -> bool:
            reply = await alice.request(ns.addr, RequestCode.GET_ROUTE, {"topic": "t"}, check=False)
            return reply.error_code == 0 and reply.fields["brokers"][0]["addr"] == "127.0.0.1:1"

        await await_until(routed, 10, "the name server reads its changed security_file")
        bad = RpcClient(n)
        assert (await login(bad, ns.addr, "alice", "wrong")).error_code == ErrorCode.AUTHENTICATION_FAILED
        await bad.aclose()
        from prometheus_client.exposition import generate_latest

        audited = [json.loads(line) for line in (tmp_path / "ns-audit.log").read_text().splitlines()]
        assert {"denied", "login_failed"} <= {x["event"] for x in audited}
        assert {x["server"] for x in audited} == {"nameserver"}
        page = generate_latest(ns.metrics).decode()
        assert "clmq_login_failures_total 1.0" in page
        assert "clmq_requests_denied_total" in page and "clmq_requests_denied_total 0.0" not in page
        for rpc in (anonymous, alice, broker):
            await rpc.aclose()


async def test_a_follower_without_the_replication_right_cannot_join(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Followers log in as ``broker_user``; only a principal with CLUSTER_ACTION on the
    cluster may replicate. The intruder copies nothing; the real follower does."""
    from clmq.protocol.auth import AclBinding, load_security
    from tests.test_replication import FAST, caught_up, in_sync

    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    users = (ADMIN, ("broker", "b-pw"), ("intruder", "i-pw"))
    for key in ("g0", "g1", "g2"):
        seed_users(tmp_path / key, *users)
        path = tmp_path / key / "security.json"
        right = ["CLUSTER", "kafka-cluster", "LITERAL", "User:broker", "*", "CLUSTER_ACTION", "ALLOW"]
        save_security(path, load_security(path).with_acls([AclBinding.from_json(right)]))
    secured = {**FAST, "auth_enabled": True, "super_users": ["User:admin"], "auth_failure_delay_ms": 50}
    lead = await cluster.start_broker(
        "g", key="g0", broker_id=0, broker_user="broker", broker_password="b-pw", **secured
    )
    with caplog.at_level(logging.WARNING):
        intruder = await cluster.start_broker(
            "g",
            key="g1",
            broker_id=1,
            role="follower",
            leader_addr=lead.addr,
            broker_user="intruder",
            broker_password="i-pw",
            **secured,
        )
        follower = await cluster.start_broker(
            "g",
            key="g2",
            broker_id=2,
            role="follower",
            leader_addr=lead.addr,
            broker_user="broker",
            broker_password="b-pw",
            **secured,
        )
        await in_sync(lead, 1)  # the real follower only
        async with trio.open_nursery() as n:
            admin = RpcClient(n)
            assert (await login(admin, lead.addr, *ADMIN)).error_code == 0
            await admin.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "v", "queue_count": 1})
            await admin.request(
                lead.addr, RequestCode.SEND_MESSAGE, {"topic": "v"}, request_body(RequestCode.SEND_MESSAGE)
            )
            await admin.aclose()
        await caught_up(lead, [follower])
        await await_until(
            lambda: any("NOT_AUTHORIZED" in r.getMessage() for r in caplog.records), 10, "the intruder is refused"
        )
    assert intruder.store.log.write_offset == 0
    assert intruder.store.topics.all() == {}


async def test_random_login_messages_leave_the_broker_serving(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Hypothesis drives AUTHENTICATE with random mechanisms and bytes at both steps,
    each try on a fresh connection; every answer is an error (never a login), and the
    broker goes on serving a real login."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cluster = Cluster(nursery, tmp_path)
    addr = await start_secured(cluster, tmp_path)
    cluster.brokers["broker-a"].handlers.ctx.security.access.failure_delay_s = 0
    tries: list[tuple[Any, bytes, bytes]] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        mechanism=st.one_of(st.sampled_from(["SCRAM-SHA-256", "SCRAM-SHA-512"]), st.text(max_size=20), st.none()),
        first=st.one_of(st.binary(max_size=200), st.builds(lambda n: b"n,,n=alice,r=" + n, st.binary(max_size=40))),
        final=st.binary(max_size=200),
    )
    def collect(mechanism: Any, first: bytes, final: bytes) -> None:
        tries.append((mechanism, first, final))

    collect()
    async with trio.open_nursery() as n:
        for mechanism, first, final in tries:
            rpc = RpcClient(n)
            fields: dict[str, Any] = {"data": first}
            if mechanism is not None:
                fields["mechanism"] = mechanism
            one = await rpc.request(addr, RequestCode.AUTHENTICATE, fields, check=False)
            if one.error_code == 0:
                two = await rpc.request(addr, RequestCode.AUTHENTICATE, {"data": final}, check=False)
                assert two.error_code == ErrorCode.AUTHENTICATION_FAILED, two
            else:
                assert one.error_code in (ErrorCode.AUTHENTICATION_FAILED, ErrorCode.MALFORMED_REQUEST), one
            await rpc.aclose()
        rpc = RpcClient(n)
        assert (await login(rpc, addr, *ADMIN)).error_code == 0
        assert (await rpc.request(addr, RequestCode.BROKER_INFO)).fields["healthy"]
        await rpc.aclose()


# ------------------------------------------------------------ holes found in review
async def seeded_with(cluster: Cluster, tmp_path: Path, acls: list[list[str]], **settings: Any) -> str:
    addr = await start_secured(cluster, tmp_path, **settings)
    async with trio.open_nursery() as n:
        admin = RpcClient(n)
        assert (await login(admin, addr, *ADMIN)).error_code == 0
        for topic in ("secret", "v"):
            await admin.request(addr, RequestCode.CREATE_TOPIC, {"topic": topic, "queue_count": 1})
        body = encode_batch([Message("secret", 0, b"TOP-SECRET")])
        await admin.request(addr, RequestCode.SEND_MESSAGE, {"topic": "secret"}, body)
        if acls:
            await admin.request(addr, RequestCode.ACL_CREATE, {"acls": acls})
        await admin.aclose()
    return addr


async def test_sending_back_a_record_needs_read_on_its_topic(nursery: trio.Nursery, tmp_path: Path) -> None:
    """READ on a group alone must not copy another topic's record into the group's
    retry topic (which READ on the group reads)."""
    cluster = Cluster(nursery, tmp_path)
    addr = await seeded_with(cluster, tmp_path, [["GROUP", "g", "LITERAL", "User:alice", "*", "READ", "ALLOW"]])
    async with trio.open_nursery() as n:
        alice = RpcClient(n)
        assert (await login(alice, addr, *ALICE)).error_code == 0
        back = await alice.request(
            addr, RequestCode.CONSUMER_SEND_BACK, {"group": "g", "messages": [[0, 0]]}, check=False
        )
        assert back.error_code == ErrorCode.NOT_AUTHORIZED and "'secret'" in back.error_text, back
        await alice.aclose()
    assert cluster.brokers["broker-a"].store.topics.queue_count("%RETRY%g") is None


async def test_a_new_login_cannot_start_while_a_failed_one_waits_out_its_delay(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """On one connection: a wrong client-final is sent, and while its answer waits out
    the failure delay a whole new exchange with the right password follows. It must
    not log in (the failed connection is closed once the delay is over)."""
    import trio.testing

    cluster = Cluster(nursery, tmp_path)
    addr = await start_secured(cluster, tmp_path)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        wrong = ScramClient("SCRAM-SHA-256", "alice", "wrong")
        first = await rpc.request(addr, RequestCode.AUTHENTICATE, {"mechanism": "SCRAM-SHA-256", "data": wrong.first()})
        failed: list[Any] = []

        async def send_wrong_final() -> None:
            final = {"data": wrong.final(first.fields["data"])}
            failed.append(await rpc.request(addr, RequestCode.AUTHENTICATE, final, check=False))

        n.start_soon(send_wrong_final)
        await trio.testing.wait_all_tasks_blocked()  # sent: its answer is being delayed
        right = ScramClient("SCRAM-SHA-256", *ALICE)
        try:
            again = await rpc.request(
                addr, RequestCode.AUTHENTICATE, {"mechanism": "SCRAM-SHA-256", "data": right.first()}, check=False
            )
            if again.error_code == 0:
                again = await rpc.request(
                    addr, RequestCode.AUTHENTICATE, {"data": right.final(again.fields["data"])}, check=False
                )
        except ConnectionFailed:
            again = None
        assert again is None or again.error_code != 0, again
        await await_until(lambda: failed, 10, "the wrong password's delayed answer")
        assert failed[0].error_code == ErrorCode.AUTHENTICATION_FAILED
        await rpc.aclose()


def test_the_decision_table_follows_every_new_state() -> None:
    """Replacing the ACLs by a DENY is decided by at once, however the states are
    allocated (the cache once keyed them by id(): a freed state's id can come back)."""
    from clmq.protocol.auth import AclBinding
    from clmq.protocol.transport import AccessControl, Peer

    allow = AclBinding.from_json(["TOPIC", "t", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"])
    deny = AclBinding.from_json(["TOPIC", "t", "LITERAL", "User:alice", "*", "WRITE", "DENY"])
    holder = {"state": SecurityState().with_acls([allow])}
    access = AccessControl("t", enabled=True, state=lambda: holder["state"])
    peer = Peer("127.0.0.1", 1)
    peer.session.principal = "User:alice"
    need = [(Operation.WRITE, ResourceType.TOPIC, "t")]
    refused = 0
    for _ in range(300):
        holder["state"] = SecurityState().with_acls([allow])
        assert access.refusal(peer, need, "x") is None
        holder["state"] = SecurityState()  # the allowing state is freed, no decision taken ...
        holder["state"] = SecurityState().with_acls([deny])  # ... and a new one may take its place
        refused += access.refusal(peer, need, "x") is not None
    assert refused == 300


def test_an_unknown_user_is_answered_with_the_iterations_of_known_ones() -> None:
    from clmq.protocol.transport import AccessControl

    state = SecurityState().with_user("alice", [make_credential("SCRAM-SHA-256", "pw", iterations=4096)])
    access = AccessControl("t", enabled=True, state=lambda: state)
    answers = []
    for user in ("alice", "mallory"):
        server = access.scram_server("SCRAM-SHA-256")
        answers.append(server.first(f"n,,n={user},r=abc".encode()).split(b",")[2])
    assert answers[0] == answers[1] == b"i=4096"


async def test_a_literal_deny_holds_against_reads_of_the_whole_log_and_of_a_message(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    cluster = Cluster(nursery, tmp_path)
    acls = [
        ["TOPIC", "*", "LITERAL", "User:alice", "*", "READ", "ALLOW"],
        ["TOPIC", "secret", "LITERAL", "User:alice", "*", "READ", "DENY"],
    ]
    addr = await seeded_with(cluster, tmp_path, acls)
    async with trio.open_nursery() as n:
        alice = RpcClient(n)
        assert (await login(alice, addr, *ALICE)).error_code == 0
        got = await alice.request(addr, RequestCode.GET_MESSAGE, {"commitlog_offset": 0}, check=False)
        assert got.error_code == ErrorCode.NOT_AUTHORIZED and b"TOP-SECRET" not in got.body, got
        layout = await alice.request(addr, RequestCode.GET_LOG_LAYOUT, check=False)
        assert layout.error_code == ErrorCode.NOT_AUTHORIZED, layout
        read = await alice.request(
            addr, RequestCode.READ_LOG, {"offset": 0, "max_bytes": 4096, "end_offset": 4096}, check=False
        )
        assert read.error_code == ErrorCode.NOT_AUTHORIZED and b"TOP-SECRET" not in read.body, read
        await alice.aclose()


async def test_unregistering_another_groups_client_needs_read_on_its_groups(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    cluster = Cluster(nursery, tmp_path)
    addr = await seeded_with(cluster, tmp_path, [["GROUP", "mine", "LITERAL", "User:alice", "*", "READ", "ALLOW"]])
    broker = cluster.brokers["broker-a"]
    async with trio.open_nursery() as n:
        admin, alice = RpcClient(n), RpcClient(n)
        assert (await login(admin, addr, *ADMIN)).error_code == 0
        groups = [{"group": "theirs", "topics": ["v"], "mode": "clustering"}]
        await admin.request(addr, RequestCode.HEARTBEAT, {"client_id": "victim", "groups": groups})
        assert (await login(alice, addr, *ALICE)).error_code == 0
        gone = await alice.request(addr, RequestCode.UNREGISTER_CLIENT, {"client_id": "victim"}, check=False)
        assert gone.error_code == ErrorCode.NOT_AUTHORIZED, gone
        assert [m.client_id for m in broker.groups.members("theirs")] == ["victim"]
        await admin.aclose()
        await alice.aclose()


async def test_only_a_broker_may_ask_on_behalf_of_another_principal(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    addr = await seeded_with(cluster, tmp_path, [["GROUP", "g", "LITERAL", "User:alice", "*", "READ", "ALLOW"]])
    fields = {"group": "g", "offsets": [["secret", 0, 1]], "on_behalf_of": ["User:admin", "127.0.0.1"]}
    async with trio.open_nursery() as n:
        alice = RpcClient(n)
        assert (await login(alice, addr, *ALICE)).error_code == 0
        posing = await alice.request(addr, RequestCode.COMMIT_OFFSET, fields, check=False)
        assert posing.error_code == ErrorCode.NOT_AUTHORIZED and "CLUSTER_ACTION" in posing.error_text, posing
        await alice.aclose()
    assert cluster.brokers["broker-a"].offsets.query("g", "secret", 0) == -1


def test_secrets_stay_out_of_reprs_and_written_settings(tmp_path: Path) -> None:
    from clmq.broker.cli.dev_replicas import settings_toml
    from clmq.broker.service import BrokerConfig

    c = BrokerConfig(broker_user="b", broker_password="PW-SECRET", zk_auth="u:ZK-SECRET", data_dir=str(tmp_path))
    for text in (repr(c), settings_toml(c)):
        assert "PW-SECRET" not in text and "ZK-SECRET" not in text


async def test_creating_topics_needs_create_on_the_topic_or_the_cluster_even_by_producing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    cluster = Cluster(nursery, tmp_path)
    acls = [
        ["TOPIC", "fresh", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"],
        ["GROUP", "g", "LITERAL", "User:alice", "*", "DESCRIBE", "ALLOW"],
    ]
    addr = await seeded_with(cluster, tmp_path, acls, auto_create_topics=True)
    broker = cluster.brokers["broker-a"]
    body = encode_batch([Message("fresh", 0, b"x")])
    async with trio.open_nursery() as n:
        admin, alice = RpcClient(n), RpcClient(n)
        assert (await login(admin, addr, *ADMIN)).error_code == 0
        assert (await login(alice, addr, *ALICE)).error_code == 0
        made = await alice.request(addr, RequestCode.SEND_MESSAGE, {"topic": "fresh"}, body, check=False)
        assert made.error_code == ErrorCode.NOT_AUTHORIZED and "CREATE" in made.error_text, made
        assert broker.store.topics.queue_count("fresh") is None
        asked = {"group": "g", "queues": [["secret", 0]]}
        bounds = await alice.request(addr, RequestCode.QUERY_QUEUE_OFFSETS, asked, check=False)
        assert bounds.error_code == ErrorCode.NOT_AUTHORIZED and "'secret'" in bounds.error_text, bounds
        grant = [["CLUSTER", "kafka-cluster", "LITERAL", "User:alice", "*", "CREATE", "ALLOW"]]
        await admin.request(addr, RequestCode.ACL_CREATE, {"acls": grant})
        made = await alice.request(addr, RequestCode.SEND_MESSAGE, {"topic": "fresh"}, body)
        assert made.fields["queue_offsets"] == [0]
        created = await alice.request(addr, RequestCode.CREATE_TOPIC, {"topic": "another", "queue_count": 1})
        assert created.fields["queue_count"] == 1
        await admin.aclose()
        await alice.aclose()
