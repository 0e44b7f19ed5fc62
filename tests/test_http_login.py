"""Logins on the HTTP pages (issue 31): HTTP Basic in the small HTTP server (401 and
its challenge without credentials it accepts, the header alone read and bounded),
passwords checked against stored SCRAM credentials, and the metrics of a broker and a
name server off loopback with logins on: a user who may DESCRIBE the cluster reads
them, a wrong password is a failed login (slow, counted, logged), a user without the
right is refused. Real sockets; the off-loopback address is this machine's own when
it has one, else 0.0.0.0."""

from __future__ import annotations

import base64
import functools
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.nameserver import NameServerConfig
from clmq.nameserver import serve as serve_nameserver
from clmq.protocol.auth import (
    AclBinding,
    SecurityState,
    load_security,
    make_credential,
    password_matches,
    save_security,
)
from clmq.protocol.transport import HttpRequest, HttpResponse, metrics_login_required, serve_http
from clmq.protocol.transport._http import HTTP_MAX_AUTHORIZATION_BYTES, basic_credentials
from tests.service_helpers import Cluster
from tests.test_security_native import seed_users

ADMIN, ALICE, BOB = ("admin", "admin-pw"), ("alice", "alice-pw"), ("bob", "bob-pw")
DESCRIBE_CLUSTER = ["CLUSTER", "kafka-cluster", "LITERAL", "User:bob", "*", "DESCRIBE", "ALLOW"]


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def http_get(host: str, port: int, authorization: str | None = None, method: str = "GET") -> tuple[int, str, str]:
    """(status, head, body) of one request over a real socket."""
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        extra = f"Authorization: {authorization}\r\n" if authorization is not None else ""
        await stream.send_all(f"{method} /metrics HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode())
        data = b""
        with trio.fail_after(20):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), head, body


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback and can be listened on, if any."""
    candidates = []
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route picks the address
            candidates.append(s.getsockname()[0])
        except OSError:
            pass
    for host in candidates:
        if host.startswith("127.") or host == "0.0.0.0":
            continue
        try:
            with socket.socket() as s:
                s.bind((host, 0))
            return host
        except OSError:
            continue
    return None


# ------------------------------------------------------------ the HTTP server alone
async def test_a_login_gates_every_request_with_401_and_a_basic_challenge(nursery: trio.Nursery) -> None:
    tried: list[tuple[str, str, str]] = []

    async def login(user: str, password: str, host: str) -> bool:
        tried.append((user, password, host))
        return (user, password) == ("alice", "s3cret:with colon ü")

    async def route(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"the page\n")

    port = await nursery.start(functools.partial(serve_http, login=login), "127.0.0.1", 0, route, "test")
    status, head, body = await http_get("127.0.0.1", port)
    assert status == 401 and 'WWW-Authenticate: Basic realm="clmq"' in head and "the page" not in body
    assert tried == []  # no credentials: no login tried (a browser's first request)
    status, head, body = await http_get("127.0.0.1", port, basic("alice", "wrong"))
    assert status == 401 and 'Basic realm="clmq"' in head and "the page" not in body
    status, _, body = await http_get("127.0.0.1", port, basic("alice", "s3cret:with colon ü"))
    assert status == 200 and body == "the page\n"
    status, head, body = await http_get("127.0.0.1", port, basic("alice", "s3cret:with colon ü"), method="HEAD")
    assert status == 200 and body == ""
    assert tried[-1] == ("alice", "s3cret:with colon ü", "127.0.0.1")
    n = len(tried)
    for bad in (
        "Bearer abc",
        "Basic !!!notbase64",
        "Basic " + base64.b64encode(b"no-colon").decode(),
        "Basic " + base64.b64encode(b"\xff\xfe:x").decode(),
        basic("alice", "x" * HTTP_MAX_AUTHORIZATION_BYTES),
    ):
        status, head, _ = await http_get("127.0.0.1", port, bad)
        assert status == 401 and "WWW-Authenticate" in head, bad
    assert len(tried) == n  # none of those reached the login function


async def test_a_login_function_that_fails_refuses_and_the_server_goes_on(nursery: trio.Nursery) -> None:
    async def login(user: str, password: str, host: str) -> bool:
        raise RuntimeError("a bug")

    async def route(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"ok")

    port = await nursery.start(functools.partial(serve_http, login=login), "127.0.0.1", 0, route, "test")
    for _ in range(2):
        assert (await http_get("127.0.0.1", port, basic("a", "b")))[0] == 401


def test_basic_credentials_are_parsed_strictly() -> None:
    assert basic_credentials(b" Basic " + base64.b64encode(b"u:p:q")) == ("u", "p:q")
    assert basic_credentials(b"basic " + base64.b64encode(b"u:")) == ("u", "")
    assert basic_credentials(b"Basic " + base64.b64encode(b":p")) is None
    assert basic_credentials(b"Digest x") is None


def test_passwords_are_checked_against_the_stored_credentials() -> None:
    state = SecurityState().with_user("alice", [make_credential("SCRAM-SHA-256", "alice-pw", iterations=4096)])
    state = state.with_user("sha512", [make_credential("SCRAM-SHA-512", "pw512", iterations=4096)])
    assert password_matches(state, "alice", "alice-pw")
    assert not password_matches(state, "alice", "alice-pw ")
    assert not password_matches(state, "alice", "")
    assert not password_matches(state, "nobody", "alice-pw")
    assert password_matches(state, "sha512", "pw512") and not password_matches(state, "sha512", "alice-pw")


def test_metrics_ask_for_a_login_only_off_loopback_with_logins_on() -> None:
    assert metrics_login_required("10.0.0.5", True)
    assert metrics_login_required("0.0.0.0", True)
    assert metrics_login_required("metrics.example.com", True)
    assert not metrics_login_required("127.0.0.1", True)
    assert not metrics_login_required("::1", True)
    assert not metrics_login_required("10.0.0.5", False)  # allow_anonymous: open, as the config check allowed


# ------------------------------------------------------------ a broker's and a name server's metrics
# This machine's own address; without one, every address (0.0.0.0, not loopback either),
# reached through 127.0.0.1.
LISTEN = non_loopback_address() or "0.0.0.0"
HOST = LISTEN if LISTEN != "0.0.0.0" else "127.0.0.1"


def _grant_bob(path: Path) -> None:
    save_security(path, load_security(path).with_acls([AclBinding.from_json(DESCRIBE_CLUSTER)]))


async def _check_metrics_logins(port: int, stats: Any, caplog: pytest.LogCaptureFixture) -> None:
    status, head, body = await http_get(HOST, port)
    assert status == 401 and 'WWW-Authenticate: Basic realm="clmq"' in head and "clmq_" not in body
    before = stats.failed
    started = trio.current_time()
    with caplog.at_level(logging.WARNING, logger="clmq.security"):
        for user, password in (("alice", "wrong"), ("nobody", "alice-pw")):
            status, head, body = await http_get(HOST, port, basic(user, password))
            assert status == 401 and "clmq_" not in body
    assert trio.current_time() - started >= 2 * 0.2  # auth_failure_delay_ms, each
    assert stats.failed == before + 2
    logged = [r.getMessage() for r in caplog.records if "failed login from" in r.getMessage()]
    assert len(logged) == 2 and all(f"from {HOST}:" in m and "metrics http" in m for m in logged)
    denied = stats.denied
    status, _, body = await http_get(HOST, port, basic(*ALICE))  # right password, no DESCRIBE
    assert status == 401 and "clmq_" not in body and stats.denied == denied + 1
    for user in (ADMIN, BOB):  # a super user; a user granted DESCRIBE on the cluster
        status, _, body = await http_get(HOST, port, basic(*user))
        assert status == 200 and "# TYPE clmq_" in body, user


async def test_broker_metrics_off_loopback_need_a_login_that_may_describe_the_cluster(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seed_users(tmp_path / "broker-a", ADMIN, ALICE, BOB)
    _grant_bob(tmp_path / "broker-a" / "security.json")
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker(
        auth_enabled=True,
        super_users=["User:admin"],
        auth_failure_delay_ms=200,
        metrics_port=0,
        metrics_host=LISTEN,
    )
    await _check_metrics_logins(broker.metrics_port, broker.security.access.stats, caplog)
    # the failed logins are the broker's failed logins, as on its other listeners
    _, _, page = await http_get(HOST, broker.metrics_port, basic(*ADMIN))
    assert "clmq_login_failures_total 2.0" in page and "clmq_requests_denied_total 1.0" in page


async def test_broker_metrics_on_loopback_stay_open_with_logins_on(nursery: trio.Nursery, tmp_path: Path) -> None:
    seed_users(tmp_path / "broker-a", ADMIN)
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker(auth_enabled=True, super_users=["User:admin"], metrics_port=0)
    status, _, body = await http_get("127.0.0.1", broker.metrics_port)
    assert status == 200 and "clmq_connections" in body


async def test_name_server_metrics_off_loopback_need_a_login(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ns-security.json"
    seed_users(tmp_path, ADMIN, ALICE, BOB, name=path.name)
    _grant_bob(path)
    ns = await nursery.start(
        serve_nameserver,
        NameServerConfig(
            listen_port=0,
            auth_enabled=True,
            security_file=str(path),
            super_users=["User:admin"],
            auth_failure_delay_ms=200,
            metrics_port=0,
            metrics_host=LISTEN,
        ),
    )
    await _check_metrics_logins(ns.metrics_port, ns.access.stats, caplog)
