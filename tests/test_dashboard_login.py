"""``clmq dashboard`` off loopback (issue 31): every viewer logs in (HTTP Basic) with a
user of the cluster, checked by logging in to the cluster with it; headless Chromium
is refused without credentials or with a wrong password, and shows the pages with the
right ones (``http://user:password@host/``). Without a cluster that checks logins, a
non-loopback dashboard refuses to start unless ``--allow-anonymous``."""

from __future__ import annotations

import base64
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import ENV, free_port, running_dev
from tests.secured_cluster import ADMIN, cluster_acl, secured_cluster_in_thread
from tests.test_dashboard import BROWSER, BROWSER_FLAGS
from tests.waiting import wait_until

VIEWER, CAROL = ("viewer", "viewer-pw"), ("carol", "carol-pw")  # carol may not DESCRIBE the cluster
OPEN_HOST = "0.0.0.0"  # not loopback (every address of this machine), so logins are asked for; reached on 127.0.0.1


def browse(url: str) -> tuple[str, str]:
    """(the page's DOM once its scripts ran, Chromium's stderr)."""
    assert BROWSER, "Chromium is needed (scripts/run-tests.sh installs Debian's chromium)"
    out = subprocess.run([BROWSER, *BROWSER_FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    return out.stdout, out.stderr


def get(url: str, user: tuple[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url)
    if user is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(user).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def dashboard(
    ns: str, port: int, *more: str, env: dict[str, str] | None = None, stderr: object = subprocess.PIPE
) -> subprocess.Popen[str]:
    args = ["dashboard", "--namesrv", ns, "--listen-host", OPEN_HOST, "--listen-port", str(port), *more]
    return subprocess.Popen(
        [sys.executable, "-m", "clmq", *args],
        env={**ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=stderr,  # type: ignore[arg-type]
        text=True,
    )


def answering(proc: subprocess.Popen[str], url: str) -> bool:
    assert proc.poll() is None, proc.communicate()
    try:
        return get(url)[0] in (200, 401)
    except OSError:
        return False


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A dashboard on 0.0.0.0 of a cluster with logins on; it reads as admin. (Its URL,
    the file of its stderr.)"""
    root = tmp_path_factory.mktemp("dashboard-login")
    with secured_cluster_in_thread(
        root,
        [VIEWER, CAROL],
        [cluster_acl("viewer", "DESCRIBE")],
        [],
        topics={"orders": 2},
        messages={"orders": [b"order #%d" % i for i in range(5)]},
    ) as s:
        port = free_port()
        log = root / "dashboard.err"
        with log.open("w") as err:
            proc = dashboard(s.ns, port, env={"CLMQ_USER": ADMIN[0], "CLMQ_PASSWORD": ADMIN[1]}, stderr=err)
        url = f"http://127.0.0.1:{port}/"
        try:
            wait_until(lambda: answering(proc, url), 30, "the dashboard to answer")
            yield url, log
        finally:
            proc.terminate()
            proc.wait(30)


def test_without_credentials_the_dashboard_asks_for_a_login(board: tuple[str, Path]) -> None:
    url = board[0]
    for path in ("", "api/overview", "app.js"):
        status, headers, body = get(url + path)
        assert status == 401 and headers["WWW-Authenticate"] == 'Basic realm="clmq"', path
        assert b"orders" not in body and b"broker-a" not in body
    dom, err = browse(url + "#/topics")
    assert "orders" not in dom and "ERR_INVALID_AUTH_CREDENTIALS" in err  # headless: no prompt, the load fails


def test_the_right_login_shows_the_pages_in_chromium(board: tuple[str, Path]) -> None:
    authed = board[0].replace("http://", f"http://{VIEWER[0]}:{VIEWER[1]}@")
    dom, err = browse(authed + "#/topics")
    assert 'data-ready="topics"' in dom and "orders" in dom, err[-2000:]
    dom, err = browse(authed + "#/brokers")
    assert "broker-a" in dom and "leader" in dom, err[-2000:]
    assert get(board[0] + "api/topics", VIEWER)[0] == 200
    assert get(board[0] + "api/topics", ADMIN)[0] == 200  # a super user may too


def test_a_wrong_password_and_a_user_without_describe_are_refused(board: tuple[str, Path]) -> None:
    url = board[0]
    dom, err = browse(url.replace("http://", "http://viewer:wrong@") + "#/topics")
    assert "orders" not in dom and "ERR_INVALID_AUTH_CREDENTIALS" in err
    for user in (("viewer", "wrong"), ("nobody", "viewer-pw"), CAROL):
        status, headers, body = get(url + "api/topics", user)
        assert status == 401 and "WWW-Authenticate" in headers and b"orders" not in body, user
    logged = board[1].read_text()
    assert "refused login from 127.0.0.1 (user 'nobody'): wrong user or password" in logged
    assert "refused login from 127.0.0.1 (user 'carol'): may not DESCRIBE the cluster" in logged
    assert "viewer-pw" not in logged and "carol-pw" not in logged


@pytest.fixture(scope="module")
def open_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_dev(tmp_path_factory.mktemp("open-cluster")) as ns:
        yield ns


def test_a_cluster_without_logins_refuses_an_open_dashboard_unless_allowed(open_cluster: str, tmp_path: Path) -> None:
    port = free_port()
    refused = dashboard(open_cluster, port)
    out, err = refused.communicate(timeout=60)
    assert refused.returncode == 2, (out, err)
    assert "checks no logins" in err and "--allow-anonymous" in err
    allowed = dashboard(open_cluster, port, "--allow-anonymous")
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_until(lambda: answering(allowed, url), 30, "the dashboard to answer")
        assert get(url + "api/topics")[0] == 200  # no login asked
    finally:
        allowed.terminate()
        _, err = allowed.communicate(timeout=30)
    assert "without logins (--allow-anonymous)" in err


def test_on_loopback_no_login_is_asked(open_cluster: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "clmq", "dashboard", "--namesrv", open_cluster, "--listen-port", str(port)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_until(lambda: answering(proc, url), 30, "the dashboard to answer")
        assert get(url + "api/topics")[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)
