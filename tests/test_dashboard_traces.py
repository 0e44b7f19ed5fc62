"""The dashboard's message page shows a message's trace (docs/traces.md) in a real
headless Chromium, against a live ``clmq dev`` with ``trace_enabled``: a message sent
and consumed by traced clients shows its timeline (sent, delivered, acked) under the
message; one sent without tracing says it has no trace events."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
import trio

from clmq.client import open_admin, open_consumer, open_producer
from tests.cli_helpers import free_port, popen, running_dev
from tests.test_dashboard import answers, browse
from tests.waiting import await_until, wait_until

pytestmark = pytest.mark.slow

FAST = {"heartbeat_interval_ms": 100, "rebalance_interval_ms": 200, "commit_interval_ms": 100}


async def _traced_life(ns: str) -> tuple[str, str, str]:
    """The ids of a traced message sent, received and acknowledged; of one sent without
    tracing and received by the traced consumer; of one nobody traced."""
    async with open_producer(ns, trace=True, trace_flush_interval_ms=20) as producer:
        traced = (await producer.send("orders", b"traced order", keys="order-1")).msg_ids[0]
    async with open_producer(ns) as producer:
        plain = (await producer.send("orders", b"plain order")).msg_ids[0]
    async with open_consumer(ns, "billing", {"orders": "*"}, trace=True, trace_flush_interval_ms=20, **FAST) as c:
        got = 0
        with trio.fail_after(20):
            while got < 2:
                got += len(await c.receive())
        c.ack()
    async with open_admin(ns) as admin:

        async def whole() -> bool:
            return [e.kind for e in (await admin.trace(traced)).events] == ["sent", "delivered", "acked"]

        await await_until(whole, 20, "the traced message's three events")
    async with open_producer(ns) as producer:
        untraced = (await producer.send("orders", b"untraced order")).msg_ids[0]
    return traced, plain, untraced


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str, str]]:
    """(the dashboard's URL, then the ids :func:`_traced_life` returns)."""
    tmp = tmp_path_factory.mktemp("dashboard-traces")
    with running_dev(tmp, "trace_enabled = true\n") as ns:

        async def setup() -> tuple[str, str, str]:
            async with open_admin(ns) as admin:
                await admin.create_topic("orders", 1)

                async def routed() -> bool:
                    topics = await admin.list_topics(include_system=True)
                    return "orders" in topics and "%TRACE%" in topics

                await await_until(routed, 20, "topics orders and %TRACE%")
            return await _traced_life(ns)

        traced, plain, untraced = trio.run(setup)
        port = free_port()
        proc = popen(
            "dashboard",
            "--namesrv",
            ns,
            "--listen-port",
            str(port),
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            url = f"http://127.0.0.1:{port}/"
            wait_until(lambda: answers(url + "api/overview"), 30, "the dashboard to answer")
            yield url, traced, plain, untraced
        finally:
            proc.terminate()
            proc.wait(30)


def test_the_message_page_shows_the_trace_timeline(board: tuple[str, str, str, str]) -> None:
    url, traced, _plain, _untraced = board
    dom = browse(url + "#/messages?id=" + traced)
    assert 'data-ready="messages"' in dom and "traced order" in dom and "<h3>Trace</h3>" in dom
    events = [dom.index(f'class="event {kind}"') for kind in ("sent", "delivered", "acked")]
    assert events == sorted(events)  # in the order they happened
    assert "billing/" in dom and "orders[0]@0" in dom


def test_a_message_shows_what_was_traced_of_it_and_nothing_else(board: tuple[str, str, str, str]) -> None:
    url, _traced, plain, untraced = board
    dom = browse(url + "#/messages?id=" + plain)  # sent untraced, consumed by the traced consumer
    assert "plain order" in dom and 'class="event delivered"' in dom and 'class="event acked"' in dom
    assert 'class="event sent"' not in dom
    dom = browse(url + "#/messages?id=" + untraced)
    assert "untraced order" in dom and "no trace events" in dom


def test_the_trace_api_answers_by_key(board: tuple[str, str, str, str]) -> None:
    url, traced, _plain, _untraced = board
    doc = json.loads(urllib.request.urlopen(url + "api/trace?key=order-1&ktopic=orders").read())
    assert [r[2] for r in doc["rows"]] == ["sent", "delivered", "acked"] and doc["events"][0]["msg_id"] == traced
