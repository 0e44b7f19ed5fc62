"""Orderly consumption on real brokers: the queue lock table (LOCK_QUEUES,
UNLOCK_QUEUES), members that never process a queue at the same time while the group
rebalances, and in-place retries ending in the dead letters."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from clmq.broker.service._context import now_ms
from clmq.client import BlockingConsumer, Consumer, ConsumeStatus, Record, RpcClient, open_consumer
from clmq.client.consumer._redelivery import Round
from clmq.common import PROP_ORIGIN_TOPIC, Message, dlq_topic
from clmq.protocol import ErrorCode, RequestCode, encode_batch
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until

ORDERLY = {**FAST_CONSUMER, "orderly": True, "lock_retry_ms": 50, "lock_renew_interval_ms": 1000}


@pytest.fixture
async def rpc(nursery: trio.Nursery) -> Any:
    client = RpcClient(nursery)
    yield client
    await client.aclose()


async def _lock(
    rpc: RpcClient, addr: str, client_id: str, queues: list[int], group: str = "g", topic: str = "t"
) -> list[int]:
    reply = await rpc.request(
        addr, RequestCode.LOCK_QUEUES, {"group": group, "client_id": client_id, "queues": [[topic, q] for q in queues]}
    )
    assert all(t == topic for t, _ in reply.fields["locked"])
    return [q for _, q in reply.fields["locked"]]


async def _unlock(rpc: RpcClient, addr: str, client_id: str, queues: list[int], group: str = "g") -> None:
    await rpc.request(
        addr, RequestCode.UNLOCK_QUEUES, {"group": group, "client_id": client_id, "queues": [["t", q] for q in queues]}
    )


# ------------------------------------------------------------------ lock table
async def test_locks_are_granted_renewed_refused_to_others_and_released(
    nursery: trio.Nursery, tmp_path: Path, rpc: RpcClient
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    addr = (await c.start_broker()).addr
    await c.create_topic("t", 4)
    assert await _lock(rpc, addr, "c1", [0, 1]) == [0, 1]
    assert await _lock(rpc, addr, "c2", [1, 2, 99]) == [2]  # 1 is c1's; queue 99 does not exist
    assert await _lock(rpc, addr, "c2", [0, 1], group="other") == [0, 1]  # locks are per group
    assert await _lock(rpc, addr, "c1", [1, 0]) == [1, 0]  # a renewal, answered in request order
    await _unlock(rpc, addr, "c2", [0])  # not c2's: nothing happens
    assert await _lock(rpc, addr, "c2", [0]) == []
    await _unlock(rpc, addr, "c1", [1])
    assert await _lock(rpc, addr, "c2", [1]) == [1]
    assert await _lock(rpc, addr, "c1", [0, 1, 2, 3]) == [0, 3]
    reply = await rpc.request(addr, RequestCode.LOCK_QUEUES, {"group": "g", "client_id": "c1", "queues": [["t", 0]]})
    assert reply.fields["lease_ms"] == 30_000
    await rpc.request(addr, RequestCode.UNREGISTER_CLIENT, {"client_id": "c1"})  # c1 leaves: its locks go
    assert await _lock(rpc, addr, "c2", [0, 3]) == [0, 3]
    bad = await rpc.request(
        addr, RequestCode.LOCK_QUEUES, {"group": "g", "client_id": "c1", "queues": [["t"]]}, check=False
    )
    assert bad.error_code == ErrorCode.MALFORMED_REQUEST


async def test_a_lock_expires_after_its_lease(nursery: trio.Nursery, tmp_path: Path, rpc: RpcClient) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(lock_lease_ms=300)
    await c.create_topic("t", 1)
    t0 = trio.current_time()
    assert await _lock(rpc, broker.addr, "c1", [0]) == [0]
    assert await _lock(rpc, broker.addr, "c2", [0]) == []

    async def c2_got_it() -> bool:
        return await _lock(rpc, broker.addr, "c2", [0]) == [0]

    await await_until(c2_got_it, 5, "the lock of c1 to expire")
    assert trio.current_time() - t0 >= 0.3
    assert await _lock(rpc, broker.addr, "c1", [0]) == []
    assert len(broker.handlers.locks.table) == 1  # expired entries do not pile up


async def test_a_follower_refuses_locks_and_a_promoted_one_grants_none_for_a_lease(
    nursery: trio.Nursery, tmp_path: Path, rpc: RpcClient
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    fast = {
        "replica_metadata_interval_ms": 50,
        "replica_fetch_wait_ms": 200,
        "replica_retry_ms": 100,
        "lock_lease_ms": 700,
    }
    lead = await c.start_broker("g", key="g0", broker_id=0, **fast)
    f = await c.start_broker("g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **fast)
    await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 2})
    await await_until(lambda: f.store.topics.all().get("t") == 2, 10, "the topic copied")
    assert await _lock(rpc, lead.addr, "c1", [0]) == [0]  # a fresh store's first start: no grace
    for code in (RequestCode.LOCK_QUEUES, RequestCode.UNLOCK_QUEUES):
        reply = await rpc.request(f.addr, code, {"group": "g", "client_id": "c1", "queues": [["t", 0]]}, check=False)
        assert reply.error_code == ErrorCode.NOT_LEADER, reply
    await await_until(lambda: lead.replica.leader is not None and lead.replica.leader.isr.size() == 2, 15, "in sync")
    await c.stop_broker("g0")
    promoted_at = trio.current_time()
    await rpc.request(f.addr, RequestCode.PROMOTE, {"force": True})
    # c1's lock was on the old leader: the new one does not know it, so it grants
    # nothing until every lock granted before has expired.
    assert await _lock(rpc, f.addr, "c2", [0, 1]) == []

    async def granted() -> bool:
        return await _lock(rpc, f.addr, "c2", [0, 1]) == [0, 1]

    await await_until(granted, 5, "the new leader's grace to end")
    assert trio.current_time() - promoted_at >= 0.7


async def test_a_restarted_broker_grants_no_lock_for_a_lease(
    nursery: trio.Nursery, tmp_path: Path, rpc: RpcClient
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(lock_lease_ms=600)
    await c.create_topic("t", 1)
    assert await _lock(rpc, broker.addr, "c1", [0]) == [0]
    port = int(broker.addr.rsplit(":", 1)[1])
    await c.stop_broker("broker-a")
    broker = await c.start_broker(port=port, lock_lease_ms=600)
    started = trio.current_time()
    assert await _lock(rpc, broker.addr, "c2", [0]) == []

    async def granted() -> bool:
        return await _lock(rpc, broker.addr, "c2", [0]) == [0]

    await await_until(granted, 5, "the restarted broker's grace to end")
    assert trio.current_time() - started >= 0.5


# ------------------------------------------------------- members and rebalances
@dataclasses.dataclass
class Interval:
    member: str
    queue: int
    start: float
    end: float
    first: int
    last: int


async def _member(
    cluster: Cluster,
    name: str,
    log: list[Interval],
    members: dict[str, Consumer],
    stop: trio.Event,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    work_s: float = 0.002,
) -> None:
    """An orderly member that logs, per queue, each batch from receive() to its ack."""
    async with open_consumer(cluster.ns, "og", {"ord": "*"}, client_id=name, **ORDERLY) as c:
        members[name] = c
        task_status.started()
        held: list[tuple[float, list[Record]]] = []
        while True:
            if held:  # processed: the next receive() (or leaving) acknowledges it
                (start, records), end = held.pop(), trio.current_time()
                for q in sorted({r.queue_id for r in records}):
                    offsets = [r.queue_offset for r in records if r.queue_id == q]
                    log.append(Interval(name, q, start, end, offsets[0], offsets[-1]))
            if stop.is_set():
                break
            with trio.move_on_after(0.1):
                records = await c.receive()
                held.append((trio.current_time(), records))
            if held:
                await trio.sleep(work_s)  # processing: a window another member would have to overlap
        del members[name]


def _check(log: list[Interval], counts: dict[int, int]) -> None:
    """No two members process a queue at once; each queue's messages processed in
    order, every one of them, none twice."""
    for q, count in counts.items():
        runs = sorted((i for i in log if i.queue == q), key=lambda i: i.start)
        for a, b in itertools.pairwise(runs):
            assert a.end <= b.start, f"queue {q}: {a} overlaps {b}"
            assert b.first == a.last + 1, f"queue {q}: {b} does not follow {a}"
        assert runs[0].first == 0 and runs[-1].last == count - 1, (q, runs[0], runs[-1], count)


async def test_members_joining_and_leaving_never_process_a_queue_at_the_same_time(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(lock_lease_ms=5000)
    await c.create_topic("ord", 8)
    log: list[Interval] = []
    members: dict[str, Consumer] = {}
    stops = {name: trio.Event() for name in ("m0", "m1", "m2", "m3")}
    stop_producing, produced = trio.Event(), trio.Event()
    sent = [0]

    async def produce(rpc: RpcClient) -> None:
        while not stop_producing.is_set():
            batch = [Message("ord", q, b"%d" % sent[0]) for q in range(8)]
            await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "ord"}, encode_batch(batch))
            sent[0] += 1
            await trio.sleep(0.01)  # a steady trickle while members come and go
        produced.set()

    def holds(name: str) -> bool:
        return name in members and bool(members[name].assignment())

    def split_among(names: set[str]) -> bool:
        owned = [q.queue_id for n in names if n in members for q in members[n].assignment()]
        return set(members) == names and sorted(owned) == list(range(8))

    async def progressed() -> None:
        """Until every queue processed what was sent so far (the phase did some work)."""
        mark = sent[0]
        await await_until(
            lambda: all(any(i.queue == q and i.last >= mark - 1 for i in log) for q in range(8)),
            15,
            f"every queue processed up to {mark}",
        )

    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        for name in ("m0", "m1"):
            await n.start(_member, c, name, log, members, stops[name])
        n.start_soon(produce, rpc)
        await await_until(lambda: split_among({"m0", "m1"}), 10, "m0 and m1 to hold every queue")
        await progressed()
        await n.start(_member, c, "m2", log, members, stops["m2"])
        await await_until(lambda: holds("m2") and split_among({"m0", "m1", "m2"}), 15, "m2 to get its share")
        await progressed()
        stops["m0"].set()
        await await_until(lambda: split_among({"m1", "m2"}), 15, "m1 and m2 to take m0's queues")
        await progressed()
        await n.start(_member, c, "m3", log, members, stops["m3"])
        await await_until(lambda: holds("m3") and split_among({"m1", "m2", "m3"}), 15, "m3 to get its share")
        await progressed()
        stops["m1"].set()
        await await_until(lambda: split_among({"m2", "m3"}), 15, "m2 and m3 to take m1's queues")
        stop_producing.set()
        await produced.wait()
        await progressed()
        stops["m2"].set()
        stops["m3"].set()
        await rpc.aclose()
    assert {i.member for i in log} == {"m0", "m1", "m2", "m3"}
    handed_over = {q for q in range(8) if len({i.member for i in log if i.queue == q}) > 1}
    assert len(handed_over) >= 4, handed_over  # the rebalances moved queues between members
    _check(log, dict.fromkeys(range(8), sent[0]))


async def test_a_batch_processed_longer_than_a_lease_keeps_its_queue_from_the_next_owner(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The member losing a queue to a rebalance keeps renewing its lock until its slow
    batch is acknowledged: the next owner gets the queue only then."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(lock_lease_ms=900)
    await c.create_topic("ord", 8)
    per_queue = 5
    await _send_all(broker.addr, per_queue)
    log: list[Interval] = []
    members: dict[str, Consumer] = {}
    stops = {"slow": trio.Event(), "quick": trio.Event()}
    async with trio.open_nursery() as n:
        n.start_soon(functools.partial(_member, c, "slow", log, members, stops["slow"], work_s=2.5))
        await await_until(lambda: "slow" in members and len(members["slow"].assignment()) == 8, 10, "slow to hold all")
        await await_until(lambda: any(i.member == "slow" for i in log) or _busy(members["slow"]), 10, "slow at work")
        await n.start(_member, c, "quick", log, members, stops["quick"])
        await await_until(lambda: "quick" in members and bool(members["quick"].assignment()), 20, "quick to get queues")
        await _send_all(broker.addr, per_queue, start=per_queue)
        await await_until(
            lambda: all(any(i.queue == q and i.last == 2 * per_queue - 1 for i in log) for q in range(8)),
            20,
            "every queue processed",
        )
        stops["slow"].set()
        stops["quick"].set()
    assert {i.member for i in log} == {"slow", "quick"}
    _check(log, dict.fromkeys(range(8), 2 * per_queue))


def _busy(consumer: Consumer) -> bool:
    return bool(list(consumer.pending))


async def _send_all(addr: str, per_queue: int, start: int = 0) -> None:
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        batch = [Message("ord", q, b"%d" % i) for i in range(start, start + per_queue) for q in range(8)]
        await rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": "ord"}, encode_batch(batch))
        await rpc.aclose()


# -------------------------------------------------------------- in-place retry
async def _send(addr: str, topic: str, bodies: list[bytes]) -> None:
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(
            addr, RequestCode.SEND_MESSAGE, {"topic": topic}, encode_batch([Message(topic, 0, b) for b in bodies])
        )
        await rpc.aclose()


async def test_a_failed_message_is_retried_in_place_with_its_queue_waiting_behind_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker()
    await c.create_topic("io", 1)
    await _send(broker.addr, "io", [b"m%d" % i for i in range(5)])
    seen: list[tuple[bytes, int, float]] = []

    def handler(r: Record) -> ConsumeStatus:
        seen.append((r.body, r.reconsume_times, trio.current_time()))
        if r.body == b"m1" and r.reconsume_times < 2:
            return ConsumeStatus.RECONSUME_LATER
        return ConsumeStatus.SUCCESS

    async with open_consumer(c.ns, "ig", {"io": "*"}, **{**ORDERLY, "orderly_retry_delay_ms": 200}) as consumer:
        assert await consumer.run(handler, max_messages=7) == 7
        await consumer.commit()
        assert consumer.filters.keys() == {"io"}  # an orderly consumer does not read the retry topic
    assert [(body, times) for body, times, _ in seen] == [
        (b"m0", 0),
        (b"m1", 0),
        (b"m1", 1),
        (b"m1", 2),
        (b"m2", 0),
        (b"m3", 0),
        (b"m4", 0),
    ]
    assert seen[2][2] - seen[1][2] >= 0.2 and seen[3][2] - seen[2][2] >= 0.2  # after orderly_retry_delay_ms
    assert broker.offsets.query("ig", "io", 0) == 5


async def test_a_message_that_always_fails_ends_in_the_dead_letters_and_its_queue_goes_on(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker()
    await c.create_topic("io", 1)
    await _send(broker.addr, "io", [b"m%d" % i for i in range(4)])
    seen: list[tuple[bytes, int]] = []

    async def handler(r: Record) -> None:
        seen.append((r.body, r.reconsume_times))
        if r.body == b"m1":
            raise RuntimeError("cannot handle m1")  # an exception: RECONSUME_LATER

    options = {**ORDERLY, "orderly_retry_delay_ms": 50, "max_reconsume_times": 2}
    async with open_consumer(c.ns, "dg", {"io": "*"}, **options) as consumer:
        assert await consumer.run(handler, max_messages=6) == 6
        await consumer.commit()
    assert seen == [(b"m0", 0), (b"m1", 0), (b"m1", 1), (b"m1", 2), (b"m2", 0), (b"m3", 0)]
    assert broker.offsets.query("dg", "io", 0) == 4

    def dead_letters() -> list[Record]:
        return (
            broker.store.get(dlq_topic("dg"), 0, 0, 10).messages
            if broker.store.queue_exists(dlq_topic("dg"), 0)
            else []
        )

    dead = await await_until(dead_letters, 5, "the dead letter")  # appended; dispatched a moment later
    assert [m.body for m in dead] == [b"m1"]
    assert dead[0].properties[PROP_ORIGIN_TOPIC] == "io"


def test_a_round_never_acknowledges_past_the_records_of_a_queue_whose_lock_lapsed() -> None:
    """The lease of q0 ends after its first record: its other records are not handed to
    the handler, and are left (read again from the first), not acknowledged past."""
    q0, q1 = [object() for _ in range(3)], [object() for _ in range(2)]
    records = cast(list[Record], [q0[0], q1[0], q0[1], q1[1], q0[2]])
    keys = {**{id(r): "q0" for r in q0}, **{id(r): "q1" for r in q1}}
    handled: list[object] = []
    rnd = Round(records, keys, orderly=True, limit=None, still_held=lambda mq: mq == "q1" or not handled)
    for r in rnd.todo():
        handled.append(r)
        rnd.done(r, True)
    assert handled == [q0[0], q1[0], q1[1]]
    assert rnd.left() == [q0[1], q0[2]]


async def test_a_blocking_orderly_consumer_runs_its_handler_in_its_own_thread(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """BlockingConsumer.run with orderly=True: the handler runs in the caller's thread,
    which checks each queue's lock before every record (without trio's clock there)."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker()
    await c.create_topic("io", 1)
    await _send(c.brokers["broker-a"].addr, "io", [b"m%d" % i for i in range(4)])
    seen: list[tuple[bytes, int]] = []

    def handler(r: Record) -> ConsumeStatus:
        seen.append((r.body, r.reconsume_times))
        return ConsumeStatus.RECONSUME_LATER if r.body == b"m1" and r.reconsume_times < 1 else ConsumeStatus.SUCCESS

    def consume() -> int:
        with BlockingConsumer(c.ns, "bg", {"io": "*"}, **{**ORDERLY, "orderly_retry_delay_ms": 50}) as consumer:
            return consumer.run(handler, max_messages=5)

    assert await trio.to_thread.run_sync(consume) == 5
    assert seen == [(b"m0", 0), (b"m1", 0), (b"m1", 1), (b"m2", 0), (b"m3", 0)]


async def test_an_orderly_consumer_needs_clustering_mode(nursery: trio.Nursery, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="orderly=True needs mode='clustering'"):
        async with open_consumer(
            None, "g", {"t": "*"}, broker_addrs=["127.0.0.1:1"], orderly=True, mode="broadcasting"
        ):
            pass


async def test_a_member_renews_its_locks_stops_a_queue_whose_lease_lapsed_and_locks_it_again(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(lock_lease_ms=600)
    await c.create_topic("rn", 1)
    await _send(broker.addr, "rn", [b"before"])
    async with open_consumer(
        c.ns, "rg", {"rn": "*"}, **ORDERLY, pull_wait_ms=300
    ) as consumer:  # renews every 1 s at most
        assert [r.body for r in await consumer.receive()] == [b"before"]
        (mq,) = consumer.assignment()
        state = consumer.assigned[mq]
        table = broker.handlers.locks.table
        first = table._locks[("rg", "rn", 0)][1]
        # The lease is 600 ms: the member renews every 200 ms (a third of it).
        await await_until(lambda: table._locks[("rg", "rn", 0)][1] > first + 1200, 5, "the lock renewed a few times")
        assert consumer.assigned.get(mq) is state  # held all along
        consumer.ack()
        await consumer.commit()
        port = int(broker.addr.rsplit(":", 1)[1])
        await c.stop_broker("broker-a")  # renewals fail: the lease lapses by the member's clock
        await await_until(lambda: mq not in consumer.assigned, 5, "the member to stop the queue")
        broker = await c.start_broker(port=port, lock_lease_ms=600)  # it forgot every lock: grants none for a lease
        await _send(broker.addr, "rn", [b"after"])
        with trio.fail_after(10):
            assert [r.body for r in await consumer.receive()] == [b"after"]  # locked again, from the committed offset
        assert broker.handlers.locks.table.holder("rg", "rn", 0, now_ms()) == consumer.client_id
