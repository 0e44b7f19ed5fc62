"""End to end through real sockets: name server, brokers and the Python clients."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from pathlib import Path

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.service._fetch import ReadThreads
from clmq.client import (
    BlockingConsumer,
    BlockingProducer,
    RpcClient,
    SendError,
    open_admin,
    open_consumer,
    open_producer,
)
from clmq.client.consumer._requests import Requests
from clmq.commitlog import fileops
from clmq.common import Record
from clmq.protocol import ErrorCode, Frame, RequestCode, encode_frame
from tests.service_helpers import FAST_CONSUMER, Cluster, cluster_in_thread, one_broker
from tests.waiting import await_until


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    return await one_broker(nursery, tmp_path)


async def consume(
    ns: list[str], group: str, topic: str, want: int, expr: str = "*", timeout_s: float = 10, **opts
) -> list:
    got: list = []
    async with open_consumer(ns, group, {topic: expr}, **{**FAST_CONSUMER, **opts}) as c:
        with trio.move_on_after(timeout_s):
            while len(got) < want:
                got += await c.receive()
    return got


async def send_direct(addr: str, topic: str, bodies: dict[int, list[bytes]]) -> None:
    """Send each queue's bodies to one broker as one raw SEND_MESSAGE (no producer)."""
    from clmq.common import Message
    from clmq.protocol import encode_batch

    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        for q, queue_bodies in bodies.items():
            await rpc.request(
                addr,
                RequestCode.SEND_MESSAGE,
                {"topic": topic},
                encode_batch([Message(topic, q, b) for b in queue_bodies]),
            )
        await rpc.aclose()


async def test_messages_of_one_key_arrive_in_order(cluster: Cluster) -> None:
    await cluster.create_topic("orders", 4)
    async with open_producer(cluster.ns) as p:
        results = [
            await p.send("orders", b"%d" % i, sharding_key="user-7", tags="T", keys=f"k{i}", properties={"i": str(i)})
            for i in range(100)
        ]
        batch = await p.send_batch("orders", [b"b%d" % i for i in range(50)], sharding_key="user-7")
    assert len({r.queue.queue_id for r in results}) == 1 and batch.queue == results[0].queue
    assert [r.queue_offset for r in results] == list(range(100))
    assert batch.queue_offsets == list(range(100, 150))
    got = await consume(cluster.ns, "g", "orders", 150)
    assert [r.body for r in got] == [b"%d" % i for i in range(100)] + [b"b%d" % i for i in range(50)]
    assert got[3].keys == "k3" and got[3].tags == "T"
    assert got[3].properties == {"i": "3", "UNIQ_KEY": results[3].uniq_keys[0]}  # the producer's id of the message


async def test_clear_errors_for_unknown_topics_and_oversized_messages(cluster: Cluster) -> None:
    await cluster.create_topic("t", 1)
    async with open_producer(cluster.ns) as p:
        with pytest.raises(SendError) as too_big:
            await p.send("t", b"x" * 300_000)
        assert too_big.value.code == ErrorCode.MESSAGE_TOO_LARGE
        with pytest.raises(Exception, match="no broker serves topic 'nope'"):
            await p.send("nope", b"x")
        assert (await p.send("t", b"still fine")).queue_offset == 0


async def test_long_poll_is_woken_by_new_messages(cluster: Cluster) -> None:
    await cluster.create_topic("lp", 1)
    broker = cluster.brokers["broker-a"]
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)

        async def produce_later() -> None:
            await await_until(lambda: broker.waiters.waiting >= 1, 10, "the pull to wait on the broker")
            # Not a wait: the message comes 0.3 s into the long poll, and the pull must
            # answer after it (not at once, not at the end of its 10 s wait).
            await trio.sleep(0.3)
            async with open_producer(cluster.ns) as p:
                await p.send("lp", b"wake up")

        n.start_soon(produce_later)
        t0 = trio.current_time()
        reply = await rpc.request(
            broker.addr,
            RequestCode.PULL_MESSAGE,
            {"topic": "lp", "queue_id": 0, "offset": 0, "max_wait_ms": 10_000},
            timeout_ms=15_000,
        )
        waited = trio.current_time() - t0
        assert reply.fields["status"] == "FOUND" and reply.fields["count"] == 1
        assert 0.25 < waited < 3, waited  # woken by the dispatcher, long before the 10 s wait ran out
        await rpc.aclose()


async def test_tag_filtering(cluster: Cluster) -> None:
    await cluster.create_topic("tags", 2)
    async with open_producer(cluster.ns) as p:
        for i in range(60):
            await p.send("tags", b"%d" % i, tags=["TagA", "TagB", "TagC"][i % 3])
    got = await consume(cluster.ns, "g", "tags", 40, expr="TagA || TagB")
    assert len(got) == 40 and {r.tags for r in got} == {"TagA", "TagB"}
    assert sorted(int(r.body) for r in got) == [i for i in range(60) if i % 3 != 2]


async def test_broadcasting_gives_every_member_every_message(cluster: Cluster) -> None:
    await cluster.create_topic("bc", 3)
    async with open_producer(cluster.ns) as p:
        for i in range(30):
            await p.send("bc", b"%d" % i)
    results: list[list] = []

    async def member() -> None:
        results.append(await consume(cluster.ns, "bcast", "bc", 30, mode="broadcasting", timeout_s=5))

    async with trio.open_nursery() as n:
        n.start_soon(member)
        n.start_soon(member)
    assert [sorted(int(r.body) for r in got) for got in results] == [list(range(30))] * 2


async def test_rebalance_splits_queues_without_overlap_as_members_come_and_go(cluster: Cluster) -> None:
    await cluster.create_topic("rb", 8)
    all_queues = set(range(8))
    async with trio.open_nursery() as n:
        consumers = []
        stops = []
        gone = []
        for i in range(3):
            ready, stop, left = trio.Event(), trio.Event(), trio.Event()

            async def run(
                i: int = i, ready: trio.Event = ready, stop: trio.Event = stop, left: trio.Event = left
            ) -> None:
                async with open_consumer(cluster.ns, "grp", {"rb": "*"}, client_id=f"c{i}", **FAST_CONSUMER) as c:
                    consumers.append(c)
                    ready.set()
                    await stop.wait()
                consumers.remove(c)
                left.set()

            n.start_soon(run)
            await ready.wait()
            stops.append(stop)
            gone.append(left)
        await _settled(consumers, all_queues)
        assert sorted(len(c.assignment()) for c in consumers) == [2, 3, 3]
        stops[0].set()  # one member leaves
        await gone[0].wait()  # closed: committed and unregistered from the broker
        await _settled(consumers, all_queues)
        assert len(consumers) == 2 and sorted(len(c.assignment()) for c in consumers) == [4, 4]
        for s in stops[1:]:
            s.set()


async def _settled(consumers: list, all_queues: set[int]) -> None:
    """Wait until the members own every queue once, and still do a few rounds later."""

    def split() -> list[list[int]] | None:
        owned = [[mq.queue_id for mq in c.assignment()] for c in consumers]
        flat = [q for o in owned for q in o]
        return owned if len(flat) == len(set(flat)) and set(flat) == all_queues else None

    with trio.fail_after(10):
        while True:
            owned = await await_until(split, 10, "the members to split the queues without overlap")
            # Not a wait: the split must hold over a few more rebalance rounds (200 ms
            # apart), i.e. nothing may change in the next 0.5 s.
            await trio.sleep(0.5)
            again = [[mq.queue_id for mq in c.assignment()] for c in consumers]
            if again == owned:
                return


async def test_committed_offsets_survive_a_broker_restart(cluster: Cluster) -> None:
    await cluster.create_topic("off", 2)
    async with open_producer(cluster.ns) as p:
        for i in range(40):
            await p.send("off", b"%d" % i)
    first = await consume(cluster.ns, "keep", "off", 20, pull_batch=5)
    seen_first = {int(r.body) for r in first}
    port = int(cluster.brokers["broker-a"].addr.rsplit(":", 1)[1])
    await cluster.stop_broker("broker-a")
    await cluster.start_broker("broker-a", port=port)
    rest = await consume(cluster.ns, "keep", "off", 40 - len(seen_first), timeout_s=10)
    assert seen_first | {int(r.body) for r in rest} == set(range(40))
    async with open_admin(cluster.ns) as admin:
        info = await admin.describe_group("keep")
    assert info["lag"] == 0 and {q["committed"] for q in info["queues"]} == {20}


async def test_sync_flush_acknowledges_only_fsynced_messages(cluster: Cluster) -> None:
    await cluster.start_broker("broker-s", flush_mode="sync")
    async with open_admin(cluster.ns) as admin:
        await admin.create_topic("s", 2, on=[cluster.brokers["broker-s"].addr])
    await cluster.wait_routed("s", {"broker-s"})
    async with open_producer(cluster.ns) as p:
        r = await p.send("s", b"durable")
    assert r.durable and r.queue.broker_name == "broker-s"
    assert cluster.brokers["broker-s"].store.durable_offset >= r.commitlog_offsets[0]


async def test_producer_fails_over_to_another_broker(cluster: Cluster) -> None:
    await cluster.start_broker("broker-b")
    await cluster.create_topic("fo", 2)
    async with open_producer(cluster.ns, send_timeout_ms=1000) as p:
        first = [await p.send("fo", b"%d" % i) for i in range(8)]
        assert {r.queue.broker_name for r in first} == {"broker-a", "broker-b"}
        await cluster.stop_broker("broker-a")
        after = [await p.send("fo", b"after %d" % i) for i in range(10)]
    assert {r.queue.broker_name for r in after} == {"broker-b"}


def _raw_exchange(addr: str, data: bytes, expect_reply: bool) -> bytes:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        if not expect_reply:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
            if expect_reply and len(out) >= 8 and len(out) >= 4 + int.from_bytes(out[:4], "little"):
                return out


def _reply(raw: bytes) -> dict:
    hlen = int.from_bytes(raw[4:8], "little")
    return msgpack.unpackb(raw[8 : 8 + hlen])


async def test_malformed_truncated_and_oversized_frames(cluster: Cluster) -> None:
    await cluster.create_topic("bad", 1)
    addr = cluster.brokers["broker-a"].addr
    # Garbage: the broker closes that connection.
    assert await trio.to_thread.run_sync(_raw_exchange, addr, b"\xff" * 64, False) == b""
    # A frame cut short, then the client goes away: nothing is stored.
    frame = encode_frame(Frame(RequestCode.SEND_MESSAGE, 1, {"topic": "bad"}, b"\0" * 100))
    assert await trio.to_thread.run_sync(_raw_exchange, addr, frame[:-10], False) == b""
    # Oversized: an error naming the limit, on a connection that stays usable.
    big = Frame(RequestCode.SEND_MESSAGE, 9, {"topic": "bad"}, b"\0" * (65 << 20))
    header = msgpack.packb(big.header())
    prefix = struct.pack("<II", 4 + len(header) + len(big.body), len(header)) + header
    reply = _reply(await trio.to_thread.run_sync(_raw_exchange, addr, prefix + big.body, True))
    assert reply["i"] == 9 and reply["e"] == ErrorCode.FRAME_TOO_LARGE and "max_frame_bytes" in reply["m"]
    # Unknown code and missing fields: errors, not crashes.
    reply = _reply(await trio.to_thread.run_sync(_raw_exchange, addr, encode_frame(Frame(999, 3)), True))
    assert reply["e"] == ErrorCode.REQUEST_NOT_SUPPORTED
    reply = _reply(
        await trio.to_thread.run_sync(
            _raw_exchange, addr, encode_frame(Frame(RequestCode.SEND_MESSAGE, 4, {}, b"zz")), True
        )
    )
    assert reply["e"] == ErrorCode.MALFORMED_REQUEST
    reply = _reply(
        await trio.to_thread.run_sync(
            _raw_exchange, addr, encode_frame(Frame(RequestCode.SEND_MESSAGE, 5, {"topic": "bad"}, b"\1\2\3")), True
        )
    )
    assert reply["e"] == ErrorCode.MALFORMED_REQUEST and "batch" in reply["m"]
    async with open_producer(cluster.ns) as p:  # others are served; nothing was stored by the bad frames
        assert (await p.send("bad", b"good")).queue_offset == 0


def test_blocking_clients(tmp_path: Path) -> None:
    """Plain synchronous Python: the facades run trio in a thread of their own."""
    with cluster_in_thread(tmp_path) as c:
        with BlockingProducer(c.ns) as p:
            sent = [p.send("sync", b"m%d" % i, tags="X") for i in range(10)]
        assert sorted(r.queue_offset for r in sent) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # round robin over 2 queues
        with BlockingConsumer(c.ns, "sg", {"sync": "X"}, **FAST_CONSUMER) as consumer:
            got: list = []
            for _ in range(50):
                got += consumer.poll(0.5)
                if len(got) >= 10:
                    break
        assert sorted(r.body for r in got) == sorted(b"m%d" % i for i in range(10))


frames = st.builds(
    lambda code, rid, fields, body, cut: encode_frame(Frame(code, rid, fields, body))[: cut or None],
    st.sampled_from([int(c) for c in RequestCode] + [0, 12345]),
    st.integers(-(2**31), 2**31),
    st.dictionaries(
        st.sampled_from(
            [
                "topic",
                "queue_id",
                "offset",
                "max_messages",
                "max_wait_ms",
                "tags",
                "group",
                "queue_count",
                "client_id",
                "groups",
                "timestamp_ms",
                "x",
            ]
        ),
        st.one_of(
            st.integers(-5, 5), st.text(max_size=5), st.none(), st.lists(st.integers(-(2**40), 2**40), max_size=2)
        ),
    ),
    st.binary(max_size=64),
    st.integers(0, 40),
)


def test_fuzzed_frames_get_errors_or_a_closed_connection_and_lose_nothing(tmp_path: Path) -> None:
    with cluster_in_thread(tmp_path) as c, BlockingProducer(c.ns) as p:
        addr = c.brokers["broker-a"].addr
        host, port = addr.rsplit(":", 1)
        acked = [p.send("sync", b"before")]

        @given(st.lists(st.one_of(frames, st.binary(max_size=64)), min_size=1, max_size=4))
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        def attack(chunks: list[bytes]) -> None:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"".join(chunks))
                s.shutdown(socket.SHUT_WR)
                s.settimeout(3)
                with contextlib.suppress(OSError):
                    while s.recv(65536):  # answers or a close, never a hang
                        pass
            acked.append(p.send("sync", b"during"))

        attack()
        with BlockingConsumer(c.ns, "fz", {"sync": "*"}, **FAST_CONSUMER) as consumer:
            got: list = []
            for _ in range(100):
                got += consumer.poll(0.3)
                if len(got) >= len(acked):
                    break
        stored = {(r.queue_id, r.queue_offset) for r in got}
        assert {(a.queue.queue_id, a.queue_offset) for a in acked} <= stored
        fuzz_topics = {r.topic for r in got}
        assert fuzz_topics == {"sync"}


def test_route_table_drops_silent_brokers_and_sorts_routes() -> None:
    from clmq.nameserver import RouteTable

    table = RouteTable(expiry_ms=1000)
    assert table.register("c", "b", "h2:1", {"t": 4}, now_ms=0)
    assert table.register("c", "a", "h1:1", {"t": 2, "u": 1}, now_ms=500)
    assert not table.register("c", "a", "h1:1", {"t": 2, "u": 1}, now_ms=900)  # unchanged
    assert [b["broker_name"] for b in table.route("t")] == ["a", "b"]
    assert table.expire(now_ms=1200) == ["h2:1"]
    assert table.route("t") == [
        {
            "broker_name": "a",
            "addr": "h1:1",
            "queue_count": 2,
            "healthy": True,
            "failure": "",
            "epoch": -1,
            "leader": True,
            "followers": [],
        }
    ]


async def test_name_server_drops_a_broker_that_stops_registering(cluster: Cluster) -> None:
    await cluster.start_broker("broker-b")
    await cluster.create_topic("ex", 1)
    cluster.scopes["broker-b"].cancel()  # gone without unregistering (as if its host died)
    async with open_admin(cluster.ns) as admin:

        async def only_a_left() -> bool:
            return {b["broker_name"] for b in await admin.brokers()} == {"broker-a"}

        await await_until(only_a_left, 5, "the name server to drop broker-b")


async def test_brokers_register_with_every_name_server_and_clients_use_any_that_answers(cluster: Cluster) -> None:
    from clmq.nameserver import NameServerConfig
    from clmq.nameserver import serve as serve_nameserver

    second = await cluster.nursery.start(serve_nameserver, NameServerConfig(listen_port=0))
    b = await cluster.start_broker("broker-b", namesrv_addrs=[*cluster.ns, second.addr])
    async with open_admin([second.addr]) as admin:

        async def b_registered() -> bool:
            return {x["broker_name"] for x in await admin.brokers()} == {"broker-b"}

        await await_until(b_registered, 5, "broker-b to register with the second name server")
        await admin.create_topic("two", 2, on=[b.addr])
    await cluster.wait_routed("two", {"broker-b"}, ns=[second.addr], timeout_s=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens here
    async with open_producer([dead, second.addr]) as p:
        r = await p.send("two", b"via the second name server")
    assert r.queue.broker_name == "broker-b"


async def test_requests_appended_together_keep_their_own_outcomes(cluster: Cluster) -> None:
    """The append lane groups waiting requests into one store call; a bad one among
    them fails alone, and the good ones keep their order and offsets."""
    from clmq.common import Message
    from clmq.protocol import encode_batch

    await cluster.create_topic("lane", 1)
    addr = cluster.brokers["broker-a"].addr
    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as n:
        rpcs = [RpcClient(n) for _ in range(6)]

        async def send(i: int, topic: str, qid: int) -> None:
            body = encode_batch([Message(topic, qid, b"%d-%d" % (i, k)) for k in range(50)])
            reply = await rpcs[i].request(addr, RequestCode.SEND_MESSAGE, {"topic": topic}, body, check=False)
            outcomes[f"{i}"] = reply

        async with trio.open_nursery() as senders:
            senders.start_soon(send, 0, "lane", 0)
            senders.start_soon(send, 1, "missing", 0)
            senders.start_soon(send, 2, "lane", 5)  # no such queue
            for i in range(3, 6):
                senders.start_soon(send, i, "lane", 0)
        for r in rpcs:
            await r.aclose()
    assert outcomes["1"].error_code == ErrorCode.TOPIC_NOT_FOUND  # type: ignore[attr-defined]
    assert outcomes["2"].error_code == ErrorCode.INVALID_QUEUE_ID  # type: ignore[attr-defined]
    good = [outcomes[k].fields["queue_offsets"] for k in ("0", "3", "4", "5")]  # type: ignore[attr-defined]
    assert sorted(o for offs in good for o in offs) == list(range(200))
    assert all(offs == list(range(offs[0], offs[0] + 50)) for offs in good)  # each request's messages stay together


async def test_producers_get_busy_instead_of_an_unbounded_queue(cluster: Cluster) -> None:
    from clmq.common import Message
    from clmq.protocol import encode_batch

    broker = await cluster.start_broker("broker-busy", max_inflight_produce_bytes=1)
    async with open_admin(cluster.ns) as admin:
        await admin.create_topic("busy", 1, on=[broker.addr])
    codes = []
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        body = encode_batch([Message("busy", 0, b"x" * 1000) for _ in range(200)])

        async def send() -> None:
            reply = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "busy"}, body, check=False)
            codes.append((reply.error_code, reply.error_text, reply.fields.get("queue_offsets")))

        async with trio.open_nursery() as senders:
            for _ in range(20):
                senders.start_soon(send)
        await rpc.aclose()
    busy = [c for c in codes if c[0] == ErrorCode.SYSTEM_BUSY]
    ok = [c for c in codes if c[0] == 0]
    assert busy and ok and len(busy) + len(ok) == 20
    assert "max_inflight_produce_bytes=1" in busy[0][1]
    await trio.to_thread.run_sync(broker.store.catch_up)
    assert broker.store.max_offset("busy", 0) == 200 * len(ok)  # what was refused was not stored


async def test_a_consumer_of_thousands_of_queues_reads_them_all_through_multi_queue_fetches(cluster: Cluster) -> None:
    """Few requests cover many queues; queues not reached in one fetch (SKIPPED) come
    first in the next, and offsets are looked up and committed in batches."""
    await cluster.create_topic("wide", 2000)
    await send_direct(cluster.brokers["broker-a"].addr, "wide", {q: [b"%d" % q] * (1 + q % 3) for q in range(2000)})
    want = sum(1 + q % 3 for q in range(2000))
    got = await consume(
        cluster.ns, "wide-g", "wide", want, timeout_s=30, fetch_queues=300, fetch_max_messages=500, pull_batch=2
    )
    assert len(got) == want
    assert sorted({r.queue_id for r in got}) == list(range(2000))
    assert all(int(r.body) == r.queue_id for r in got)
    async with open_admin(cluster.ns) as admin:
        info = await admin.describe_group("wide-g")
    assert len(info["queues"]) == 2000 and info["lag"] == 0


async def test_idle_queues_are_watched_apart_and_never_hold_up_queues_with_messages(cluster: Cluster) -> None:
    """48 empty queues come first in the consumer's order and 16 full ones last, with one
    request per kind in flight and a 20 s long poll. The empty queues' request waits on
    the broker; the full queues must still be read at once, not after the wait."""
    await cluster.create_topic("mixed", 64)
    await send_direct(cluster.brokers["broker-a"].addr, "mixed", {q: [b"%d" % q] * 50 for q in range(48, 64)})
    t0 = trio.current_time()
    got = await consume(
        cluster.ns,
        "mixed-g",
        "mixed",
        800,
        timeout_s=15,
        fetches_in_flight=1,
        fetch_queues=16,
        pull_batch=10,
        pull_wait_ms=20_000,
    )
    assert len(got) == 800 and {r.queue_id for r in got} == set(range(48, 64))
    assert trio.current_time() - t0 < 10  # no request for data sat behind a long poll


async def test_queues_turning_idle_while_others_are_watched_still_see_new_messages_at_once(cluster: Cluster) -> None:
    """A broker's 32 empty queues turn idle in two steps (looked up 16 per request); the
    first 16 are watched by a 20 s long poll, and the second 16 must get a long poll of
    their own at once, not wait for the first to end: a message to one of them arrives
    at once."""
    await cluster.create_topic("quiet", 32)
    async with open_consumer(
        cluster.ns,
        "quiet-g",
        {"quiet": "*"},
        **{**FAST_CONSUMER, "fetches_in_flight": 1, "fetch_queues": 16, "pull_wait_ms": 20_000},
    ) as c:
        broker = cluster.brokers["broker-a"]
        await await_until(lambda: broker.waiters.waiting >= 32, 10, "all 32 queues looked up, found empty and watched")
        t0 = trio.current_time()
        async with open_producer(cluster.ns) as p:
            sent = await p.send_batch("quiet", [b"late"], selector=lambda mqs, _m: mqs[31])
        assert sent.queue.queue_id == 31  # in the second step of its broker's queues
        with trio.fail_after(10):
            got = await c.receive()
    assert [r.body for r in got] == [b"late"] and trio.current_time() - t0 < 10


async def test_queues_are_asked_for_data_only_while_they_have_some(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of 64 queues, 60 are empty when the consumer looks them up: they go straight to
    long polls (a round of asks would only come back empty: 8,000 of them in the
    10,000-queue benchmark). The 4 with messages are asked once: the answer says it
    read up to the queue's max offset, so they are watched next, not asked again for
    nothing. A message arriving later in an empty queue comes at once, through its
    watch, and asks for nothing more either."""
    await cluster.create_topic("sparse", 64)
    broker = cluster.brokers["broker-a"]
    await send_direct(broker.addr, "sparse", {q: [b"early"] for q in range(4)})
    # dispatched, so that the look-up sees them (else they come through watches)
    await trio.to_thread.run_sync(broker.store.catch_up)
    asked: list[tuple[int, int]] = []  # (max_wait_ms, queue id) of every queue in every fetch
    real_request = Requests.request  # every request of the consumer's parts goes through it

    async def recording(self: Requests, addr: str, code: int, fields: dict, timeout_ms: float | None = None) -> object:
        if code == RequestCode.PULL_MESSAGES:
            asked.extend((fields["max_wait_ms"], qid) for _t, qid, _o, _tags in fields["queues"])
        return await real_request(self, addr, code, fields, timeout_ms)

    monkeypatch.setattr(Requests, "request", recording)
    async with open_consumer(cluster.ns, "sparse-g", {"sparse": "*"}, **{**FAST_CONSUMER, "pull_wait_ms": 20_000}) as c:
        with trio.fail_after(10):
            early: list[Record] = []
            while len(early) < 4:  # one receive() returns every queue's buffered batch
                early += await c.receive()
        # the 4 read queues caught up and, with the 60 found empty, watched
        await await_until(lambda: broker.waiters.waiting >= 64, 10, "all 64 queues watched")
        async with open_producer(cluster.ns) as p:
            await p.send_batch("sparse", [b"late"], selector=lambda mqs, _m: mqs[40])
        t0 = trio.current_time()
        with trio.fail_after(10):
            late = await c.receive()
    assert sorted(r.queue_id for r in early) == [0, 1, 2, 3] and [r.body for r in late] == [b"late"]
    assert trio.current_time() - t0 < 5  # the watch was woken, not timed out
    assert sorted(qid for wait, qid in asked if wait == 0) == [0, 1, 2, 3]
    assert {qid for wait, qid in asked if wait > 0} >= set(range(4, 64))


def test_the_collector_pause_around_decoding_leaves_the_applications_setting() -> None:
    """The consumer pauses Python's cyclic collector while it decodes an answer (see
    ``collector_paused``); whatever the application had set holds after, errors included."""
    import gc

    from clmq.client.consumer._fetcher import collector_paused

    assert gc.isenabled()
    runs: list[str] = []
    gc.callbacks.append(lambda phase, _info: runs.append(phase))
    try:
        with collector_paused():
            assert not gc.isenabled()
            created_inside = [[i] for i in range(5000)]  # far past the 700-object threshold
            collections_inside = len(runs)
        more = [[i] for i in range(5000)]
    finally:
        gc.callbacks.pop()
    assert collections_inside == 0 and len(created_inside) == len(more) == 5000
    assert "start" in runs  # ... and the collector ran again once allowed
    assert gc.isenabled()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("a corrupt answer")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # the application's choice stays
    finally:
        gc.enable()


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ([7, 0, 0, None], "topic"),
        (["rows", "0", 0, None], "queue_id"),
        (["rows", True, 0, None], "queue_id"),
        (["rows", 0, 1.5, None], "offset"),
        (["rows", 0, None, None], "offset"),
        (["rows", 0, 0, "TagA"], "tags"),
        (["rows", 0, 0, ["TagA", 3]], "tags"),
        (["rows", 0, 0], "fetch ask must be"),
        ({"topic": "rows"}, "fetch ask must be"),
    ],
)
async def test_a_fetch_row_with_a_mistyped_field_is_refused_by_name(cluster: Cluster, row: object, field: str) -> None:
    """Every field of a PULL_MESSAGES row, of the wrong type: MALFORMED_REQUEST naming it,
    and the same connection goes on serving good rows."""
    await cluster.create_topic("rows", 1)
    addr = cluster.brokers["broker-a"].addr
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        fields = {"queues": [["rows", 0, 0, None], row], "max_wait_ms": 0}
        bad = await rpc.request(addr, RequestCode.PULL_MESSAGES, fields, check=False)
        assert bad.error_code == ErrorCode.MALFORMED_REQUEST and field in bad.error_text
        good = await rpc.request(addr, RequestCode.PULL_MESSAGES, {"queues": [["rows", 0, 0, None]], "max_wait_ms": 0})
        assert good.fields["results"] == [["NO_MESSAGE", 0, 0, 0, 0]]
        await rpc.aclose()


class PreadsThatBlock(fileops.FileOps):
    """Store file operations whose preads of one file kind block until released (a disk
    that stalls on one file): not a mock, the real operations with a stall in front."""

    def __init__(self, path_part: str) -> None:
        self.path_part = path_part
        self.entered = threading.Event()
        self.release = threading.Event()

    def pread(self, fd: int, n: int, pos: int) -> bytes:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if self.path_part in path:
            self.entered.set()
            self.release.wait(20)  # bounded: a test that fails must not hang
        return os.pread(fd, n, pos)


@pytest.mark.parametrize("code", [RequestCode.PULL_MESSAGE, RequestCode.PULL_MESSAGES])
async def test_a_pull_stalled_on_the_disk_holds_up_no_other_connection(
    nursery: trio.Nursery, tmp_path: Path, code: int
) -> None:
    """Pulls read the store in worker threads: while one pull waits for a stalled read of
    its queue's file, pulls of another queue on another connection, and pings, answer."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker("broker-a", storage_mode="partition-per-file")  # one file per queue
    await c.create_topic("slow", 1)
    await c.create_topic("fast", 1)
    await send_direct(broker.addr, "slow", {0: [b"s%d" % i for i in range(5)]})
    await send_direct(broker.addr, "fast", {0: [b"f%d" % i for i in range(5)]})

    def pull(topic: str) -> tuple[dict, dict]:
        if code == RequestCode.PULL_MESSAGE:
            return {"topic": topic, "queue_id": 0, "offset": 0, "max_messages": 8}, {}
        return {"queues": [[topic, 0, 0, None]], "max_wait_ms": 0}, {}

    ops = PreadsThatBlock("/partitions/slow-0/")
    previous = fileops.install(ops)
    try:
        async with trio.open_nursery() as n:
            slow_rpc, fast_rpc = RpcClient(n), RpcClient(n)
            slow_done = trio.Event()

            async def slow_pull() -> None:
                await slow_rpc.request(broker.addr, code, pull("slow")[0], timeout_ms=30_000)
                slow_done.set()

            n.start_soon(slow_pull)
            await trio.to_thread.run_sync(ops.entered.wait, 10)
            assert ops.entered.is_set()
            with trio.fail_after(5):
                fast = await fast_rpc.request(broker.addr, code, pull("fast")[0])
                info = await fast_rpc.request(broker.addr, RequestCode.BROKER_INFO)
            assert not ops.release.is_set() and not slow_done.is_set()  # answered while the slow read is stuck
            assert (fast.fields.get("count") or fast.fields["results"][0][2]) == 5 and info.error_code == 0
            ops.release.set()
            with trio.fail_after(10):
                await slow_done.wait()
            await slow_rpc.aclose()
            await fast_rpc.aclose()
    finally:
        ops.release.set()
        fileops.install(previous)


async def test_read_threads_return_results_and_errors_and_never_run_more_than_their_size() -> None:
    readers = ReadThreads(3, idle_s=0.05)
    running, most, lock = [0], [0], threading.Lock()

    def read(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            threading.Event().wait(0.002)  # a read that takes a while
            if i % 7 == 3:
                raise OSError(f"read {i} failed")
            return i * i
        finally:
            with lock:
                running[0] -= 1

    results: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            results[i] = await readers.in_thread(read, i)
        except OSError as e:
            results[i] = str(e)

    async with trio.open_nursery() as n:
        for i in range(60):
            n.start_soon(one, i)
    assert results == {i: (f"read {i} failed" if i % 7 == 3 else i * i) for i in range(60)}
    assert 1 <= most[0] <= 3 and readers.threads <= 3
    await await_until(lambda: readers.threads == 0, 5, "idle read threads to end")
    assert await readers.in_thread(read, 2) == 4  # and start again on demand
