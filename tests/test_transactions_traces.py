"""Trace events of transactions on a real broker with ``trace_enabled``: an
END_TRANSACTION commit records ``committed`` (found by the committed message's id and
by the half message's id), a rollback ``rolled_back`` (by the half's id), and the
checker's rollback of an unresolved half after ``transaction_check_max`` checks too;
a second END records nothing more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from clmq.client import open_admin
from clmq.common import TRACE_TOPIC, TraceEvent
from tests.waiting import await_until

from .test_transactions_broker import Raw, _cluster, _pending_is, _running, half

TRACED = {"trace_enabled": True}


async def _events(admin: Any, msg_id: str, n: int) -> list[TraceEvent]:
    """The trace of ``msg_id`` once it holds ``n`` events (the broker writes its buffer
    every 200 ms)."""

    async def found() -> list[TraceEvent]:
        events: list[TraceEvent] = (await admin.trace(msg_id)).events
        return events if len(events) >= n else []

    return await await_until(found, 10, f"{n} trace events of {msg_id}")


async def test_commit_and_rollback_are_traced_by_either_id(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, **TRACED)
    await c.wait_routed(TRACE_TOPIC, {"broker-a"})
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        yes, no = await raw.send(half(b"yes"), half(b"no"))
        done = await raw.end(yes, "commit")
        assert (await raw.end(no, "rollback"))["state"] == "rolled_back"
        assert (await raw.end(yes, "commit"))["state"] == "already_committed"  # no second event
        half_yes, half_no = f"{broker.addr}@{yes:016X}", f"{broker.addr}@{no:016X}"
        (by_msg,) = await _events(admin, done["msg_id"], 1)
        (by_half,) = await _events(admin, half_yes, 1)
        (rolled,) = await _events(admin, half_no, 1)
        by_key = (await admin.trace(key="key-yes", topic="t")).events
    assert by_msg == by_half and by_key == [by_msg]
    assert (by_msg.kind, by_msg.msg_id, by_msg.origin_msg_id) == ("committed", done["msg_id"], half_yes)
    assert (by_msg.topic, by_msg.queue_id, by_msg.queue_offset) == ("t", done["queue_id"], done["queue_offset"])
    assert (by_msg.group, by_msg.broker, by_msg.keys, by_msg.uniq_key) == ("pg", "broker-a", "key-yes", "U-yes")
    assert (rolled.kind, rolled.msg_id, rolled.topic, rolled.queue_id) == ("rolled_back", half_no, "t", 1)
    assert (rolled.group, rolled.keys) == ("pg", "key-no")


async def test_the_checker_s_rollback_of_an_unresolved_half_is_traced(nursery: trio.Nursery, tmp_path: Path) -> None:
    settings = {**TRACED, "transaction_timeout_ms": 150, "transaction_check_max": 1, "transaction_orphan_after_ms": 150}
    c, broker = await _cluster(nursery, tmp_path, **settings)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"orphan", group="gone"))
        await await_until(lambda: _pending_is(raw, 1), 5, "the half pending")
        await await_until(lambda: _pending_is(raw, 0), 10, "the unresolved half rolled back")
        (event,) = await _events(admin, f"{broker.addr}@{off:016X}", 1)
    assert (event.kind, event.group, event.topic, event.uniq_key) == ("rolled_back", "gone", "t", "U-orphan")
    assert "unresolved after 1 checks" in event.detail and "no producer" in event.detail
