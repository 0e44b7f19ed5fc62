"""Clients across a change of a group's leader, with real brokers in this process (real
sockets, real files): producers keep sending through a manual promotion and through the
leader being stopped, with no error seen and every acknowledged message stored exactly
once (counted by its UNIQ_KEY) and in order per queue; consumers' commits follow the
leader; a client given two name servers keeps working when one is down."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.broker.service import Broker
from clmq.client import (
    NoRouteError,
    Producer,
    Routes,
    RpcClient,
    SendError,
    open_admin,
    open_consumer,
    open_producer,
    shard,
)
from clmq.common import Message, Record
from clmq.nameserver import NameServer, NameServerConfig
from clmq.nameserver import serve as serve_nameserver
from clmq.protocol import ErrorCode, RequestCode
from tests.replica_procs import create_topic as procs_create_topic
from tests.replica_procs import open_group, read_queue
from tests.service_helpers import FAST_CONSUMER, Cluster, follower_routed
from tests.waiting import await_until

UNIQ_KEY = "UNIQ_KEY"
FAST = {"replica_metadata_interval_ms": 100, "replica_fetch_wait_ms": 100, "replica_retry_ms": 100}
QUEUES = 4


async def start_group(c: Cluster, **settings: Any) -> tuple[Broker, Broker]:
    """Group "g": leader g0 (id 0) and follower g1 (id 1), both with ``settings``."""
    lead = await c.start_broker("g", key="g0", broker_id=0, **{**FAST, **settings})
    f = await c.start_broker("g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **{**FAST, **settings})
    await c.create_topic("t", QUEUES)
    await await_until(lambda: lead.replica.leader is not None and lead.replica.leader.isr.size() == 2, 15, "in sync")
    await await_until(lambda: f.store.topics.queue_count("t") == QUEUES, 10, "the topic on the follower")
    return lead, f


class Sender:
    """``QUEUES`` tasks, one per queue (a sharding key each), sending numbered messages
    one after another; every acknowledged message's UNIQ_KEY and number is kept."""

    def __init__(self, producer: Producer) -> None:
        self.p = producer
        self.acked: dict[int, list[tuple[int, str]]] = {q: [] for q in range(QUEUES)}
        self.errors: list[BaseException] = []
        self.duplicates = 0

    def count(self) -> int:
        return sum(len(v) for v in self.acked.values())

    async def run(self, per_queue: int) -> None:
        async with trio.open_nursery() as n:
            for key in range(QUEUES):
                n.start_soon(self._queue, key, per_queue)

    async def _queue(self, key: int, per_queue: int) -> None:
        sharding_key = next(k for j in range(1000) if shard(k := f"key-{j}", QUEUES) == key)  # one task per queue
        for seq in range(per_queue):
            msg = Message("t", 0, b"%d:%d" % (key, seq))
            try:
                result = await self.p.send_batch("t", [msg], sharding_key=sharding_key)
            except Exception as e:  # the test asserts there are none
                self.errors.append(e)
                return
            self.duplicates += result.duplicate
            assert result.queue.queue_id == key, "a message's queue changed"
            assert result.uniq_keys == (msg.properties[UNIQ_KEY],)
            self.acked[key].append((seq, result.uniq_keys[0]))


async def check_stored(broker: Broker, sender: Sender) -> None:
    # The queues show an acknowledged record once the dispatcher (a thread) has caught up
    # with the whole log; on a follower, only up to the confirmed offset its leader last
    # told it (a fetch answer or the leader's next in-sync check), so wait for that too.
    log = broker.store.log
    await await_until(
        lambda: log.confirmed_offset == log.write_offset and broker.store.dispatch_lag_bytes == 0,
        10,
        "the dispatcher to catch up with the whole log",
    )
    check_records({q: broker.store.get("t", q, 0, 100_000).messages for q in range(QUEUES)}, sender)


def check_records(queues: dict[int, list[Record]], sender: Sender) -> None:
    """Every acknowledged message once (by UNIQ_KEY), in the order sent, in its queue."""
    for q, records in queues.items():
        keys = [r.properties.get(UNIQ_KEY) for r in records]
        counts = Counter(keys)
        acked = [k for _seq, k in sender.acked[q]]
        assert all(counts[k] == 1 for k in acked), f"queue {q}: {[(k, counts[k]) for k in acked if counts[k] != 1]}"
        stored_order = [k for k in keys if k in set(acked)]
        assert stored_order == acked, f"queue {q}: acknowledged messages out of order"
        seqs = [int(r.body.split(b":")[1]) for r in records]
        assert seqs == sorted(seqs), f"queue {q}: stored out of order: {seqs}"


async def test_a_producer_sends_through_a_manual_promotion_without_errors_or_duplicates(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Sync acks with two replicas required: after the promotion the new leader refuses
    writes (NOT_ENOUGH_REPLICAS) until the old one has stepped down and caught up as
    its follower; the old leader answers NOT_LEADER meanwhile. No error reaches the
    producer, nothing acknowledged is lost or stored twice, and no queue changes."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, f = await start_group(c, ack_mode="sync", min_insync_replicas=2, replica_lag_max_ms=5000)
    async with open_producer(c.ns, retry_budget_ms=20_000, send_timeout_ms=2000) as p:
        sender = Sender(p)
        async with trio.open_nursery() as n:
            n.start_soon(sender.run, 60)
            await await_until(lambda: sender.count() >= 40 or sender.errors, 20, "40 messages acknowledged")
            async with open_admin(c.ns) as admin:
                assert await admin.promote(f.addr) >= 1
    assert not sender.errors, sender.errors
    assert sender.count() == QUEUES * 60
    await await_until(lambda: lead.replica.role == "follower", 10, "the old leader to step down")
    await check_stored(f, sender)
    await await_until(lambda: lead.store.log.write_offset == f.store.log.write_offset, 15, "the old leader to catch up")
    await check_stored(lead, sender)


async def test_a_producer_carries_on_when_the_leader_stops_until_a_follower_is_promoted(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The leader stops in the middle of the sends: the producer's tries fail (the
    connection, then a group without a leader) and are retried on the same queues
    within the budget, marked dedup; once the follower is promoted they go there.
    (replica_lag_max_ms above the leader's shutdown_timeout_ms: a stopping leader
    refuses its follower's fetches, and would otherwise acknowledge alone what it holds
    once the follower left the in-sync set: see the requests file.)"""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    settings = {"replica_lag_max_ms": 10_000, "replication_timeout_ms": 1000, "shutdown_timeout_ms": 3000}
    _lead, f = await start_group(c, ack_mode="sync", min_insync_replicas=1, **settings)
    async with open_producer(c.ns, retry_budget_ms=20_000, send_timeout_ms=2000) as p:
        sender = Sender(p)
        async with trio.open_nursery() as n:
            n.start_soon(sender.run, 50)
            await await_until(lambda: sender.count() >= 40 or sender.errors, 20, "40 messages acknowledged")
            await c.stop_broker("g0")
            acked_before = sender.count()
            async with open_admin(c.ns) as admin:
                await admin.promote(f.addr)
    assert not sender.errors, sender.errors
    assert sender.count() == QUEUES * 50 and acked_before < QUEUES * 50
    await check_stored(f, sender)


async def test_a_producer_carries_on_when_the_leader_process_is_killed(tmp_path: Path) -> None:
    """Real processes: the leader is SIGKILLed mid-send (connections break with requests
    in flight: outcomes unknown), the follower is promoted; the producer's retries go
    to it marked dedup. No error, every acknowledged message once, in order."""
    settings = {"ack_mode": "sync", "min_insync_replicas": 1, "replica_lag_max_ms": 10_000}
    async with open_group(tmp_path) as g:
        await g.start_broker("g0", 0, **settings)
        await g.start_broker("g1", 1, follow="g0", **settings)
        await procs_create_topic(g, "g0", "t", QUEUES)
        await g.wait_in_sync("g0", ["g1"])
        async with open_producer([g.ns_addr], retry_budget_ms=30_000, send_timeout_ms=2000) as p:
            await await_until(lambda: routed(p.routes), 10, "the topic routed")
            sender = Sender(p)
            async with trio.open_nursery() as n:
                n.start_soon(sender.run, 50)
                await await_until(lambda: sender.count() >= 60 or sender.errors, 30, "60 messages acknowledged")
                await g["g0"].kill()
                reply = await g.call("g1", RequestCode.PROMOTE, {})
                assert not reply.error_code, reply.error_text
        assert not sender.errors, sender.errors
        assert sender.count() == QUEUES * 50
        check_records({q: await read_queue(g, "g1", "t", q) for q in range(QUEUES)}, sender)


async def routed(routes: Routes) -> bool:
    try:
        return len(await routes.queues("t", refresh=True)) == QUEUES
    except NoRouteError:
        return False


@pytest.mark.parametrize("old_leader", ["demoted", "stopped"])
async def test_a_consumers_commits_follow_the_group_to_its_new_leader(
    nursery: trio.Nursery, tmp_path: Path, old_leader: str
) -> None:
    """The consumer's queues move to the new leader (no message received twice or
    missed) and its commits go there, whether the old leader stepped down (it answers
    NOT_LEADER) or stopped (connections refused)."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, f = await start_group(c, replica_lag_max_ms=5000)
    async with open_producer(c.ns) as p:
        for i in range(40):
            await p.send("t", b"before %d" % i, sharding_key=str(i))
        received: list[Record] = []
        async with open_consumer(c.ns, "cg", {"t": "*"}, **FAST_CONSUMER) as consumer:
            with trio.fail_after(20):
                while len(received) < 40:
                    received += await consumer.receive()
                consumer.ack()
                await consumer.commit()
            ends = {q: lead.store.max_offset("t", q) for q in range(QUEUES)}
            assert {q: lead.offsets.query("cg", "t", q) for q in range(QUEUES)} == ends
            if old_leader == "stopped":
                await c.stop_broker("g0")
            async with open_admin(c.ns) as admin:
                await admin.promote(f.addr)
            if old_leader == "demoted":
                await await_until(lambda: lead.replica.role == "follower", 10, "the old leader to step down")
            for i in range(40):
                await p.send("t", b"after %d" % i, sharding_key=str(i))
            with trio.fail_after(20):
                while len(received) < 80:
                    received += await consumer.receive()
                consumer.ack()
            # the routes refresh on their own schedule: the queues move once it has come
            await await_until(
                lambda: {mq.addr for mq in consumer.assignment()} == {f.addr},
                10,
                "the consumer's queues to move to the new leader",
            )

            async def committed_on_new_leader() -> bool:
                await consumer.commit()
                return all(f.offsets.query("cg", "t", q) == f.store.max_offset("t", q) for q in range(QUEUES))

            await await_until(committed_on_new_leader, 15, "the commits on the new leader")
    bodies = Counter(r.body for r in received)
    assert len(bodies) == 80 and set(bodies.values()) == {1}, "each message received once"


async def test_a_send_gives_up_after_its_budget_and_at_once_for_an_error_not_worth_a_retry(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, f = await start_group(c, replica_lag_max_ms=5000)
    rpc = RpcClient(nursery)
    refused = await rpc.request(f.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, b"", check=False)
    assert refused.error_code == ErrorCode.NOT_LEADER and refused.fields["leader_addr"] == lead.addr
    await rpc.aclose()
    await follower_routed(c, "t", f.addr)  # stopped, the leader leaves the follower alone in the route
    async with open_producer(c.ns, retry_budget_ms=800, retry_backoff_ms=20) as p:
        started = trio.current_time()
        with pytest.raises(SendError) as too_big:
            await p.send("t", b"x" * 300_000)
        assert too_big.value.code == ErrorCode.MESSAGE_TOO_LARGE and trio.current_time() - started < 0.5
        await c.stop_broker("g0")  # the group has no leader and nobody promotes one
        started = trio.current_time()
        with pytest.raises(SendError) as gave_up:
            await p.send("t", b"nowhere", sharding_key="k")
        took = trio.current_time() - started
    assert 0.8 <= took < 5, took
    assert gave_up.value.code == ErrorCode.NOT_LEADER and "no leader" in str(gave_up.value)


async def test_a_send_whose_answer_timed_out_is_acknowledged_once_with_the_first_tries_offsets(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Sync acks, the follower stopped but still counted in sync: the first try is
    stored and waits for the follower; its answer times out at the producer. The retry
    (dedup) waits until the leader's queues show the write (once the follower has left
    the in-sync set) and is answered with the first try's offsets: stored once."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _f = await start_group(
        c, ack_mode="sync", min_insync_replicas=1, replica_lag_max_ms=3000, replication_timeout_ms=20_000
    )
    async with open_producer(c.ns, send_timeout_ms=300) as p:
        await p.send("t", b"warm up", sharding_key="k")  # routes and connection ready: the next try is quick
        await c.stop_broker("g1")
        result = await p.send("t", b"once", sharding_key="k")
    assert result.duplicate, "the retry was not recognised as the stored first try"
    stored = lead.store.get("t", result.queue.queue_id, 0, 100).messages
    assert [r.body for r in stored] == [b"warm up", b"once"]
    assert stored[1].queue_offset == result.queue_offset and stored[1].properties[UNIQ_KEY] == result.uniq_keys[0]


async def start_second_nameserver(nursery: trio.Nursery) -> tuple[NameServer, trio.Event]:
    stopped = trio.Event()

    async def run(task_status: trio.TaskStatus[NameServer] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await serve_nameserver(
                NameServerConfig(listen_port=0, broker_expiry_ms=1500, scan_interval_ms=100), task_status=task_status
            )
        finally:
            stopped.set()

    ns: NameServer = await nursery.start(run)
    return ns, stopped


async def test_clients_given_two_name_servers_keep_working_when_one_is_down(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    first = await c.start_nameserver()
    second, second_stopped = await start_second_nameserver(nursery)
    both = [first.addr, second.addr]
    await c.start_broker(namesrv_addrs=both)
    await c.create_topic("t", 2)
    await c.wait_routed("t", {"broker-a"}, ns=[second.addr])
    async with open_producer(both) as p, open_consumer(both, "cg", {"t": "*"}, **FAST_CONSUMER) as consumer:
        await p.send("t", b"both up")
        first.shutdown()  # the one every client asks first
        sent = [await p.send("t", b"one down %d" % i) for i in range(10)]
        assert len(sent) == 10
        routes: Routes = p.routes
        await routes.queues("t", refresh=True)
        assert first.addr in routes._ns_down  # noted down: asked again only later
        async with open_producer(both) as fresh:  # a new client: its first look-up finds the first one down
            await fresh.send("t", b"from a new producer")
        got: set[bytes] = set()
        with trio.fail_after(20):
            while len(got) < 12:
                got |= {r.body for r in await consumer.receive()}
        assert got == {b"both up", b"from a new producer"} | {b"one down %d" % i for i in range(10)}
    second.shutdown()
    with trio.fail_after(10):
        await second_stopped.wait()


async def test_a_producer_given_broker_addrs_retries_while_its_broker_restarts(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Without name servers, a broker that does not answer the route look-up is
    unreachable, not a topic that does not exist: the send retries within its budget
    and succeeds once the broker is back (it used to fail at once, "no broker has
    topic")."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker("solo")
    await c.create_topic("t", 2)
    port = int(broker.addr.rsplit(":", 1)[1])
    await c.stop_broker("solo")
    async with open_producer(broker_addrs=[broker.addr], retry_budget_ms=20_000) as p, trio.open_nursery() as n:
        n.start_soon(c.start_broker, "solo", port)  # back on the same port and data
        with trio.fail_after(25):
            result = await p.send("t", b"after the restart")
    assert result.queue_offsets == [0]
