"""A topic change is acknowledged only once every in-sync follower holds it.

Topics are copied beside the log (REPLICA_METADATA), not in it, so "in sync" on the log
said nothing about them: a follower promoted right after a topic was created could
lead without it, and its followers then deleted the topic too (a CI run of
``test_failover_procs`` saw every send refused with TOPIC_NOT_FOUND for 20 s after a
hand-over that followed the topic's creation). Real brokers in this process, real
sockets and files; the followers' fetches long-poll for 10 s, so nothing but the
change's own wait can bring them the news in time.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio

from clmq.broker.replication import FollowerState, InSyncSet
from clmq.broker.service import Broker
from clmq.client import open_admin
from clmq.common import Message
from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.transport import RpcClient, RpcError
from tests.service_helpers import Cluster
from tests.test_replication import in_sync, send_raw, start_group
from tests.waiting import await_until

# Followers parked in a long poll at the leader's end, copying metadata rarely: only
# the topic change's wait can make them copy it before the answer.
PARKED = {"replica_fetch_wait_ms": 10_000, "replica_metadata_interval_ms": 60_000, "replica_lag_max_ms": 60_000}

CHANGES: dict[str, tuple[list[tuple[RequestCode, dict[str, Any]]], dict[str, int]]] = {
    "create": ([(RequestCode.CREATE_TOPIC, {"topic": "new", "queue_count": 3})], {"old": 2, "new": 3}),
    "grow": ([(RequestCode.CREATE_TOPIC, {"topic": "old", "queue_count": 5})], {"old": 5}),
    "delete": ([(RequestCode.DELETE_TOPIC, {"topic": "old"})], {}),
}


@asynccontextmanager
async def group(
    nursery: trio.Nursery, tmp_path: Path, followers: int, common: dict[str, Any], **leader: Any
) -> AsyncIterator[tuple[Cluster, Broker, list[Broker], RpcClient]]:
    """A name server, a leader and ``followers`` in sync (``common``: every replica's
    settings, ``leader``: the leader's), and a client."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, fs = await start_group(c, followers, common, **leader)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        try:
            await in_sync(lead, followers)
            yield c, lead, fs, rpc
        finally:
            await rpc.aclose()


@pytest.mark.parametrize("ack_mode", ["async", "sync"])
@pytest.mark.parametrize("change", sorted(CHANGES))
async def test_a_topic_change_is_answered_once_every_in_sync_follower_holds_it(
    nursery: trio.Nursery, tmp_path: Path, change: str, ack_mode: str
) -> None:
    requests, want = CHANGES[change]
    async with group(nursery, tmp_path, 2, PARKED, ack_mode=ack_mode, min_insync_replicas=2) as (_, lead, fs, rpc):
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "old", "queue_count": 2})
        assert [f.store.topics.all() for f in fs] == [{"old": 2}, {"old": 2}]
        for code, fields in requests:
            reply = await rpc.request(lead.addr, code, fields, check=False)
            assert reply.error_code == 0, reply
            # The answer came: every in-sync follower holds the change already.
            assert [f.store.topics.all() for f in fs] == [want, want], change


async def test_a_topic_made_by_its_first_message_is_acknowledged_once_the_followers_hold_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    settings = {"auto_create_topics": True, "default_queue_count": 3}
    async with group(nursery, tmp_path, 2, PARKED, **settings) as (_, lead, fs, rpc):
        reply = await send_raw(rpc, lead.addr, "made", [Message("made", 2, b"first")])
        assert reply.error_code == 0, reply
        assert [f.store.topics.all() for f in fs] == [{"made": 3}, {"made": 3}]


async def test_a_follower_promoted_right_after_a_topic_was_created_leads_with_the_topic(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with group(nursery, tmp_path, 2, PARKED, ack_mode="sync", min_insync_replicas=2) as (c, lead, fs, rpc):
        f, other = fs
        created = await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "orders", "queue_count": 2})
        assert created.fields["queue_count"] == 2
        await c.stop_broker("g0")  # the leader goes the moment the creation is answered
        await await_until(lambda: not f.replica.follower.in_sync, 10, "the follower noticing")  # type: ignore[union-attr]
        promoted = await rpc.request(f.addr, RequestCode.PROMOTE, {})
        assert promoted.fields["role"] == "leader"
        reply = await send_raw(rpc, f.addr, "orders", [Message("orders", 1, b"after the promotion")])
        assert reply.error_code == 0, reply
        # The other follower follows the new leader and keeps the topic too.
        await await_until(
            lambda: other.replica.follower is not None and other.replica.follower.leader_addr == f.addr,
            15,
            "the other follower following the new leader",
        )
        await await_until(lambda: other.store.max_offset("orders", 1) == 1, 10, "the message on the other follower")
        assert other.store.topics.all() == {"orders": 2}


@asynccontextmanager
async def metadata_copies_hang(broker: Broker) -> AsyncIterator[None]:
    """``broker``'s metadata copies hang (their worker thread stuck) inside the block."""
    stuck, apply = trio.Event(), broker.metadata.apply

    def hang(snapshot: dict[str, Any]) -> None:
        trio.from_thread.run(stuck.wait)
        apply(snapshot)

    broker.metadata.apply = hang  # type: ignore[method-assign]
    try:
        yield
    finally:
        stuck.set()


async def test_a_topic_change_no_in_sync_follower_copies_in_time_is_a_replication_timeout(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A follower whose metadata copy hangs: the change is made on the leader but not
    acknowledged, the error says who lacks it, and sync writes to the topic are not
    acknowledged either until the follower holds it."""
    settings = {"replication_timeout_ms": 500, "ack_mode": "sync", "min_insync_replicas": 2}
    create = (RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 1})
    async with group(nursery, tmp_path, 1, PARKED, **settings) as (_, lead, (f,), rpc):
        async with metadata_copies_hang(f):
            reply = await rpc.request(lead.addr, *create, check=False)
            assert reply.error_code == ErrorCode.REPLICATION_TIMEOUT, reply
            assert "replica 1" in reply.error_text and "replication_timeout_ms=500" in reply.error_text, reply
            assert lead.store.topics.all() == {"t": 1}  # made on the leader: a retry answers once it is copied
            sent = await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"while the topic is not copied")])
            assert sent.error_code == ErrorCode.REPLICATION_TIMEOUT, sent

        async def created() -> bool:
            return (await rpc.request(lead.addr, *create, check=False)).error_code == 0

        await await_until(created, 15, "the creation's retry answered")
        assert f.store.topics.all() == {"t": 1}
        assert (await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"now")])).error_code == 0


async def test_a_follower_that_cannot_copy_topics_leaves_the_in_sync_set_and_changes_go_on(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """One sick follower must not block every topic change: lacking the leader's topics
    it is not caught up, so it leaves the set after ``replica_lag_max_ms`` and the change
    is answered (the follower, out of the set, is neither elected nor promotable)."""
    lag = {"replica_lag_max_ms": 800, "replication_timeout_ms": 15_000}
    async with group(nursery, tmp_path, 1, {**PARKED, **lag}) as (_, lead, (f,), rpc):
        async with metadata_copies_hang(f):
            fields = {"topic": "t", "queue_count": 1}
            reply = await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, fields, timeout_ms=20_000)
            assert reply.fields["queue_count"] == 1
            assert lead.replica.leader is not None and not lead.replica.leader.isr.followers[1].in_sync
            assert f.store.topics.all() == {}
        await in_sync(lead, 1)  # copied at last: back in the set
        assert f.store.topics.all() == {"t": 1}


def test_a_follower_behind_the_leaders_topics_is_not_recorded_in_sync_for_elections() -> None:
    """ZooKeeper mode: only a follower holding the confirmed log *and* the leader's
    topics may join the set elections choose from."""
    isr = InSyncSet("g", lag_max_ms=1000, count_flushed=False, confirmed=100, coordinated=True)
    for i, topics in ((1, 7), (2, 6), (3, None)):
        f = FollowerState(i, "h", session=i, joined_ms=0.0, topics_version=topics)
        isr.join(f)
        isr.report(f, 100, 100, 100, now_ms=1.0)
    assert [f.in_sync for f in isr.followers.values()] == [True, True, True]
    assert isr.ready_to_record(set(), topics_version=7) == [1, 3]  # 3: a follower too old to say
    assert isr.lacking_topics(7) == [2]
    assert isr.lacking_topics(6) == []


async def test_a_graceful_hand_over_waits_for_the_targets_topics(
    nursery: trio.Nursery, tmp_path: Path, zk_connect: str
) -> None:
    """ZooKeeper mode: a target in sync on the log but lacking the leader's newest topic
    (its copy hangs) is not handed the group, whose leader stays; once it holds the
    topic, the hand-over goes through and the new leader has it."""
    from tests.test_coordination import one_leader, zk_state
    from tests.test_coordination import start_group as coordinated_group

    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    settings = {"replica_lag_max_ms": 60_000, "replication_timeout_ms": 500, "leader_transfer_timeout_ms": 1500}
    bs = await coordinated_group(c, zk_connect, **settings)
    leader = await one_leader(c)
    await await_until(lambda: len(zk_state(zk_connect)["isr"]) == 3, 15, "every replica in ZooKeeper's in-sync set")
    target = next(b for b in bs if b is not leader)
    async with trio.open_nursery() as n, open_admin(broker_addrs=[leader.addr]) as admin:
        rpc = RpcClient(n)
        async with metadata_copies_hang(target):
            fields = {"topic": "late", "queue_count": 1}
            reply = await rpc.request(leader.addr, RequestCode.CREATE_TOPIC, fields, check=False)
            assert reply.error_code == ErrorCode.REPLICATION_TIMEOUT, reply
            with pytest.raises(RpcError, match="did not catch up"):
                await admin.promote(target.addr)
            assert leader.replica.leader is not None and target.replica.leader is None
        await await_until(lambda: target.store.topics.all().get("late") == 1, 10, "the topic copied at last")
        await admin.promote(target.addr)
        await await_until(lambda: target.replica.leader is not None, 15, "the target leading")
        assert target.store.topics.all().get("late") == 1
        await rpc.aclose()
