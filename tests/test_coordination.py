"""Automatic failover through ZooKeeper, in one process: brokers with the ``zookeeper``
setting elect their group's leader, record the in-sync set there, hand over
gracefully, and stop acknowledging when their ZooKeeper lease lapses. A real
ZooKeeper server (``tests/zk.py``); the brokers are real services on 127.0.0.1.
Real broker processes killed and paused: ``test_failover_procs.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from kazoo.client import KazooClient

from clmq.broker.coordination import CoordinationError, GroupState, split_connect
from clmq.broker.service import Broker
from clmq.client import open_admin, open_producer
from clmq.devtools.zkserver import LocalZooKeeper
from tests.service_helpers import Cluster
from tests.waiting import await_until

GROUP = "g"
FAST = {
    "ack_mode": "sync",
    "min_insync_replicas": 2,
    "replica_lag_max_ms": 1000,
    "replica_retry_ms": 100,
    "replica_fetch_wait_ms": 200,
    "replica_metadata_interval_ms": 100,
    "zk_session_timeout_ms": 2000,
}


def leaders(cluster: Cluster) -> list[Broker]:
    return [b for b in cluster.brokers.values() if b.replica.leader is not None]


async def one_leader(cluster: Cluster, timeout_s: float = 15, other_than: Broker | None = None) -> Broker:
    def found() -> Broker | None:
        ls = [b for b in leaders(cluster) if b is not other_than]
        return ls[0] if len(ls) == 1 and len(leaders(cluster)) == 1 else None

    return await await_until(found, timeout_s, "exactly one leader in the group")


async def start_group(cluster: Cluster, zk: str, n: int = 3, **settings: Any) -> list[Broker]:
    return [
        await cluster.start_broker(GROUP, key=f"g{i}", broker_id=i, zookeeper=zk, **{**FAST, **settings})
        for i in range(n)
    ]


async def group_in_sync(cluster: Cluster, zk: str) -> tuple[list[Broker], Broker]:
    """Three replicas, topic "t" of 4 queues, every replica in ZooKeeper's in-sync set."""
    bs = await start_group(cluster, zk)
    leader = await one_leader(cluster)
    await cluster.create_topic("t", 4)
    await await_until(lambda: len(zk_state(zk)["isr"]) == 3, 15, "every replica in sync")
    return bs, leader


async def stays_false(predicate: Callable[[], bool], seconds: float) -> None:
    """Assert that ``predicate`` stays false for ``seconds``: an absence (nothing may
    elect a replica) can only be watched for a while."""
    with trio.move_on_after(seconds):
        await await_until(predicate, 2 * seconds, "an event that must not happen")  # cancelled first
        raise AssertionError("it happened")


def zk_state(connect: str) -> dict[str, Any]:
    """The group's state node as JSON (read with a client of the test's own)."""
    hosts, chroot = split_connect(connect)
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=10)
    try:
        data, _ = zk.get(f"{chroot}/clmq/groups/{GROUP}/state")
        return dict(json.loads(data))
    finally:
        zk.stop()
        zk.close()


async def send_until_ok(producer: Any, body: bytes, timeout_s: float = 20) -> None:
    async def sent() -> bool:
        try:
            await producer.send("t", body)
            return True
        except Exception:
            return False

    await await_until(sent, timeout_s, f"a send of {body!r} acknowledged")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with trio.open_nursery() as nursery:
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        yield c
        nursery.cancel_scope.cancel()


async def holds(broker: Broker, acked: list[bytes], timeout_s: float = 10) -> None:
    """Every acknowledged body is readable on ``broker`` (its dispatcher may still be
    indexing the log's last records when the test looks)."""
    await await_until(
        lambda: set(acked) <= set(body_set(broker)),
        timeout_s,
        f"every acknowledged message on broker {broker.config.broker_id}",
    )


def body_set(broker: Broker, queues: int = 4) -> list[bytes]:
    out = []
    for q in range(queues):
        got = broker.store.get("t", q, 0, 100_000)
        out += [m.body for m in got.messages]
    return out


async def test_a_group_elects_one_leader_and_records_its_in_sync_set(cluster: Cluster, zk_connect: str) -> None:
    bs = await start_group(cluster, zk_connect)
    leader = await one_leader(cluster)
    await cluster.create_topic("t", 4)
    await await_until(lambda: sorted(zk_state(zk_connect)["isr"]) == [0, 1, 2], 15, "every replica in ZooKeeper's set")
    state = zk_state(zk_connect)
    assert state["leader"] == leader.config.broker_id and state["epoch"] == leader.replica.epoch
    async with open_admin(cluster.ns) as admin:
        for b in bs:
            c = (await admin.replica_status(b.addr))["coordination"]
            assert c["mode"] == "zookeeper" and c["session"] == "CONNECTED" and c["leader"] == leader.config.broker_id
            assert (c["lease_ms_left"] > 0) == (b is leader)


async def test_a_stopped_leader_is_replaced_by_an_in_sync_follower_with_a_higher_epoch(
    cluster: Cluster, zk_connect: str
) -> None:
    _, old = await group_in_sync(cluster, zk_connect)
    acked = []
    async with open_producer(cluster.ns, retries=10) as p:
        for i in range(50):
            await p.send("t", b"m%d" % i)
            acked.append(b"m%d" % i)
        old_epoch = old.replica.epoch
        await cluster.stop_broker(f"g{old.config.broker_id}")  # graceful: its session ends at once
        new = await one_leader(cluster, timeout_s=5)
        assert new.replica.epoch > old_epoch
        await send_until_ok(p, b"after")
    await holds(new, acked)
    state = zk_state(zk_connect)
    assert state["leader"] == new.config.broker_id and old.config.broker_id not in state["isr"]


async def test_a_leader_without_zookeeper_stops_acknowledging_then_recovers(
    cluster: Cluster, zk_restartable: LocalZooKeeper
) -> None:
    """ZooKeeper paused: within the lease (3/4 of the session timeout) the leader
    refuses writes (NOT_LEADER, nothing acknowledged); ZooKeeper back: writes resume."""
    await start_group(cluster, zk_restartable.connect_string("/lease"))
    leader = await one_leader(cluster)
    await cluster.create_topic("t", 4)
    async with open_producer(cluster.ns, retries=0) as p:
        await send_until_ok(p, b"before")
        zk_restartable.pause()
        try:
            await await_until(
                lambda: leader.replica.coordinator and leader.replica.coordinator.may_ack(),
                3,
                "the leader's lease to lapse",
            )
            with pytest.raises(Exception) as refused:
                await p.send("t", b"refused")
            assert "NOT_LEADER" in str(refused.value) or "no healthy" in str(refused.value)
        finally:
            zk_restartable.resume()
        await send_until_ok(p, b"after", timeout_s=20)
    await one_leader(cluster)


@pytest.mark.parametrize("down_s", [0.5, 1.2, 4.0])
async def test_zookeeper_restarted_writes_resume_with_one_leader(
    cluster: Cluster, zk_restartable: LocalZooKeeper, down_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    """ZooKeeper stopped (SIGTERM) and started again on the same port, down for less
    and for more than the session timeout: writes resume, one leader, every
    acknowledged write on it; the leader keeps its term unless a session expired."""
    await start_group(cluster, zk_restartable.connect_string("/restart"))
    first = await one_leader(cluster)
    epoch = first.replica.epoch
    await cluster.create_topic("t", 4)
    acked = []
    async with open_producer(cluster.ns, retries=10) as p:
        await send_until_ok(p, b"before")
        acked.append(b"before")
        zk_restartable.stop()
        await trio.sleep(down_s)  # the fault's length is the test's subject, not a wait for an event
        zk_restartable.start()
        await send_until_ok(p, b"after", timeout_s=30)
        acked.append(b"after")
    leader = await one_leader(cluster, timeout_s=15)
    await holds(leader, acked)
    if (leader, leader.replica.epoch) != (first, epoch):  # only if the outage outlived a session
        assert "ZooKeeper session LOST" in caplog.text, "the leader changed while every session survived"


async def test_in_sync_set_shrinks_in_zookeeper_and_only_in_sync_replicas_are_elected(
    cluster: Cluster, zk_connect: str
) -> None:
    bs, leader = await group_in_sync(cluster, zk_connect)
    lagger = next(b for b in bs if b is not leader)
    lagger_key, lagger_id = f"g{lagger.config.broker_id}", lagger.config.broker_id
    await cluster.stop_broker(lagger_key)
    await await_until(lambda: lagger_id not in zk_state(zk_connect)["isr"], 10, "the stopped follower out of the set")
    async with open_producer(cluster.ns, retries=10) as p:
        await send_until_ok(p, b"only two hold this")
    # The stopped follower comes back while the other two are gone: it is not in sync,
    # so it must not lead (unclean election off by default).
    for b in [b for b in bs if b is not lagger]:
        await cluster.stop_broker(f"g{b.config.broker_id}")
    back = await cluster.start_broker(GROUP, key=lagger_key, broker_id=lagger_id, zookeeper=zk_connect, **FAST)
    await await_until(
        lambda: back.replica.coordinator is not None and back.replica.coordinator.state is not None,
        10,
        "the returning follower to read the state",
    )
    await stays_false(lambda: back.replica.leader is not None, 3)  # the session timeout and more
    assert zk_state(zk_connect)["leader"] != lagger_id


async def test_unclean_election_elects_an_out_of_sync_replica_when_allowed(cluster: Cluster, zk_connect: str) -> None:
    bs = await start_group(cluster, zk_connect, n=2, min_insync_replicas=1)
    leader = await one_leader(cluster)
    other = next(b for b in bs if b is not leader)
    await cluster.create_topic("t", 4)
    await cluster.stop_broker(f"g{other.config.broker_id}")
    await await_until(
        lambda: other.config.broker_id not in zk_state(zk_connect)["isr"], 10, "the follower out of the set"
    )
    await cluster.stop_broker(f"g{leader.config.broker_id}")
    back = await cluster.start_broker(
        GROUP,
        key=f"g{other.config.broker_id}",
        broker_id=other.config.broker_id,
        zookeeper=zk_connect,
        unclean_leader_election=True,
        **{**FAST, "min_insync_replicas": 1},
    )
    await await_until(lambda: back.replica.leader is not None, 10, "the unclean election")
    assert zk_state(zk_connect)["isr"] == [other.config.broker_id]


async def test_graceful_hand_over_while_producing_loses_nothing_and_shows_no_error(
    cluster: Cluster, zk_connect: str
) -> None:
    bs, old = await group_in_sync(cluster, zk_connect)
    target = next(b for b in bs if b is not old)
    acked: list[bytes] = []
    errors: list[BaseException] = []
    async with open_producer(cluster.ns, retries=20) as p, open_admin(cluster.ns) as admin:
        await send_until_ok(p, b"first")

        async def produce(stop: trio.Event) -> None:
            i = 0
            while not stop.is_set():
                try:
                    await p.send("t", b"h%d" % i)
                    acked.append(b"h%d" % i)
                except Exception as e:
                    errors.append(e)
                i += 1

        async with trio.open_nursery() as n:
            stop = trio.Event()
            n.start_soon(produce, stop)
            await await_until(lambda: len(acked) >= 20, 10, "writes before the hand-over")
            epoch = await admin.promote(target.addr)
            count = len(acked)
            await await_until(lambda: len(acked) >= count + 20, 10, "writes after the hand-over")
            stop.set()
    assert errors == []
    assert epoch == old.replica.epochs.latest and target.replica.leader is not None and old.replica.leader is None
    await holds(target, acked)


async def test_a_damaged_state_node_is_reported_not_crashed_on(
    cluster: Cluster, zk_connect: str, caplog: pytest.LogCaptureFixture
) -> None:
    hosts, chroot = split_connect(zk_connect)
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=10)
    zk.create(f"{chroot}/clmq/groups/{GROUP}/state", b'{"leader": "zero"}', makepath=True)
    try:
        (b,) = await start_group(cluster, zk_connect, n=1, min_insync_replicas=1)
        await await_until(lambda: "not a group state" in caplog.text, 10, "the damaged node reported")
        assert b.replica.leader is None
        zk.set(f"{chroot}/clmq/groups/{GROUP}/state", GroupState(-1, 3, (0,)).encode())
        await await_until(lambda: b.replica.leader is not None, 10, "an election once the node is readable")
        assert b.replica.epoch == 4
    finally:
        zk.stop()
        zk.close()


# ----------------------------------------------------------------------- units
@given(st.binary(max_size=60) | st.text(max_size=60).map(str.encode))
def test_group_state_decode_accepts_only_valid_states(data: bytes) -> None:
    try:
        s = GroupState.decode(data, "/p")
    except CoordinationError as e:
        assert "/p" in str(e)
    else:
        assert s.leader == -1 or s.leader in s.isr


@pytest.mark.parametrize("state", [GroupState(-1, -1, ()), GroupState(2, 7, (0, 2)), GroupState(0, 0, (0,))])
def test_group_state_round_trips(state: GroupState) -> None:
    assert GroupState.decode(state.encode(), "/p") == state


@pytest.mark.parametrize(
    ("connect", "expected"),
    [
        ("127.0.0.1:2181", ("127.0.0.1:2181", "")),
        ("a:1,b:2/x/y/", ("a:1,b:2", "/x/y")),
        ("h:1/", ("h:1", "")),
    ],
)
def test_split_connect(connect: str, expected: tuple[str, str]) -> None:
    assert split_connect(connect) == expected


@pytest.mark.parametrize("connect", ["", "/chroot", "host", "h:x", "h:1,,h:2"])
def test_split_connect_refuses_malformed_strings(connect: str) -> None:
    with pytest.raises(ValueError, match="zookeeper must be"):
        split_connect(connect)


def test_settings_refuse_zookeeper_with_the_partition_store() -> None:
    from clmq.broker.service import BrokerConfig

    with pytest.raises(ValueError, match="needs storage_mode = commitlog"):
        BrokerConfig(zookeeper="127.0.0.1:2181", storage_mode="partition-per-file")
    with pytest.raises(ValueError, match="zk_session_timeout_ms"):
        BrokerConfig(zookeeper="127.0.0.1:2181", zk_session_timeout_ms=10)
    with pytest.raises(ValueError, match="zookeeper must be"):
        BrokerConfig(zookeeper="zk-without-port/chroot")


def test_the_name_server_routes_to_the_newest_claim_not_a_dead_leaders_entry() -> None:
    """A leader killed stays registered (as it last said: leader) until its entry
    expires; a follower elected with a newer epoch must get the route at once, whatever
    the addresses' order (found by clmq bench failover: 7 s pauses when the dead
    leader's address sorted first)."""
    from clmq.nameserver import RouteTable

    for dead, new in (("h:1", "h:2"), ("h:2", "h:1")):
        table = RouteTable(expiry_ms=60_000)
        table.register("c", "g", dead, {"t": 4}, now_ms=0, broker_id=0, role="leader", epoch=0)
        table.register("c", "g", "h:3", {"t": 4}, now_ms=0, broker_id=1, role="follower", epoch=0)
        table.register("c", "g", new, {"t": 4}, now_ms=10, broker_id=2, role="leader", epoch=1)
        (route,) = table.route("t")
        assert route["addr"] == new and route["epoch"] == 1 and route["leader"] is True
        assert {f["addr"] for f in route["followers"]} == {dead, "h:3"}
        roles = {b["addr"]: b["role"] for b in table.cluster(now_ms=20)}
        assert roles == {dead: "follower", "h:3": "follower", new: "leader"}
