"""Orphaned half messages on a real broker: a half message of a group no producer
polls (every producer of the group died, or never answered) is counted as checked at
each look past ``transaction_timeout_ms`` once no producer of the group polled for
``transaction_orphan_after_ms`` (a check op record each, as a real check),
and after ``transaction_check_max`` such looks ``transaction_unresolved`` decides:
rolled back (retention is released, a log line says why) or kept (logged once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import open_admin
from tests.waiting import await_until

from .test_transactions_broker import FAST, Raw, _cluster, _pending_is, _receive, _running, half

ORPHAN = {"transaction_timeout_ms": 150, "transaction_check_max": 2, "transaction_orphan_after_ms": 150}


def _said(caplog: pytest.LogCaptureFixture, *parts: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if all(p in r.getMessage() for p in parts)]


async def _listed(raw: Raw, group: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = (await raw.list(group))["pending"]
    return rows


async def test_an_orphaned_half_is_counted_checked_and_rolled_back(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="clmq.transactions")
    c, broker = await _cluster(nursery, tmp_path, **ORPHAN, transaction_unresolved="rollback")
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"orphan", group="gone"))
        msg_id = f"{broker.addr}@{off:016X}"
        await await_until(lambda: _pending_is(raw, 1), 5, "the half pending")
        await await_until(lambda: _pending_is(raw, 0), 10, "the orphan rolled back")  # no producer of "gone" polls
        assert (await raw.end(off, "commit", group="gone"))["state"] == "already_rolled_back"
        info = await raw.info()
        assert info["transactions_checks"] >= 2  # both looks counted as checks
        assert info["transactions_rolled_back"] == 1
        lines = _said(caplog, msg_id, "gone", "topic t", "rolled back")
        assert len(lines) == 1 and "no producer of the group polled" in lines[0], lines
    assert await _receive(c, 0) == []


async def test_an_orphaned_half_kept_is_logged_once_and_stays_pending(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="clmq.transactions")
    c, broker = await _cluster(nursery, tmp_path, **ORPHAN, transaction_unresolved="keep")
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (first,) = await raw.send(half(b"kept", group="gone"))
        first_id = f"{broker.addr}@{first:016X}"
        await await_until(lambda: _said(caplog, first_id, "kept pending"), 10, "the first orphan kept")
        # A second orphan, kept in its turn: the checker looked many times past the first's decision.
        (second,) = await raw.send(half(b"later", group="gone"))
        second_id = f"{broker.addr}@{second:016X}"
        await await_until(lambda: _said(caplog, second_id, "kept pending"), 10, "the second orphan kept")
        assert len(_said(caplog, first_id, "kept pending")) == 1
        rows = {r["commitlog_offset"]: r["checks"] for r in await _listed(raw, "gone")}
        assert rows == {first: 2, second: 2}  # counted, never more than transaction_check_max
        assert (await raw.end(first, "commit", group="gone"))["state"] == "committed"
    assert [r.body for r in await _receive(c, 1)] == [b"kept"]


async def test_a_polling_producer_is_asked_and_not_counted_behind_its_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """With a producer of the group polling, the check is handed to it (its count
    goes up only when it is asked)."""
    settings = {"transaction_timeout_ms": 300, "transaction_check_max": 5, "transaction_orphan_after_ms": 100}
    c, broker = await _cluster(nursery, tmp_path, **settings)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"asked", group="live"))
        checks, _ = await raw.check("live", wait_ms=5000)
        assert checks == [[off, 1]]
        assert (await raw.end(off, "rollback", group="live", from_check=True))["state"] == "rolled_back"


async def test_an_orphan_s_counted_checks_survive_a_restart(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The looks are counted by check op records: a restarted broker reads them back."""
    counting = {"transaction_timeout_ms": 100, "transaction_check_max": 1000, "transaction_orphan_after_ms": 100}
    c, broker = await _cluster(nursery, tmp_path, **counting)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"orphan", group="gone"))

        async def counted() -> int:
            rows = await _listed(raw, "gone")
            return int(rows[0]["checks"]) if rows and rows[0]["checks"] >= 2 else 0

        before = await await_until(counted, 10, "two looks counted")
    await c.stop_broker("broker-a")
    broker = await c.start_broker(**{**FAST, **counting, "transaction_orphan_after_ms": 60_000})  # no counting now
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (row,) = await _listed(raw, "gone")
        assert row["commitlog_offset"] == off and row["checks"] >= before
        assert (await raw.end(off, "rollback", group="gone"))["state"] == "rolled_back"
