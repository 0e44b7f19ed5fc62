"""A POP group seen by operators (issue 33), against a real ``clmq dev``: messages
popped (POP_MESSAGE, as POP consumers send it) by two members, some acknowledged, some
left past their invisible time, one acknowledged too late (refused, counted) and one
popped again; then ``clmq group describe`` (table and ``-o json``), ``clmq group
members`` and the dashboard's group pages in headless Chromium show each queue's next
and settled offsets, lag, the messages in flight and redelivering, the members and the
counts."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import open_admin
from clmq.protocol import RequestCode
from clmq.protocol.transport import RpcClient, background_nursery
from tests.cli_helpers import clmq, free_port, popen, running_dev
from tests.test_dashboard import answers, browse, screenshot
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

GROUP = "workers"
LONG_MS = 600_000  # invisible for the whole test
PER_QUEUE = 6  # messages in each of the topic's two queues


def call(ns: str, code: RequestCode, fields: dict[str, Any]) -> dict[str, Any]:
    """One request to the broker, as a POP consumer sends it; the answer's fields."""

    async def ask() -> dict[str, Any]:
        async with open_admin([ns]) as admin:
            (b,) = await admin.leaders()
        async with background_nursery() as nursery:
            rpc = RpcClient(nursery)
            reply = await rpc.request(b["addr"], code, fields)
            await rpc.aclose()
            nursery.cancel_scope.cancel()
            return dict(reply.fields)

    return trio.run(ask)


def pop(ns: str, client_id: str, n: int, invisible_ms: int) -> list[str]:
    got = call(
        ns,
        RequestCode.POP_MESSAGE,
        {"group": GROUP, "client_id": client_id, "topic": "jobs", "invisible_time_ms": invisible_ms, "max_messages": n},
    )
    return list(got["handles"])


def ack(ns: str, handles: list[str]) -> list[str]:
    return list(call(ns, RequestCode.ACK_MESSAGE, {"group": GROUP, "handles": handles})["results"])


def describe(ns: str, cwd: Path) -> dict[str, Any]:
    out = clmq("group", "describe", GROUP, "-o", "json", "--namesrv", ns, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def totals(info: dict[str, Any]) -> dict[str, int]:
    (p,) = info["pop"]
    queues = p["queues"]
    return {
        "inflight": sum(q["inflight"] for q in queues),
        "redelivering": sum(q["redelivering"] for q in queues),
        **{k: p[k] for k in ("popped", "acked", "ack_expired", "redelivered", "dead_lettered")},
    }


@pytest.fixture(scope="module")
def ns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``clmq dev`` whose group ``workers`` popped 11 messages of ``jobs`` (2 queues
    of 6): 3 acknowledged, 1 acknowledged too late, 1 of the 2 past their invisible time
    popped again; so 7 in flight, 1 of them redelivering."""
    tmp = tmp_path_factory.mktemp("pop-cli")
    # Members stay listed for the whole module, however slowly a loaded machine runs it.
    with running_dev(tmp, f"pop_member_timeout_ms = {LONG_MS}\n") as addr:
        assert clmq("topic", "create", "jobs", "--queues", "2", "--namesrv", addr, cwd=tmp).returncode == 0
        for q in (0, 1):
            bodies = [f"job {q}-{i}" for i in range(PER_QUEUE)]
            assert clmq("produce", "jobs", *bodies, "--queue", str(q), "--namesrv", addr, cwd=tmp).returncode == 0
        first = pop(addr, "w1", 8, LONG_MS)
        assert len(first) == 8 and ack(addr, first[:3]) == ["ok"] * 3
        short = pop(addr, "w2", 2, 1)  # visible again 1 ms later
        assert len(short) == 2
        wait_until(lambda: totals(describe(addr, tmp))["redelivering"] == 2, 30, "two deliveries past their deadline")
        assert ack(addr, short[:1]) == ["expired"]  # too late: refused, counted
        again = pop(addr, "w1", 1, LONG_MS)  # one of the two comes back first, attempt 2
        assert len(again) == 1
        yield addr


def test_group_describe_shows_a_pop_groups_queues_members_and_counts(ns: str, tmp_path: Path) -> None:
    info = describe(ns, tmp_path)
    assert totals(info) == {
        "inflight": 7,
        "redelivering": 1,
        "popped": 11,
        "acked": 3,
        "ack_expired": 1,
        "redelivered": 1,
        "dead_lettered": 0,
    }
    (p,) = info["pop"]
    assert sorted(p["members"]) == ["w1", "w2"] and p["broker_name"] == "broker-a"
    assert sorted(q["queue_id"] for q in p["queues"]) == [0, 1]
    for q in p["queues"]:
        assert q["topic"] == "jobs" and q["max_offset"] == PER_QUEUE
        assert 0 <= q["settled_offset"] <= q["next_offset"] <= q["max_offset"]
        assert q["lag"] == q["max_offset"] - q["settled_offset"]
    out = clmq("group", "describe", GROUP, "--namesrv", ns, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "group workers, POP (lag" in text and "in flight 7, redelivering 1" in text
    assert "next offset\tsettled offset\tmax offset\tlag\tin flight\tredelivering" in text
    assert "POP members: w1, w2" in text
    assert "popped 11, acked 3, expired acks (refused) 1, redelivered 1, dead-lettered 0" in text


def test_group_members_lists_the_members_that_popped(ns: str, tmp_path: Path) -> None:
    out = clmq("group", "members", GROUP, "-o", "json", "--namesrv", ns, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(m["client_id"], m["mode"], m["topics"], m["brokers"]) for m in rows] == [
        ("w1", "pop", ["jobs"], ["broker-a"]),
        ("w2", "pop", ["jobs"], ["broker-a"]),
    ]
    text = clmq("group", "members", GROUP, "--namesrv", ns, cwd=tmp_path).stdout
    assert "w1\tpop\tany queue of jobs (POP)" in text


def test_a_group_nobody_popped_or_committed_is_still_an_error(ns: str, tmp_path: Path) -> None:
    for verb in ("describe", "members"):
        out = clmq("group", verb, "nobody", "--namesrv", ns, cwd=tmp_path)
        assert out.returncode == 1 and "does not exist" in out.stderr


@pytest.fixture(scope="module")
def board(ns: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``clmq dashboard`` on the dev cluster; its URL."""
    port = free_port()
    tmp = tmp_path_factory.mktemp("pop-board")
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
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def describe_pop_queues(board: str) -> list[dict[str, Any]]:
    doc = json.loads(urllib.request.urlopen(board + "api/group?name=" + GROUP).read())
    return [q for p in doc["pop"] for q in p["queues"]]


def test_the_dashboard_shows_in_flight_and_redelivering_columns(board: str) -> None:
    groups = json.loads(urllib.request.urlopen(board + "api/groups").read())["groups"]
    (row,) = [g for g in groups if g["group"] == GROUP]
    assert row["pop"] and row["inflight"] == 7 and row["redelivering"] == 1 and row["members"] == 2
    dom = browse(board + "#/groups")
    assert "in flight (POP)" in dom and "redelivering (POP)" in dom and ">workers</a>" in dom
    dom = browse(board + "#/groups?name=workers")
    assert 'POP: in flight <span class="pop-inflight">7</span>, redelivering <span class="retry">1</span>' in dom
    assert "settled offset" in dom and "POP members: w1, w2" in dom
    lag = sum(q["lag"] for q in describe_pop_queues(board))
    assert (
        f'total lag <span class="lag">{lag}</span>' in dom and ">committed<" not in dom
    )  # only pops: no offsets table
    assert "popped 11, acked 3, expired acks (refused) 1, redelivered 1, dead-lettered 0" in dom


def test_a_screenshot_of_the_pop_group_page(board: str, tmp_path: Path) -> None:
    out = Path(os.environ.get("CLMQ_DASHBOARD_SCREENSHOTS", tmp_path))
    screenshot(board + "#/groups?name=workers", out / "dashboard-pop-group.png")
