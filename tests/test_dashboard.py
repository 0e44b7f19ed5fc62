"""``clmq dashboard`` in a real browser (issue 18): headless Chromium loads each page
against a live ``clmq dev`` with a topic, messages and a consumer group with lag, and
the rendered page shows the topics, the group's lag and a message's body. Each page's
screenshot is taken too (into $CLMQ_DASHBOARD_SCREENSHOTS if set: docs/images)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import clmq, free_port, popen, running_dev
from tests.test_cli_dlq import send_back
from tests.waiting import wait_until

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
# A profile of this test process's own: Chromiums of concurrent pytest-xdist workers
# sharing the default one would meet its profile lock.
PROFILE_DIR = tempfile.mkdtemp(prefix="clmq-chromium-")
atexit.register(shutil.rmtree, PROFILE_DIR, True)
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--virtual-time-budget=4000",
    f"--user-data-dir={PROFILE_DIR}",
]


def browse(url: str) -> str:
    """The page's DOM once its scripts ran (Chromium's --dump-dom)."""
    assert BROWSER, "Chromium is needed (scripts/run-tests.sh installs Debian's chromium)"
    out = subprocess.run([BROWSER, *BROWSER_FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def screenshot(url: str, path: Path) -> None:
    assert BROWSER
    out = subprocess.run(
        [BROWSER, *BROWSER_FLAGS, "--window-size=1280,760", f"--screenshot={path}", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out.stderr[-2000:]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """(the dashboard's URL, the ids of the messages sent)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    with running_dev(tmp) as ns:
        assert clmq("topic", "create", "orders", "--queues", "4", "--namesrv", ns, cwd=tmp).returncode == 0
        sent = clmq(
            "produce",
            "orders",
            *[f"order #{i} for alice" for i in range(40)],
            "--keys",
            "customer-alice",
            "--queue",
            "0",
            "--namesrv",
            ns,
            cwd=tmp,
        )
        assert sent.returncode == 0, sent.stderr
        ids = [line.split()[-1] for line in sent.stdout.splitlines()]
        assert (
            clmq("consume", "orders", "--group", "billing", "--count", "10", "--namesrv", ns, cwd=tmp).returncode == 0
        )
        send_back(ids[5:7], "refunds", to_dlq=True)  # two dead letters of group refunds
        port = free_port()
        proc = popen(
            "dashboard",
            "--namesrv",
            ns,
            "--listen-port",
            str(port),
            "--poll-interval-ms",
            "200",
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            url = f"http://127.0.0.1:{port}/"
            wait_until(lambda: answers(url + "api/overview"), 30, "the dashboard to answer")
            wait_until(
                lambda: len(json.loads(urllib.request.urlopen(url + "api/overview").read())["history"]) >= 3,
                30,
                "three samples for the charts",
            )
            yield url, ids
        finally:
            proc.terminate()
            proc.wait(30)


def test_the_brokers_page_shows_the_broker_and_its_role(board: tuple[str, list[str]]) -> None:
    dom = browse(board[0] + "#/brokers")
    assert 'data-ready="brokers"' in dom and "broker-a" in dom and "leader" in dom and "uplot" in dom


def test_the_topics_pages_show_topics_queues_and_offsets(board: tuple[str, list[str]]) -> None:
    assert "orders" in browse(board[0] + "#/topics")
    dom = browse(board[0] + "#/topics?name=orders")
    assert "Topic orders" in dom and dom.count("browse</a>") == 4 and ">40<" in dom  # queue 0: 40 messages


def test_the_groups_pages_show_the_lag(board: tuple[str, list[str]]) -> None:
    dom = browse(board[0] + "#/groups")
    assert "billing" in dom and ">30<" in dom  # 40 sent, 10 consumed
    dom = browse(board[0] + "#/groups?name=billing")
    assert "total lag" in dom and '<span class="lag">30</span>' in dom and "Lag trend" in dom


def test_the_groups_pages_show_retries_and_dead_letters(board: tuple[str, list[str]]) -> None:
    dom = browse(board[0] + "#/groups")
    assert "refunds" in dom and '<span class="dlq">2</span>' in dom
    dom = browse(board[0] + "#/groups?name=refunds")
    assert (
        '<span class="dlq">2</span>' in dom
        and "Dead letters" in dom
        and "order #5 for alice" in dom
        and ">orders<" in dom
    )


def test_messages_are_browsed_and_looked_up_by_id_and_key(board: tuple[str, list[str]]) -> None:
    url, ids = board
    assert "order #3 for alice" in browse(url + "#/messages?topic=orders&queue=0&offset=3")
    assert "order #17 for alice" in browse(url + "#/messages?id=" + ids[17])
    assert "order #39 for alice" in browse(url + "#/messages?ktopic=orders&key=customer-alice")
    assert "error" in browse(url + "#/messages?topic=nope&queue=0&offset=0")


def test_a_screenshot_of_each_page(board: tuple[str, list[str]], tmp_path: Path) -> None:
    out = Path(os.environ.get("CLMQ_DASHBOARD_SCREENSHOTS", tmp_path))
    pages = {
        "brokers": "#/brokers",
        "topic": "#/topics?name=orders",
        "group": "#/groups?name=billing",
        "messages": "#/messages?topic=orders&queue=0&offset=0",
    }
    for name, fragment in pages.items():
        screenshot(board[0] + fragment, out / f"dashboard-{name}.png")
