"""Replication with real brokers in this process: real sockets, real files.

(Killed and paused processes are in tests/test_replication_procs.py.)"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.broker.service import Broker
from clmq.common import Message
from clmq.protocol import ErrorCode, Frame, FrameDecoder, RequestCode, encode_batch, encode_frame
from clmq.protocol.transport import ConnectionFailed, RpcClient, split_addr
from tests.service_helpers import Cluster
from tests.waiting import await_until

FAST = {"replica_metadata_interval_ms": 50, "replica_fetch_wait_ms": 200, "replica_retry_ms": 100}


def log_digest(broker: Broker, end: int) -> str:
    """sha256 of the broker's log bytes [min, end), read from its segment files."""
    h = hashlib.sha256()
    for base, _size, path in broker.store.log.segments():
        if base >= end:
            break
        data = Path(path).read_bytes()
        h.update(data[: end - base])
    return h.hexdigest()


async def start_group(
    c: Cluster, followers: int, common: dict[str, Any] | None = None, **leader: Any
) -> tuple[Broker, list[Broker]]:
    """A leader (id 0, ``leader`` settings) and followers (ids 1..), all with ``common``."""
    common = {**FAST, **(common or {})}
    lead = await c.start_broker("g", key="g0", broker_id=0, **{**common, **leader})
    fs = [
        await c.start_broker("g", key=f"g{i}", broker_id=i, role="follower", leader_addr=lead.addr, **common)
        for i in range(1, followers + 1)
    ]
    return lead, fs


async def in_sync(lead: Broker, count: int) -> None:
    async def ready() -> bool:
        return lead.replica.leader is not None and lead.replica.leader.isr.size() == count + 1

    await await_until(ready, 15, f"{count} followers in sync")


async def caught_up(lead: Broker, followers: list[Broker]) -> int:
    end = lead.store.log.write_offset

    async def done() -> bool:
        return all(f.store.log.write_offset == end for f in followers)

    await await_until(done, 20, f"followers at the leader's end {end}")
    return end


async def send_raw(rpc: RpcClient, addr: str, topic: str, msgs: list[Message]) -> Any:
    return await rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": topic}, encode_batch(msgs), check=False)


@pytest.mark.parametrize("ack_mode", ["async", "sync"])
async def test_follower_logs_are_byte_identical_after_mixed_traffic_over_thousands_of_queues(
    nursery: trio.Nursery, tmp_path: Path, ack_mode: str
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, fs = await start_group(
        c,
        2,
        {"segment_bytes": 256 * 1024, "max_message_bytes": 64 * 1024},
        ack_mode=ack_mode,
        min_insync_replicas=3 if ack_mode == "sync" else 1,
    )
    topics = {"a": 1000, "b": 700, "c": 300}
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        for t, q in topics.items():
            await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": t, "queue_count": q})
        await in_sync(lead, 2)
        rnd = random.Random(15)
        for _ in range(60):
            t = rnd.choice(list(topics))
            msgs = [
                Message(t, rnd.randrange(topics[t]), rnd.randbytes(rnd.choice([1, 100, 1000, 8000])))
                for _ in range(rnd.randrange(1, 80))
            ]
            reply = await send_raw(rpc, lead.addr, t, msgs)
            assert reply.error_code == 0, reply.error_text
        await rpc.aclose()
    end = await caught_up(lead, fs)
    lead.store.dispatcher.catch_up()  # the leader's queues too: compared below (failed once under load)
    assert len(lead.store.log.segments()) > 3  # the stream crossed segment ends (blank markers)
    rows = lead.replica.status()["replicas"]
    assert [(r["broker_id"], r["addr"]) for r in rows] == [(f.config.broker_id, f.addr) for f in fs]
    for f in fs:
        assert log_digest(f, end) == log_digest(lead, end)
        await await_until(lambda f=f: f.store.topics.all() == topics, 10, "topics copied")
        await await_until(lambda f=f: f.store.log.confirmed_offset == end, 10, "the follower's confirmed offset")
        f.store.dispatcher.catch_up()
        for t, q in topics.items():
            for qid in range(0, q, 97):
                assert f.store.max_offset(t, qid) == lead.store.max_offset(t, qid)


async def test_sync_writes_are_refused_below_min_insync_replicas_and_nothing_is_written(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _ = await start_group(c, 0, ack_mode="sync", min_insync_replicas=2, replication_timeout_ms=500)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 1})
        with trio.fail_after(2):  # refused at once, not after a timeout
            reply = await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"x")])
        assert reply.error_code == ErrorCode.NOT_ENOUGH_REPLICAS, reply
        assert "min_insync_replicas=2" in reply.error_text
        assert lead.store.log.write_offset == 0 and lead.store.max_offset("t", 0) == 0
        await rpc.aclose()


async def test_a_follower_refuses_writes_and_names_its_leader(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, (f,) = await start_group(c, 1)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 1})
        await await_until(lambda: f.store.topics.all() == {"t": 1}, 10, "the topic copied")
        for code, fields, body in (
            (RequestCode.SEND_MESSAGE, {"topic": "t"}, encode_batch([Message("t", 0, b"x")])),
            (RequestCode.CREATE_TOPIC, {"topic": "u", "queue_count": 1}, b""),
            (RequestCode.COMMIT_OFFSET, {"group": "g", "offsets": [["t", 0, 0]]}, b""),
        ):
            reply = await rpc.request(f.addr, code, fields, body, check=False)
            assert reply.error_code == ErrorCode.NOT_LEADER, reply
        assert f.store.log.write_offset == 0 and "u" not in f.store.topics.all()
        await rpc.aclose()


async def test_consumers_see_only_what_the_in_sync_replicas_hold(nursery: trio.Nursery, tmp_path: Path) -> None:
    """While an in-sync follower is gone, new messages stay invisible on the leader
    until the follower leaves the in-sync set (replica_lag_max_ms)."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _ = await start_group(c, 1, replica_lag_max_ms=1500)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 1})
        await in_sync(lead, 1)
        await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"seen")])
        await await_until(lambda: lead.store.max_offset("t", 0) == 1, 10, "the first message confirmed")
        await c.stop_broker("g1")
        assert lead.replica.leader is not None and lead.replica.leader.isr.size() == 2  # not yet noticed
        await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"held back")])
        assert lead.store.max_offset("t", 0) == 1  # held back: only the leader has it
        await await_until(lambda: lead.replica.leader.isr.size() == 1, 10, "the follower out of the in-sync set")
        await await_until(lambda: lead.store.max_offset("t", 0) == 2, 10, "the message visible")
        await rpc.aclose()


class RawConn:
    """One connection driven frame by frame, to see the server close it."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.decoder, self.ids = stream, FrameDecoder(), itertools.count(1)

    @classmethod
    async def open(cls, addr: str) -> RawConn:
        host, port = split_addr(addr)
        return cls(await trio.open_tcp_stream(host, port))

    async def request(self, code: int, fields: dict[str, Any], body: bytes = b"") -> Frame:
        await self.stream.send_all(encode_frame(Frame(code, next(self.ids), fields, body)))
        with trio.fail_after(10):
            while True:
                event = self.decoder.next_event()
                if isinstance(event, Frame):
                    return event
                data = await self.stream.receive_some(1 << 16)
                if not data:
                    raise ConnectionFailed("closed by the server")
                self.decoder.receive_data(data)

    async def closed_by_server(self) -> bool:
        with trio.fail_after(10):
            try:
                return await self.stream.receive_some(1) == b""
            except trio.BrokenResourceError:
                return True


async def _join(conn: RawConn, **overrides: Any) -> Frame:
    fields = {"broker_name": "g", "broker_id": 9, "epoch": -1, "end_offset": 0, "segment_bytes": 4 << 20, **overrides}
    return await conn.request(RequestCode.REPLICA_JOIN, fields)


@pytest.mark.parametrize(
    "who", [{"broker_name": "other"}, {"broker_id": 0}, {"segment_bytes": 1 << 20}, {"broker_id": 5, "allowed": [1, 2]}]
)
async def test_replication_from_an_unknown_broker_is_refused(nursery: trio.Nursery, tmp_path: Path, who: dict) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _ = await start_group(c, 0, replica_ids=who.pop("allowed", []))
    conn = await RawConn.open(lead.addr)
    reply = await _join(conn, **who)
    assert reply.error_code == ErrorCode.REPLICA_REFUSED, reply
    assert await conn.closed_by_server()
    assert lead.replica.leader is not None and not lead.replica.leader.isr.followers


LIES = {
    "offset past the leader's end": {"offset": 10**9},
    "offset behind its last report": {"offset": 0},
    "flushed past its offset": {"flushed": 10**9},
    "unknown session": {"session": 1},
    "topics version the leader never had": {"topics_version": 10**6},
}


@pytest.mark.parametrize("lie", sorted(LIES))
async def test_a_lying_follower_report_is_refused_and_its_connection_dropped(
    nursery: trio.Nursery, tmp_path: Path, lie: str
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _ = await start_group(c, 0)
    conn = await RawConn.open(lead.addr)
    await conn.request(RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 1})
    await conn.request(RequestCode.SEND_MESSAGE, {"topic": "t"}, encode_batch([Message("t", 0, b"x" * 100)]))
    joined = (await _join(conn)).fields
    honest = {
        "broker_id": 9,
        "session": joined["session"],
        "epoch": joined["epoch"],
        "offset": 0,
        "flushed": 0,
        "max_bytes": 1 << 20,
        "max_wait_ms": 0,
    }
    first = await conn.request(RequestCode.REPLICA_FETCH, honest)
    assert first.error_code == 0 and first.fields["length"] > 0
    honest["offset"] = first.fields["length"] // 2  # a report in the middle of a record: not checked per record
    assert (await conn.request(RequestCode.REPLICA_FETCH, honest)).error_code == 0
    reply = await conn.request(RequestCode.REPLICA_FETCH, {**honest, **LIES[lie]})
    assert reply.error_code == ErrorCode.REPLICA_REFUSED, reply
    assert await conn.closed_by_server()
    assert lead.replica.leader is not None
    if lie == "unknown session":  # an impostor's request: the real session is left alone
        assert lead.replica.leader.isr.followers[9].acked == honest["offset"]
    else:
        assert 9 not in lead.replica.leader.isr.followers


async def test_a_fetch_of_another_epoch_is_told_to_join_again(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _ = await start_group(c, 0)
    conn = await RawConn.open(lead.addr)
    joined = (await _join(conn)).fields
    fetch = {
        "broker_id": 9,
        "session": joined["session"],
        "epoch": joined["epoch"] + 1,
        "offset": 0,
        "flushed": 0,
        "max_bytes": 1024,
        "max_wait_ms": 0,
    }
    reply = await conn.request(RequestCode.REPLICA_FETCH, fetch)
    assert reply.error_code == ErrorCode.STALE_EPOCH


async def test_topics_offsets_and_subscriptions_reach_the_followers(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, (f,) = await start_group(c, 1)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        for t in ("keep", "drop"):
            await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": t, "queue_count": 3})
        await send_raw(rpc, lead.addr, "keep", [Message("keep", 1, b"m%d" % i) for i in range(5)])
        await rpc.request(lead.addr, RequestCode.COMMIT_OFFSET, {"group": "grp", "offsets": [["keep", 1, 4]]})
        await rpc.request(
            lead.addr,
            RequestCode.HEARTBEAT,
            {"client_id": "c1", "groups": [{"group": "grp", "topics": ["keep"], "mode": "clustering"}]},
        )
        await rpc.request(lead.addr, RequestCode.DELETE_TOPIC, {"topic": "drop"})

        def copied() -> bool:
            return (
                f.store.topics.all() == {"keep": 3}
                and f.offsets.query("grp", "keep", 1) == 4
                and f.metadata.subscriptions.get("grp") == ("clustering", ["keep"])
            )

        await await_until(copied, 10, "topics, offsets and subscriptions on the follower")
        await rpc.aclose()


async def test_a_promoted_follower_leads_and_the_old_leader_cuts_its_divergent_tail(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, (f,) = await start_group(c, 1)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 2})
        await send_raw(rpc, lead.addr, "t", [Message("t", q, b"both%d" % q) for q in (0, 1)])
        shared = await caught_up(lead, [f])
        await rpc.request(lead.addr, RequestCode.COMMIT_OFFSET, {"group": "grp", "offsets": [["t", 0, 1]]})
        await await_until(lambda: f.offsets.query("grp", "t", 0) == 1, 10, "the offset copied")
        await c.stop_broker("g1")  # the follower misses what comes next
        await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"only on the old leader") for _ in range(3)])
        old_end = lead.store.log.write_offset
        assert old_end > shared
        await c.stop_broker("g0")
        f = await c.start_broker("g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **FAST)
        promoted = await rpc.request(f.addr, RequestCode.PROMOTE, {"force": True})
        assert promoted.fields["role"] == "leader" and promoted.fields["epoch"] >= 1
        reply = await send_raw(rpc, f.addr, "t", [Message("t", 0, b"new leader %d" % i) for i in range(2)])
        assert reply.error_code == 0, reply
        assert f.offsets.query("grp", "t", 0) == 1  # the group goes on from where it was
        # The old leader comes back (its role file says leader): the name server names the
        # newer leader, so it steps down, cuts its tail and copies the new leader's log.
        old = await c.start_broker("g", key="g0", broker_id=0, **FAST)
        await await_until(lambda: old.replica.role == "follower", 10, "the old leader stepping down")
        end = await caught_up(f, [old])
        assert log_digest(old, end) == log_digest(f, end)
        old.store.dispatcher.catch_up()
        await await_until(lambda: old.store.max_offset("t", 0) == 3, 10, "the old leader's queue rebuilt")
        got = old.store.get("t", 0, 0, 10)
        assert [m.body for m in got.messages] == [b"both0", b"new leader 0", b"new leader 1"]
        await rpc.aclose()


async def test_retention_on_followers_follows_the_leader_and_a_new_follower_copies_from_its_log_start(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    small = {"segment_bytes": 128 * 1024, "max_message_bytes": 32 * 1024}
    lead, (f,) = await start_group(c, 1, small)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 2})
        for i in range(40):
            await send_raw(rpc, lead.addr, "t", [Message("t", i % 2, b"%d" % i + b"." * 8000)])
        await caught_up(lead, [f])
        bases = [base for base, _, _ in lead.store.log.segments()]
        assert len(bases) >= 3
        # The leader's retention removes its oldest segments (as retention_ms would).
        assert lead.store.log.delete_before(bases[2]) == 2
        await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"after retention")])
        await await_until(lambda: f.store.log.min_offset == bases[2], 10, "the follower's retention")
        # A new, empty follower copies from the leader's first segment, not from 0.
        new = await c.start_broker(
            "g", key="g5", broker_id=5, role="follower", leader_addr=lead.addr, **{**FAST, **small}
        )
        end = await caught_up(lead, [f, new])
        assert new.store.log.min_offset == bases[2]
        assert log_digest(new, end) == log_digest(lead, end)
        await await_until(lambda: new.store.max_offset("t", 0) == lead.store.max_offset("t", 0), 10, "queues built")
        await await_until(lambda: new.store.topics.all() == {"t": 2}, 10, "the topic copied")
        lo, hi = new.store.bounds("t", 0)
        assert (lo, hi) == lead.store.bounds("t", 0) and lo > 0
        got = new.store.get("t", 0, hi - 1, 1)
        assert [m.body for m in got.messages] == [b"after retention"], (got, lead.store.get("t", 0, hi - 1, 1))
        await rpc.aclose()


async def test_a_follower_in_sync_when_its_leader_died_is_promoted_without_force(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, (f, other) = await start_group(c, 2, ack_mode="sync", min_insync_replicas=2)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 1})
        await in_sync(lead, 2)
        assert (await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"acked")])).error_code == 0
        await await_until(lambda: f.replica.follower is not None and f.replica.follower.in_sync, 10, "in sync")
        await c.stop_broker("g0")
        await await_until(lambda: not f.replica.follower.in_sync, 10, "the follower noticing")  # type: ignore[union-attr]
        promoted = await rpc.request(f.addr, RequestCode.PROMOTE, {})
        assert promoted.fields["role"] == "leader"
        await await_until(
            lambda: other.replica.follower is not None and other.replica.follower.leader_addr == f.addr,
            15,
            "the other follower following the new leader",
        )
        await await_until(
            lambda: [m.body for m in f.store.get("t", 0, 0, 10).messages] == [b"acked"],
            10,
            "the acknowledged message readable on the new leader",
        )
        await rpc.aclose()


async def test_an_idle_follower_parked_longer_than_the_lag_limit_stays_in_sync(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``replica_fetch_wait_ms`` above ``replica_lag_max_ms``: a fetch parked at the
    leader's end holds everything the leader has, so an idle follower must not leave
    the in-sync set while it waits. (It did, every ``replica_lag_max_ms``, and joined
    again at once: a warning each time, and in ZooKeeper mode two writes there.)"""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _ = await start_group(c, 1, {"replica_fetch_wait_ms": 1500, "replica_lag_max_ms": 400})
    await in_sync(lead, 1)
    leader = lead.replica.leader
    assert leader is not None
    first = leader.isr.followers[1].last_fetch_ms
    caplog.set_level(logging.INFO, logger="clmq.replication")

    def two_parked_fetches_later() -> bool:
        f = leader.isr.followers.get(1)
        return f is not None and f.last_fetch_ms - first >= 2 * 1500 - 100

    await await_until(two_parked_fetches_later, 15, "two parked fetches")
    left = [r.getMessage() for r in caplog.records if "left the in-sync set" in r.getMessage()]
    assert not left, left
    assert leader.isr.followers[1].in_sync


async def test_sync_acks_of_a_leader_alone_in_sync_answer_at_once(nursery: trio.Nursery, tmp_path: Path) -> None:
    """min_insync_replicas = 1 and no follower (none configured, or none in sync): the
    leader alone holds the write, so the ack does not wait for anybody."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, _ = await start_group(c, 0, ack_mode="sync", replication_timeout_ms=3000)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 1})
        with trio.fail_after(1):
            for i in range(3):
                reply = await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"%d" % i)])
                assert reply.error_code == 0, reply
        await rpc.aclose()


async def test_a_burst_never_throttles_an_in_sync_follower(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The catch-up throttle is for followers out of the in-sync set (Kafka's KIP-73): a
    burst bigger than one chunk must not slow a follower that sync acks wait for."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    slow = {"replica_catchup_bytes_per_s": 64 * 1024, "replica_fetch_max_bytes": 64 * 1024}
    lead, _ = await start_group(c, 1, slow, ack_mode="sync", min_insync_replicas=2, replication_timeout_ms=10_000)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 1})
        await in_sync(lead, 1)
        burst = [Message("t", 0, b"x" * 8000) for _ in range(64)]  # 512 KiB: 8 s at the throttle's rate
        with trio.fail_after(4):
            reply = await send_raw(rpc, lead.addr, "t", burst)
        assert reply.error_code == 0, reply
        await rpc.aclose()
