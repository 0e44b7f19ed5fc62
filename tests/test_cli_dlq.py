"""Retries, dead letters and scheduled messages through the real ``clmq`` (issue 20),
against a real ``clmq dev`` whose timer ticks fast: dead letters made by the broker's
CONSUMER_SEND_BACK (as a consumer sends them), then ``dlq list``, ``dlq show``,
``dlq resend`` (once, not twice), ``group describe``'s retry backlog and dead-letter
count, ``topic list`` with and without system topics, ``produce --delay`` and
``message cancel``."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.broker.cli._timefmt import parse_time_ms
from clmq.client import open_admin
from clmq.protocol import RequestCode
from clmq.protocol.transport import RpcClient, background_nursery
from tests.cli_helpers import clmq, popen, running_dev
from tests.waiting import wait_until

# A fast timer: deliveries within 50 ms of their time, cancels up to 500 ms before it.
DEV_CONFIG = "timer_tick_ms = 50\ntimer_cancel_margin_ms = 500\n"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``clmq dev`` (name server and broker) with :data:`DEV_CONFIG`; its name server."""
    with running_dev(tmp_path_factory.mktemp("dlq"), DEV_CONFIG) as addr:
        yield addr


def run(ns: str, tmp_path: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    out = clmq(*args, "--namesrv", ns, cwd=tmp_path)
    assert out.returncode == code, (args, out.returncode, out.stdout, out.stderr)
    return out


def js(out: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(out.stdout)


def lines(out: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def produce(ns: str, tmp_path: Path, topic: str, *bodies: str, extra: tuple[str, ...] = ()) -> list[str]:
    """Send ``bodies`` to queue 0 of ``topic``; their message ids."""
    out = run(ns, tmp_path, "produce", topic, *bodies, "--queue", "0", *extra)
    return [line.split()[-1] for line in out.stdout.splitlines()]


def send_back(msg_ids: list[str], group: str, *, to_dlq: bool) -> list[list[Any]]:
    """CONSUMER_SEND_BACK for these messages, as a consumer of ``group`` that failed on
    them sends it: to the dead letters (``to_dlq``), or to a retry due at once."""

    async def ask() -> list[list[Any]]:
        async with background_nursery() as nursery:
            rpc = RpcClient(nursery)
            addr = msg_ids[0].rpartition("@")[0]
            rows = [[int(m.rpartition("@")[2], 16), 0] for m in msg_ids]
            reply = await rpc.request(
                addr, RequestCode.CONSUMER_SEND_BACK, {"group": group, "messages": rows, "to_dlq": to_dlq}
            )
            await rpc.aclose()
            nursery.cancel_scope.cancel()
            return list(reply.fields["results"])

    return trio.run(ask)


def broker_info(ns: str) -> dict[str, Any]:
    async def ask() -> dict[str, Any]:
        async with open_admin([ns]) as admin:
            (b,) = await admin.leaders()
            return await admin.broker_info(b["addr"])

    return trio.run(ask)


def test_dead_letters_are_listed_shown_and_resent_once(ns: str, tmp_path: Path) -> None:
    run(ns, tmp_path, "topic", "create", "orders", "--queues", "2")
    ids = produce(ns, tmp_path, "orders", "o0", "o1", "o2", "o3", extra=("--keys", "k1", "--property", "colour=red"))
    assert [r[0] for r in send_back(ids[1:], "billing", to_dlq=True)] == ["dlq"] * 3
    listed = js(run(ns, tmp_path, "dlq", "list", "-o", "json"))
    assert [(r["group"], r["dead_letters"], r["not_resent"]) for r in listed] == [("billing", 3, 3)]
    assert "billing" in run(ns, tmp_path, "dlq", "list").stdout
    run(ns, tmp_path, "dlq", "list", "--group", "nobody", code=1)

    shown = js(run(ns, tmp_path, "dlq", "show", "billing", "-o", "json"))
    assert [s["body"] for s in shown] == ["o1", "o2", "o3"]
    assert all(
        s["origin_topic"] == "orders" and s["origin_queue_id"] == 0 and s["reconsume_times"] == 1 for s in shown
    ), shown[0]
    assert [s["origin_offset"] for s in shown] == [1, 2, 3] and shown[0]["properties"]["DLQ_GROUP"] == "billing"
    assert "orders q0 @1" in run(ns, tmp_path, "dlq", "show", "billing", "-n", "1").stdout
    assert js(run(ns, tmp_path, "group", "describe", "billing", "-o", "json"))["dead_letters"] == 3

    # The group is at the end of the topic: it gets each resent letter once more, fresh.
    run(ns, tmp_path, "group", "reset-offsets", "billing", "--topic", "orders", "--to-latest", "--execute")
    resent = js(run(ns, tmp_path, "dlq", "resend", "billing", "-o", "json"))
    assert len(resent["resent"]) == 3 and resent["skipped"] == 0 and not resent["errors"]
    again = lines(
        run(ns, tmp_path, "message", "read", "orders", "--queue", "0", "--offset", "4", "--count", "10", "-o", "json")
    )
    assert [m["body"] for m in again] == ["o1", "o2", "o3"]
    for m in again:
        assert m["reconsume_times"] == 0 and m["keys"] == "k1" and m["properties"]["colour"] == "red"
        assert not [k for k in m["properties"] if k.startswith("ORIGIN_") or k == "DLQ_GROUP"]
    described = js(run(ns, tmp_path, "group", "describe", "billing", "-o", "json"))
    assert sum(q["lag"] for q in described["queues"] if q["topic"] == "orders") == 3

    second = js(run(ns, tmp_path, "dlq", "resend", "billing", "-o", "json"))
    assert second["resent"] == [] and second["skipped"] == 3
    assert js(run(ns, tmp_path, "dlq", "list", "-o", "json"))[0]["not_resent"] == 0
    assert "%DLQ_RESENT%billing" not in js(run(ns, tmp_path, "group", "list", "-o", "json"))
    one = js(run(ns, tmp_path, "dlq", "resend", "billing", "--all", "--offset", "2", "-o", "json"))
    assert [r["dlq_offset"] for r in one["resent"]] == [2]
    run(ns, tmp_path, "dlq", "resend", "nobody", code=1)


def test_retry_backlog_and_system_topics(ns: str, tmp_path: Path) -> None:
    run(ns, tmp_path, "topic", "create", "payments", "--queues", "1")
    ids = produce(ns, tmp_path, "payments", "p0", "p1")
    assert [r[0] for r in send_back(ids, "ledger", to_dlq=False)] == ["retry", "retry"]
    wait_until(
        lambda: js(run(ns, tmp_path, "group", "describe", "ledger", "-o", "json"))["retry_backlog"] == 2,
        30,
        "the timer to deliver both retries to %RETRY%ledger",
    )
    described = run(ns, tmp_path, "group", "describe", "ledger")
    assert "retry backlog 2" in described.stdout and "dead letters 0" in described.stdout
    plain = js(run(ns, tmp_path, "topic", "list", "-o", "json"))
    assert "payments" in plain and not [t for t in plain if t.startswith("%")]
    every = js(run(ns, tmp_path, "topic", "list", "--all", "-o", "json"))
    assert {"%RETRY%ledger", "%TIMER%", "payments"} <= set(every)


def _delay_ms(row: dict[str, Any]) -> int:
    """How long after its send a message was stored in its real queue."""
    return parse_time_ms(row["store_time"]) - parse_time_ms(row["born_time"])


def test_produce_with_a_delay_delivers_after_it(ns: str, tmp_path: Path) -> None:
    run(ns, tmp_path, "topic", "create", "later", "--queues", "1")
    out = run(ns, tmp_path, "produce", "later", "soon", "--delay", "1s")
    assert " scheduled " in out.stdout and "@" in out.stdout.split()[-1]
    got = wait_until(
        lambda: lines(run(ns, tmp_path, "message", "read", "later", "--queue", "0", "-o", "json")),
        30,
        "the delayed message",
    )
    assert [g["body"] for g in got] == ["soon"] and _delay_ms(got[0]) >= 1000
    run(ns, tmp_path, "produce", "later", "x", "--delay", "soon", code=2)
    run(ns, tmp_path, "produce", "later", "x", "--delay", "1s", "--deliver-at", "1763891000000", code=2)
    refused = run(
        ns, tmp_path, "produce", "later", "x", "--deliver-at", "1h", code=2
    )  # "1h" elsewhere means an hour ago
    assert "--delay" in refused.stderr


def test_a_delay_counts_from_each_line_of_stdin_as_it_is_sent(ns: str, tmp_path: Path) -> None:
    """produce streams stdin: a line that comes late is delayed from its own send, not
    from the command's start."""
    run(ns, tmp_path, "topic", "create", "paced", "--queues", "1")
    proc = popen(
        "produce",
        "paced",
        "--queue",
        "0",
        "--delay",
        "1s",
        "--namesrv",
        ns,
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b"first\n")
        proc.stdin.flush()
        assert b" scheduled " in proc.stdout.readline()  # sent
        time.sleep(1.5)  # the input's pace: the next line comes after the first one's delay
        proc.stdin.write(b"second\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()

    def read() -> list[dict[str, Any]] | None:
        rows = lines(run(ns, tmp_path, "message", "read", "paced", "--queue", "0", "-o", "json"))
        return rows if len(rows) >= 2 else None

    rows = wait_until(read, 30, "both delayed messages")
    assert [r["body"] for r in rows] == ["first", "second"]
    assert [_delay_ms(r) >= 1000 for r in rows] == [True, True], rows


def test_a_cancelled_message_is_never_delivered(ns: str, tmp_path: Path) -> None:
    run(ns, tmp_path, "topic", "create", "cancelled", "--queues", "1")
    started = time.monotonic()
    far = produce(ns, tmp_path, "cancelled", "far", extra=("--delay", "30s"))[0]
    assert js(run(ns, tmp_path, "message", "cancel", far, "-o", "json"))["state"] == "cancelled"
    produce_and_cancel_ms = (time.monotonic() - started) * 1000  # on this machine, at its load now
    assert "already cancelled" in run(ns, tmp_path, "message", "cancel", far).stdout
    before = broker_info(ns)["timer_cancelled"]
    # Due soon, but after three times what a produce and a cancel took just now, plus the
    # 500 ms cancel margin: on a loaded machine CLI processes start slowly.
    at = int(time.time() * 1000) + 2000 + int(3 * produce_and_cancel_ms)
    near = produce(ns, tmp_path, "cancelled", "near", extra=("--deliver-at", str(at)))[0]
    assert js(run(ns, tmp_path, "message", "cancel", near, "-o", "json"))["state"] == "cancelled"
    due_in_s = max(0.0, at / 1000 - time.time())
    passed = lambda: broker_info(ns)["timer_cancelled"] > before  # noqa: E731
    wait_until(passed, due_in_s + 30, "the timer to pass the cancelled message")
    assert lines(run(ns, tmp_path, "message", "read", "cancelled", "--queue", "0", "-o", "json")) == []
    run(ns, tmp_path, "message", "cancel", far.rpartition("@")[0] + "@0000000000000000", code=1)
    run(ns, tmp_path, "message", "cancel", "not-an-id", code=2)


def test_resending_one_late_letter_leaves_the_earlier_ones_to_resend(ns: str, tmp_path: Path) -> None:
    run(ns, tmp_path, "topic", "create", "parcels", "--queues", "1")
    ids = produce(ns, tmp_path, "parcels", "p0", "p1", "p2")
    send_back(ids, "post", to_dlq=True)
    one = js(run(ns, tmp_path, "dlq", "resend", "post", "--offset", "2", "-o", "json"))
    assert [r["dlq_offset"] for r in one["resent"]] == [2]
    assert js(run(ns, tmp_path, "dlq", "list", "--group", "post", "-o", "json"))[0]["not_resent"] == 3
    rest = js(run(ns, tmp_path, "dlq", "resend", "post", "-o", "json"))
    assert [r["dlq_offset"] for r in rest["resent"]][:2] == [0, 1]  # none lost (2 goes again: documented)
