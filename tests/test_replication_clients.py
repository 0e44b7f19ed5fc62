"""The clients of a replicated group, with real brokers in this process (real sockets,
real files): the producer's retries under sync acks (NOT_ENOUGH_REPLICAS,
REPLICATION_TIMEOUT: the same queue; NOT_LEADER), consumers reading from followers,
and the leader's hint to read from one (``suggest_follower``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from clmq.broker.service import Broker
from clmq.broker.service._replicated import offset_rows
from clmq.client import MessageQueue, RpcClient, SendError, open_consumer, open_producer
from clmq.common import Message, Record
from clmq.protocol import ErrorCode, FetchAsk, RequestCode
from tests.service_helpers import FAST_CONSUMER, Cluster, follower_routed
from tests.waiting import await_until

FAST = {"replica_metadata_interval_ms": 100, "replica_fetch_wait_ms": 200, "replica_retry_ms": 100}
SYNC = {"ack_mode": "sync", "min_insync_replicas": 2}


async def start_group(c: Cluster, *, follower: bool = True, **leader: Any) -> tuple[Broker, Broker | None]:
    """Group "g": a leader (id 0, ``leader`` settings) and, if asked, a follower (id 1)."""
    lead = await c.start_broker("g", key="g0", broker_id=0, **{**FAST, **leader})
    f = await start_follower(c, lead) if follower else None
    return lead, f


async def start_follower(c: Cluster, lead: Broker) -> Broker:
    return await c.start_broker("g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **FAST)


async def in_sync(lead: Broker, replicas: int) -> None:
    """Wait until ``replicas`` replicas (the leader included) are in sync."""

    def ready() -> bool:
        return lead.replica.leader is not None and lead.replica.leader.isr.size() == replicas

    await await_until(ready, 15, f"{replicas} replicas in sync")


def stored(broker: Broker, topic: str, queues: int) -> dict[int, list[Record]]:
    """Every record of the topic's queues on ``broker``, per queue."""
    out: dict[int, list[Record]] = {}
    for q in range(queues):
        res = broker.store.get(topic, q, 0, 100_000)
        out[q] = res.messages
    return out


def identity(r: Record) -> tuple[Any, ...]:
    return r.queue_id, r.queue_offset, r.commitlog_offset, r.body, r.keys, r.tags, r.store_timestamp_ms


async def consume(consumer: Any, count: int, timeout_s: float = 20) -> list[Record]:
    got: list[Record] = []
    with trio.move_on_after(timeout_s):
        while len(got) < count:
            got += await consumer.receive()
    assert len(got) >= count, f"read {len(got)} of {count} messages in {timeout_s} s"
    return got


# ------------------------------------------------------------------ producer
async def test_a_sync_send_below_min_insync_replicas_fails_with_that_code_and_stores_nothing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _f = await start_group(c, replica_lag_max_ms=300, **SYNC)
    await c.create_topic("t", 2)
    await in_sync(lead, 2)
    async with open_producer(c.ns, retries=2, replication_retry_backoff_ms=20) as p:
        ok = await p.send("t", b"held by both")
        await c.stop_broker("g1")
        await in_sync(lead, 1)  # the follower left the in-sync set
        end = lead.store.log.write_offset
        with pytest.raises(SendError) as e:
            await p.send("t", b"refused", sharding_key="k")
    assert ok.queue.broker_name == "g"
    assert e.value.code == ErrorCode.NOT_ENOUGH_REPLICAS, e.value
    assert "NOT_ENOUGH_REPLICAS" in str(e.value) and "3 times" in str(e.value)
    assert lead.store.log.write_offset == end  # refused before anything was written, every time
    assert [r.body for q in stored(lead, "t", 2).values() for r in q] == [b"held by both"]


async def test_sends_refused_for_replication_are_retried_on_the_same_queue(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The follower stops: the leader first answers REPLICATION_TIMEOUT (stored, not held
    in time; the follower is still counted in sync), then NOT_ENOUGH_REPLICAS once it
    leaves the set. The producer keeps retrying the queue it picked first (the selector
    is asked once) until the follower is back in sync, with the batch stored once: the
    retries after the timed-out try are marked dedup, and the leader answers the last
    one with the copy the first try stored."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _f = await start_group(c, replica_lag_max_ms=1500, replication_timeout_ms=300, **SYNC)
    await c.create_topic("t", 4)
    await in_sync(lead, 2)
    await c.stop_broker("g1")
    picks: list[int] = []

    def selector(mqs: Sequence[MessageQueue], _msg: Message) -> MessageQueue:
        picks.append(len(picks))
        return mqs[2 + len(picks) - 1]  # a second call would pick another queue

    async def restart_once_retried() -> None:
        # The first try stored in queue 2, and the follower out of the in-sync set: the
        # retries are refused (NOT_ENOUGH_REPLICAS) until it is back.
        await await_until(lambda: lead.store.max_offset("t", 2) >= 1, 15, "the first try stored in queue 2")
        await await_until(
            lambda: lead.replica.leader is not None and lead.replica.leader.isr.size() == 1,
            15,
            "the follower out of the in-sync set",
        )
        await start_follower(c, lead)

    nursery.start_soon(restart_once_retried)
    async with open_producer(c.ns, retries=200, replication_retry_backoff_ms=50) as p:
        with trio.fail_after(30):
            result = await p.send("t", b"keep my place", selector=selector)
    assert picks == [0] and result.queue.queue_id == 2 and result.queue.broker_name == "g"
    queues = stored(lead, "t", 4)
    assert {q: len(rs) for q, rs in queues.items() if rs} == {2: 1}
    assert queues[2][0].body == b"keep my place" and result.queue_offset == 0  # the first try's copy


async def test_a_send_to_a_follower_is_refused_with_not_leader_and_stores_nothing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, f = await start_group(c)
    assert f is not None
    await c.create_topic("t", 2)
    await in_sync(lead, 2)
    await await_until(lambda: f.store.topics.queue_count("t") == 2, 10, "the topic on the follower")
    ends = lead.store.log.write_offset, f.store.log.write_offset
    async with open_producer(broker_addrs=[f.addr], retries=1, replication_retry_backoff_ms=20) as p:
        with pytest.raises(SendError) as e:
            await p.send("t", b"to a follower")
    assert e.value.code == ErrorCode.NOT_LEADER, e.value
    assert lead.addr in str(e.value)  # the follower names its leader
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        commit = await rpc.request(
            f.addr, RequestCode.COMMIT_OFFSET, {"group": "cg", "offsets": [["t", 0, 0]]}, check=False
        )
        await rpc.aclose()
    assert commit.error_code == ErrorCode.NOT_LEADER
    assert (lead.store.log.write_offset, f.store.log.write_offset) == ends
    assert f.offsets.query("cg", "t", 0) == -1
    # Through the name server the producer finds the leader.
    async with open_producer(c.ns) as p:
        assert (await p.send("t", b"to the leader")).queue.addr == lead.addr


# ----------------------------------------------------------------- consumers
async def produce(c: Cluster, topic: str, count: int, prefix: bytes = b"m", pad: int = 0) -> None:
    async with open_producer(c.ns) as p:
        for i in range(count):
            body = b"%s%d" % (prefix, i) + b"." * pad
            await p.send(topic, body, keys=f"k{i}", tags="even" if i % 2 == 0 else "odd")


async def ready_group(
    nursery: trio.Nursery, tmp_path: Path, queues: int, messages: int, **leader: Any
) -> tuple[Cluster, Broker, Broker]:
    """A name server, a leader and an in-sync follower, topic "t" of ``queues`` queues
    holding ``messages`` messages."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, f = await start_group(c, **leader)
    assert f is not None
    await c.create_topic("t", queues)
    await in_sync(lead, 2)
    await produce(c, "t", messages)
    return c, lead, f


async def test_routes_list_each_groups_followers(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, f = await start_group(c)
    assert f is not None
    await c.create_topic("t", 2)
    async with open_consumer(c.ns, "cg", {"t": "*"}, **FAST_CONSUMER) as consumer:
        await await_until(lambda: consumer.routes.followers("g") == [f.addr], 10, "the follower in the routes")
        assert {mq.addr for mq in consumer.assignment()} == {lead.addr}  # queues name the leader


async def test_a_consumer_reading_from_followers_reads_what_the_leader_has_and_commits_to_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, lead, f = await ready_group(nursery, tmp_path, 4, 400)
    async with open_consumer(
        c.ns, "cg", {"t": "*"}, read_from_followers=True, pull_batch=16, **FAST_CONSUMER
    ) as consumer:
        got = await consume(consumer, 400)
        assert f.rpc.connections >= 1  # its pulls went to the follower (heartbeats and commits do not)
        assert all(consumer.reads.target(mq) == f.addr for mq in consumer.assignment())
    want = stored(lead, "t", 4)
    assert sorted(map(identity, got)) == sorted(identity(r) for rs in want.values() for r in rs)  # each once
    for q in range(4):  # in order per queue
        assert [r.queue_offset for r in got if r.queue_id == q] == list(range(len(want[q])))
    ends = {q: lead.store.max_offset("t", q) for q in range(4)}
    assert {q: lead.offsets.query("cg", "t", q) for q in range(4)} == ends  # committed to the leader
    await await_until(
        lambda: {q: f.offsets.query("cg", "t", q) for q in range(4)} == ends,
        10,
        "the committed offsets replicated to the follower",
    )


async def test_a_consumer_not_asking_for_followers_reads_from_the_leader(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, _lead, f = await ready_group(nursery, tmp_path, 2, 50)
    async with open_consumer(c.ns, "cg", {"t": "*"}, **FAST_CONSUMER) as consumer:
        await consume(consumer, 50)
        assert f.rpc.connections == 0


async def test_a_consumer_falls_back_to_the_leader_when_its_follower_fails(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The follower stops while the name server still lists it: pulls to it fail, and
    the leader serves them."""
    c, _lead, f = await ready_group(nursery, tmp_path, 2, 100)
    await follower_routed(c, "t", f.addr)  # else the consumer starts on the leader alone
    async with open_consumer(
        c.ns, "cg", {"t": "*"}, read_from_followers=True, follower_failure_backoff_ms=60_000, **FAST_CONSUMER
    ) as consumer:
        first = await consume(consumer, 1)
        assert f.rpc.connections >= 1
        await c.stop_broker("g1")
        await produce(c, "t", 100, prefix=b"n")
        rest = await consume(consumer, 200 - len(first))
    got = first + rest
    assert len({(r.queue_id, r.queue_offset) for r in got}) == len(got) == 200  # each once
    assert sorted(r.body for r in got) == sorted([b"m%d" % i for i in range(100)] + [b"n%d" % i for i in range(100)])


async def test_a_follower_that_lacks_the_offset_sends_the_consumer_to_the_leader(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A follower that missed messages (stopped, then catching up slowly: throttled)
    does not hold the group's committed offset: the consumer reads from the leader
    there, never moving its offset back to the follower's end (no message twice)."""
    c, lead, f = await ready_group(
        nursery, tmp_path, 1, 10, replica_fetch_max_bytes=16 * 1024, replica_catchup_bytes_per_s=8 * 1024
    )
    await await_until(lambda: f.store.max_offset("t", 0) == 10, 10, "the follower holding the first 10")
    await c.stop_broker("g1")
    await produce(c, "t", 10, prefix=b"late", pad=8 * 1024)  # async acks: the leader alone holds these
    async with open_consumer(c.ns, "cg", {"t": "*"}, **FAST_CONSUMER) as first:
        await consume(first, 20)
    assert lead.offsets.query("cg", "t", 0) == 20
    back = await start_follower(c, lead)
    async with open_consumer(c.ns, "probe", {"t": "*"}, **FAST_CONSUMER) as probe:
        await await_until(lambda: probe.routes.followers("g") == [back.addr], 10, "only the new follower routed")
    assert back.store.log.write_offset < lead.store.log.write_offset  # still catching up (throttled)
    async with open_consumer(c.ns, "cg", {"t": "*"}, read_from_followers=True, **FAST_CONSUMER) as consumer:
        await produce(c, "t", 5, prefix=b"new")
        got = await consume(consumer, 5)
        assert back.rpc.connections >= 1  # it asked the follower first
    assert [r.body for r in got] == [b"new%d" % i for i in range(5)]
    assert [r.queue_offset for r in got] == list(range(20, 25))


async def test_the_leader_hints_a_lagging_reader_to_read_from_a_follower(nursery: trio.Nursery, tmp_path: Path) -> None:
    """suggest_follower: only from a leader with a follower in sync, only to a reader
    more than follower_read_lag_messages behind; PULL_MESSAGE and PULL_MESSAGES alike."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _ = await start_group(c, follower=False, follower_read_lag_messages=5)
    await c.create_topic("t", 1)
    await produce(c, "t", 20)
    # an acknowledged message is readable once dispatched to its queue (a moment later under load)
    await await_until(lambda: lead.store.max_offset("t", 0) == 20, 10, "the 20 messages dispatched")

    async def hints(rpc: RpcClient, offset: int) -> tuple[Any, Any]:
        one = await rpc.request(
            lead.addr, RequestCode.PULL_MESSAGE, {"topic": "t", "queue_id": 0, "offset": offset, "max_messages": 4}
        )
        many = await rpc.request(
            lead.addr, RequestCode.PULL_MESSAGES, {"queues": [FetchAsk.row("t", 0, offset, None)], "max_per_queue": 4}
        )
        assert one.fields["count"] == many.fields["count"] == min(4, 20 - offset)
        return one.fields.get("suggest_follower"), many.fields.get("suggest_follower")

    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        assert await hints(rpc, 0) == (None, None)  # no follower to read from
        await start_follower(c, lead)
        await in_sync(lead, 2)
        assert await hints(rpc, 0) == (True, True)  # 16 behind after the answer
        assert await hints(rpc, 11) == (None, None)  # 5 behind: not more than 5
        assert await hints(rpc, 10) == (True, True)
        await rpc.aclose()


async def test_a_hinted_consumer_reads_from_a_follower(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, _lead, f = await ready_group(nursery, tmp_path, 1, 300, follower_read_lag_messages=20)
    async with open_consumer(
        c.ns, "cg", {"t": "*"}, pull_batch=8, follower_read_hold_ms=60_000, **FAST_CONSUMER
    ) as consumer:
        got = await consume(consumer, 300)
        assert consumer.reads.reading_from_follower("g")
        assert f.rpc.connections >= 1
    assert [r.body for r in got] == [b"m%d" % i for i in range(300)]


async def test_a_group_without_a_leader_is_read_from_its_follower_and_takes_no_writes(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The leader stops: the name server routes the group to its follower, marked
    unhealthy ("no leader"). Consumers keep reading there; producers do not send there."""
    c, lead, f = await ready_group(nursery, tmp_path, 2, 60)
    end = lead.store.log.write_offset
    await await_until(lambda: f.store.log.confirmed_offset >= end, 10, "the follower confirmed to the leader's end")
    await c.stop_broker("g0")
    async with open_consumer(c.ns, "cg", {"t": "*"}, **FAST_CONSUMER) as consumer:
        await await_until(lambda: {mq.addr for mq in consumer.assignment()} == {f.addr}, 10, "queues on the follower")
        assert f.addr in consumer.routes.failures and "no leader" in consumer.routes.failures[f.addr]
        got = await consume(consumer, 60)
    assert sorted(r.body for r in got) == sorted(b"m%d" % i for i in range(60))
    async with open_producer(c.ns, retries=1) as p:
        with pytest.raises(SendError) as e:
            await p.send("t", b"nowhere to go")
    assert "no leader" in str(e.value) and e.value.code == ErrorCode.NOT_LEADER
    assert f.store.log.write_offset == end


async def test_a_follower_copies_a_groups_offsets_sent_as_one_row_per_group_and_topic(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """REPLICA_METADATA carries a group's offsets in a topic as one row of two integer
    lists (the offsets file's version 2), not a row per queue (65,536 rows built on
    the leader's event loop per follower request); the follower copies them all."""
    _c, lead, f = await ready_group(nursery, tmp_path, 256, 0)
    for q in range(0, 256, 3):
        lead.offsets.commit("cg", "t", q, q + 1)
    lead.offsets.commit("other", "t", 5, 9)
    lead.metadata.bump()
    snapshot = lead.metadata.snapshot()
    assert "offsets" not in snapshot
    rows = {(g, t): dict(zip(qs, os, strict=True)) for g, t, qs, os in snapshot["offset_lists"]}
    assert rows == {("cg", "t"): {q: q + 1 for q in range(0, 256, 3)}, ("other", "t"): {5: 9}}
    await await_until(lambda: f.offsets.all() == lead.offsets.all(), 15, "the follower holding the leader's offsets")


offsets_by_group_and_topic = st.dictionaries(
    st.tuples(st.sampled_from(["cg", "other"]), st.sampled_from(["t", "u"])),
    st.dictionaries(st.integers(0, 65_535), st.integers(-1, 2**40), min_size=1),
)


@given(offsets_by_group_and_topic)
def test_a_follower_reads_the_same_offsets_from_lists_and_from_an_older_leaders_rows(
    committed: dict[tuple[str, str], dict[int, int]],
) -> None:
    """``offset_lists`` (a row per group and topic) and an older leader's ``offsets`` (a
    row per queue) give a follower the same (group, topic, queue, offset)s."""
    lists = [[g, t, list(qs), list(qs.values())] for (g, t), qs in committed.items()]
    rows = [[g, t, q, o] for (g, t), qs in committed.items() for q, o in qs.items()]
    want = sorted((g, t, q, o) for (g, t), qs in committed.items() for q, o in qs.items())
    assert sorted(offset_rows({"offset_lists": lists})) == want
    assert sorted(offset_rows({"offsets": rows})) == want
