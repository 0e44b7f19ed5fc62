"""POP consumption with many members against a real broker: 20 members of one group
on a 2-queue topic all get work and every message is handled; member processes
killed with SIGKILL mid-message (tests/pop_member.py) lose nothing: their messages come
back after the invisible time, are handled by the others, and every message is
acknowledged exactly once across members."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import trio

from clmq.client import ConsumeStatus, Record, open_pop_consumer
from tests.service_helpers import Cluster
from tests.test_pop_client import BROKER, send
from tests.waiting import await_until

MEMBER = Path(__file__).with_name("pop_member.py")
TEST_TIMEOUT_S = 120  # each test's whole body (its own waits are shorter)


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker(**BROKER)
    return c


async def test_twenty_members_on_two_queues_all_get_work(cluster: Cluster) -> None:
    """Each member's handler holds its first message until all 20 members hold one (a
    barrier, no timing): only a group whose work reaches every member gets past it."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("many", 2)
        addr = cluster.brokers["broker-a"].addr
        bodies = [f"{q}-{i}".encode() for q in (0, 1) for i in range(100)]
        for q in (0, 1):
            await send(addr, "many", [b for b in bodies if b.startswith(b"%d-" % q)], q)
        handled: dict[str, list[bytes]] = {f"m{i:02d}": [] for i in range(20)}
        all_busy, all_done = trio.Event(), trio.Event()
        total = Counter[bytes]()

        def handler_of(member: str):  # type: ignore[no-untyped-def]
            async def handler(r: Record) -> ConsumeStatus:
                first = not handled[member]
                handled[member].append(r.body)
                if first:
                    if all(handled.values()):
                        all_busy.set()
                    await all_busy.wait()
                total[r.body] += 1
                if len(total) == len(bodies):
                    all_done.set()
                return ConsumeStatus.SUCCESS

            return handler

        opts = {
            "invisible_time_ms": 15_000,
            "max_messages": 2,
            "prefetch_max_messages": 2,
            "handler_concurrency": 1,
            "pop_wait_ms": 300,
        }
        async with trio.open_nursery() as n:
            for member in handled:
                n.start_soon(_member, cluster.ns, member, handler_of(member), opts)
            with trio.fail_after(30):
                await all_busy.wait()
                await all_done.wait()
            n.cancel_scope.cancel()
        assert all(handled.values())  # every member got work
        assert sorted(total) == sorted(bodies)
        assert set(total.values()) == {1}  # none waited out its invisible time: each handled once


async def _member(ns: list[str], member: str, handler: object, opts: dict[str, int]) -> None:
    async with open_pop_consumer(ns, "crowd", {"many": "*"}, client_id=member, **opts) as c:  # type: ignore[arg-type]
        await c.run(handler)  # type: ignore[arg-type]


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
async def test_members_killed_mid_message_lose_nothing_and_nothing_is_acknowledged_twice(
    cluster: Cluster, tmp_path: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("jobs", 2)
        addr = cluster.brokers["broker-a"].addr
        bodies = [f"j{i:02d}" for i in range(80)]
        for q in (0, 1):
            await send(addr, "jobs", [b.encode() for b in bodies[q::2]], q)
        ns = cluster.ns[0]
        procs: dict[str, subprocess.Popen[bytes]] = {}
        files = {name: tmp_path / f"{name}.out" for name in ("victim1", "victim2", "survivor1", "survivor2")}

        def start(name: str, *extra: str) -> None:
            cmd = [
                sys.executable,
                str(MEMBER),
                ns,
                "workers",
                "jobs",
                name,
                str(files[name]),
                "--invisible-time-ms",
                "2000",
            ]
            procs[name] = subprocess.Popen([*cmd, *extra])

        try:
            start("victim1", "--hang-after", "1")
            start("victim2", "--hang-after", "2")
            hung = {}
            for victim in ("victim1", "victim2"):
                line = await await_until(
                    lambda v=victim: next((ln for ln in _lines(files[v]) if ln[0] == "hang"), None),  # type: ignore[misc]
                    30,
                    f"{victim} to hang in the middle of a message",
                )
                hung[victim] = line[1]
            start("survivor1")
            start("survivor2")
            for survivor in ("survivor1", "survivor2"):
                await await_until(lambda s=survivor: ["READY"] in _lines(files[s]), 30, f"{survivor} to start")  # type: ignore[misc]
            for victim in ("victim1", "victim2"):
                os.kill(procs[victim].pid, signal.SIGKILL)
                procs[victim].wait()

            def oks() -> Counter[str]:
                return Counter(ln[1] for f in files.values() for ln in _lines(f) if ln[0] == "ack" and ln[2] == "ok")

            await await_until(lambda: len(oks()) == len(bodies), 60, "every message acknowledged")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        acked = oks()
        assert sorted(acked) == bodies
        assert set(acked.values()) == {1}, [b for b, n in acked.items() if n > 1]  # exactly once across members
        survivors = [ln for s in ("survivor1", "survivor2") for ln in _lines(files[s])]
        for victim, body in hung.items():
            assert ["ack", body, "ok"] in survivors, (victim, body)  # the killed member's message, handled by another
            retries = [int(ln[2]) for ln in survivors if ln[0] == "start" and ln[1] == body]
            assert retries and min(retries) >= 1  # it came back after its invisible time: a redelivery
        victims_acked = {ln[1] for v in ("victim1", "victim2") for ln in _lines(files[v]) if ln[0] == "ack"}
        assert victims_acked and len(victims_acked) == 3  # what the victims finished stays finished
