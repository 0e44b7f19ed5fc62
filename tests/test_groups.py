"""Several broker groups (issue 34): a topic's queues spread over the groups, a topic
grown onto a group added later, and one group's leader killed (SIGKILL) while the
other group keeps serving. Real ``clmq broker`` and ``clmq nameserver`` processes
(``tests/replica_procs.py``), the real ``clmq topic`` verbs and the public clients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from clmq.client import MessageQueue, NoRouteError, SendError, open_admin, open_consumer, open_producer
from clmq.client._admin_spread import spread
from clmq.client._routes import Routes
from clmq.common import Record
from tests.replica_procs import Group, open_group
from tests.waiting import await_until

ROOT = Path(__file__).resolve().parents[1]
ENV = {"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
NAMES = ["broker-a", "broker-b", "broker-c", "broker-d"]


# ----------------------------------------------------------------- the split, pure
@given(
    current=st.dictionaries(st.sampled_from(NAMES), st.integers(1, 6), max_size=3),
    chosen=st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True),
    extra=st.integers(0, 20),
)
def test_spread_keeps_every_queue_fills_the_emptiest_chosen_groups_and_reaches_the_total(
    current: dict[str, int], chosen: list[str], extra: int
) -> None:
    total = sum(current.values()) + extra
    if total == 0:
        return
    counts = spread(current, chosen, total)
    assert sum(counts.values()) == total
    assert all(counts[g] >= n for g, n in current.items())  # no queue is ever removed
    grown = [g for g in counts if counts[g] > current.get(g, 0)]
    assert set(grown) <= set(chosen)  # new queues only on the chosen groups
    for g in grown:  # each new queue went to the emptiest chosen group at the time
        assert counts[g] - 1 <= min(counts[h] for h in chosen)


def test_spread_examples_and_refusals() -> None:
    assert spread({}, ["broker-a", "broker-b"], 8) == {"broker-a": 4, "broker-b": 4}
    assert spread({}, ["broker-a", "broker-b"], 3) == {"broker-a": 2, "broker-b": 1}
    assert spread({"broker-a": 4}, ["broker-a", "broker-b"], 10) == {"broker-a": 5, "broker-b": 5}
    assert spread({"broker-a": 4, "broker-b": 4}, ["broker-a", "broker-b", "broker-c"], None) == {
        "broker-a": 4,
        "broker-b": 4,
        "broker-c": 4,
    }
    assert spread({"broker-a": 2}, ["broker-a"], 5) == {"broker-a": 5}  # one group: the count as before
    with pytest.raises(ValueError, match="can grow, not shrink"):
        spread({"broker-a": 4, "broker-b": 4}, ["broker-a", "broker-b"], 7)
    with pytest.raises(ValueError, match="at least 1 queue"):
        spread({}, ["broker-a"], 0)


# ----------------------------------------------------------------- helpers
def topic_cli(ns: str, *args: str) -> dict[str, Any]:
    """``clmq topic ... -o json`` run for real; its JSON answer."""
    out = subprocess.run(
        [sys.executable, "-m", "clmq", "topic", *args, "--namesrv", ns, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout))


async def start_groups(group: Group, names: Sequence[str]) -> None:
    for name in names:
        await group.start_broker(name, 0, broker_name=name)


async def routed(ns: str, topic: str, want: dict[str, int]) -> list[MessageQueue]:
    """The name server's route of ``topic`` once it shows ``want`` (broker name -> queues)."""
    async with open_admin([ns]) as admin:
        routes = Routes(admin.rpc, [ns])

        async def shows() -> list[MessageQueue] | None:
            try:
                mqs = await routes.queues(topic, refresh=True)
            except NoRouteError:  # not registered with the name server yet
                return None
            by: dict[str, int] = {}
            for mq in mqs:
                by[mq.broker_name] = by.get(mq.broker_name, 0) + 1
            return mqs if by == want else None

        return await await_until(shows, 15, f"the route of {topic} to show {want}")


async def consume_until(consumer: Any, want: set[str], timeout_s: float) -> list[Record]:
    """Records (by body) until every body of ``want`` came; a failure naming what is missing."""
    got: list[Record] = []
    missing = set(want)
    with trio.move_on_after(timeout_s):
        while missing:
            for rec in await consumer.receive():
                got.append(rec)
                missing.discard(rec.body.decode())
    assert not missing, f"{len(missing)} acked messages not consumed, e.g. {sorted(missing)[:5]}"
    return got


async def follower_serves(group: Group, key: str, end: int) -> None:
    """Until follower ``key``'s confirmed offset reaches ``end``: it serves consumers
    only that far (docs/replication.md), and it learns the leader's confirmed offset one
    fetch answer after it holds the bytes. A leader killed in between leaves its last
    acknowledged messages on the follower's log but unread (ack_mode async or sync)."""

    async def confirmed() -> bool:
        status = await group.try_status(key)
        return status is not None and status["confirmed_offset"] >= end

    await await_until(confirmed, 15, f"{key}'s confirmed offset to reach {end}")


# ----------------------------------------------------------------- processes
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_topic_create_spreads_the_queues_over_two_groups_and_the_routes_show_both(tmp_path: Path) -> None:
    async with open_group(tmp_path) as group:
        await start_groups(group, ["broker-a", "broker-b"])
        await routed_brokers(group, 2)
        made = await trio.to_thread.run_sync(topic_cli, group.ns_addr, "create", "t8", "--queues", "8")
        assert made["groups"] == {"broker-a": 4, "broker-b": 4} and made["queues"] == 8
        mqs = await routed(group.ns_addr, "t8", {"broker-a": 4, "broker-b": 4})
        assert sorted((mq.broker_name, mq.queue_id) for mq in mqs) == [
            (b, q) for b in ("broker-a", "broker-b") for q in range(4)
        ]  # RocketMQ's numbering: queue ids from 0 on each broker name
        odd = await trio.to_thread.run_sync(topic_cli, group.ns_addr, "create", "t3", "--queues", "3")
        assert odd["groups"] == {"broker-a": 2, "broker-b": 1}
        async with open_producer([group.ns_addr]) as producer:
            sent = [await producer.send("t8", f"m{i}".encode()) for i in range(16)]
        assert {r.queue.broker_name for r in sent} == {"broker-a", "broker-b"}  # both groups take the topic
        async with open_consumer([group.ns_addr], "c8", {"t8": "*"}, pull_wait_ms=200) as consumer:
            await consume_until(consumer, {f"m{i}" for i in range(16)}, 30)


async def routed_brokers(group: Group, count: int) -> None:
    await group.wait_cluster(lambda rows: len(rows) == count, 15, f"{count} brokers registered")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_topic_update_grows_a_topic_onto_a_new_group_and_clients_use_it(tmp_path: Path) -> None:
    async with open_group(tmp_path) as group:
        await start_groups(group, ["broker-a"])
        await routed_brokers(group, 1)
        async with open_admin([group.ns_addr]) as admin:
            assert await admin.spread_topic("grow", 4) == {"broker-a": 4}
        await routed(group.ns_addr, "grow", {"broker-a": 4})  # the name server learns it with a registration
        async with open_producer([group.ns_addr]) as producer:
            before = [await producer.send("grow", f"old{i}".encode()) for i in range(8)]
        # a consumer running before the topic grows: it must see the new group's queues
        async with open_consumer(
            [group.ns_addr], "ordered", {"grow": "*"}, pull_wait_ms=200, rebalance_interval_ms=200
        ) as consumer:
            await consume_until(consumer, {f"old{i}" for i in range(8)}, 30)
            await start_groups(group, ["broker-b"])
            await routed_brokers(group, 2)
            grown = await trio.to_thread.run_sync(topic_cli, group.ns_addr, "update", "grow", "--groups", "all")
            assert grown["groups"] == {"broker-a": 4, "broker-b": 4}
            async with open_admin([group.ns_addr]) as admin:
                assert await admin.spread_topic("grow", 10, grow=True) == {"broker-a": 5, "broker-b": 5}
                with pytest.raises(ValueError, match="can grow, not shrink"):
                    await admin.spread_topic("grow", 9, grow=True)
            await routed(group.ns_addr, "grow", {"broker-a": 5, "broker-b": 5})
            async with open_producer([group.ns_addr]) as producer:
                after = [await producer.send("grow", f"new{i}".encode()) for i in range(20)]
            assert {r.queue.broker_name for r in after} == {"broker-a", "broker-b"}
            got = await consume_until(consumer, {f"new{i}" for i in range(20)}, 30)
        assert {r.queue.broker_name for r in before} == {"broker-a"}
        assert any(rec.store_host[1] == group["broker-b"].port for rec in got)  # read from the new group
        unknown = await trio.to_thread.run_sync(_refused, group.ns_addr, "update", "grow", "--groups", "broker-x")
        assert "broker-x" in unknown and "broker-a, broker-b" in unknown


def _refused(ns: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "clmq", "topic", *args, "--namesrv", ns], capture_output=True, text=True, env=ENV
    )
    assert out.returncode == 1 and out.stderr.startswith("error: "), out.stdout + out.stderr
    return out.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_dead_groups_leader_leaves_the_other_group_serving_producers_and_consumers(tmp_path: Path) -> None:
    async with open_group(tmp_path) as group:
        await start_groups(group, ["broker-a", "broker-b"])
        await group.start_broker("broker-b1", 1, follow="broker-b", broker_name="broker-b")  # b's follower
        await routed_brokers(group, 3)
        async with open_admin([group.ns_addr]) as admin:
            assert await admin.spread_topic("t", 4) == {"broker-a": 2, "broker-b": 2}
        await routed(group.ns_addr, "t", {"broker-a": 2, "broker-b": 2})
        async with open_producer([group.ns_addr], retry_budget_ms=10_000) as producer:
            first = [await producer.send("t", f"pre{i}".encode()) for i in range(8)]
            assert {r.queue.broker_name for r in first} == {"broker-a", "broker-b"}
            end = await group.wait_in_sync("broker-b", ["broker-b1"])
            await follower_serves(group, "broker-b1", end)
            await group["broker-b"].kill()  # SIGKILL broker-b's leader (no ZooKeeper: no one takes over)
            # Every send is acked: the ones routed to broker-b's queues are retried on broker-a.
            later = [await producer.send("t", f"post{i}".encode()) for i in range(30)]
            assert {r.queue.broker_name for r in later} == {"broker-a"}
        async with open_producer([group.ns_addr], retry_budget_ms=0, retries=1) as pinned:
            dead = next(mq for mq in await pinned.routes.queues("t", refresh=True) if mq.broker_name == "broker-b")
            with pytest.raises(SendError):  # only a producer that pinned the dead group's queue fails
                await pinned.send("t", b"pinned", selector=lambda mqs, msg: dead)
        healthy = {f"pre{i}" for i, r in enumerate(first) if r.queue.broker_name == "broker-a"}
        async with open_consumer([group.ns_addr], "survivors", {"t": "*"}, pull_wait_ms=200) as consumer:
            await consume_until(consumer, healthy | {f"post{i}" for i in range(30)}, 30)
            # broker-b's acknowledged messages stay readable: its follower serves them
            await consume_until(consumer, {f"pre{i}" for i in range(8)} - healthy, 30)
        # Growing the topic now would count broker-b's queues as none and put them all on
        # broker-a (16 queues for 12, reported as success): it is refused, naming broker-b.
        await group.wait_cluster(lambda rows: "broker-b" not in rows, 15, "broker-b's dead leader expired")
        async with open_admin([group.ns_addr]) as admin:
            with pytest.raises(ValueError, match="broker group broker-b has no leader"):
                await admin.spread_topic("t", 12, grow=True)
        refused = await trio.to_thread.run_sync(_refused, group.ns_addr, "update", "t", "--queues", "12")
        assert "broker-b has no leader" in refused, refused
        await routed(group.ns_addr, "t", {"broker-a": 2, "broker-b": 2})  # nothing was added
