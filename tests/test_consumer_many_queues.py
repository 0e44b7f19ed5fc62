"""A consumer of many queues (issue 17): one request per broker covers many queues,
bounded in bytes; prefetch is bounded; commits are one request per broker per
interval; idle queues are long-polled together. Real brokers on 127.0.0.1; requests
are counted by a frame-decoding TCP proxy between the consumer and the broker."""

from __future__ import annotations

import gc
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import Consumer, ConsumerOptions, RpcClient, open_consumer
from clmq.common import Message, Record
from clmq.protocol import FLAG_RESPONSE, NEED_DATA, Frame, FrameDecoder, RequestCode, decode_records, encode_batch
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until

QUEUES = 10_000


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    # Members leave by UNREGISTER_CLIENT on close; a member expired while the loaded
    # machine delays its heartbeats (the helpers' 1 s) would be read twice, by design.
    await c.start_broker("broker-a", max_message_bytes=1 << 20, client_expiry_ms=30_000)
    return c


class CountingProxy:
    """Forwards TCP to ``target`` and decodes the requests going through it."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.requests: list[Frame] = []
        self.addr = ""

    def count(self, code: int) -> int:
        return sum(1 for f in self.requests if f.code == code)

    async def start(self, nursery: trio.Nursery) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.addr = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.start_soon(trio.serve_listeners, self._serve, listeners)

    async def _serve(self, client: trio.SocketStream) -> None:
        host, port = self.target.rsplit(":", 1)
        upstream = await trio.open_tcp_stream(host, int(port))
        async with client, upstream, trio.open_nursery() as n:
            n.start_soon(self._pump, client, upstream, True)
            n.start_soon(self._pump, upstream, client, False)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, requests: bool) -> None:
        decoder = FrameDecoder()
        try:
            while data := await src.receive_some(1 << 16):
                if requests:
                    decoder.receive_data(data)
                    while (event := decoder.next_event()) is not NEED_DATA:
                        if isinstance(event, Frame) and not event.flags & FLAG_RESPONSE:
                            self.requests.append(event)
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await dst.aclose()


async def fill(addr: str, topic: str, bodies: dict[int, list[bytes]]) -> None:
    """Every queue's bodies in multi-queue SEND_MESSAGE requests (up to 2,000 messages each)."""
    messages = [Message(topic, q, b, keys=f"{q}:{i}") for q, bs in bodies.items() for i, b in enumerate(bs)]
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        for i in range(0, len(messages), 2000):
            await rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": topic}, encode_batch(messages[i : i + 2000]))
        await rpc.aclose()
        n.cancel_scope.cancel()


def sparse_bodies(seed: int, tag: str) -> dict[int, list[bytes]]:
    """A few messages in one queue of five, a dense queue, the rest empty."""
    rng = random.Random(seed)
    bodies = {q: [f"{tag}-{q}-{i}".encode() for i in range(rng.randint(1, 4))] for q in range(0, QUEUES, 5)}
    bodies[7] = [f"{tag}-7-{i}".encode() for i in range(3000)]
    return bodies


async def read(c: Consumer, want: int, timeout_s: float = 30) -> list[Record]:
    got: list[Record] = []
    with trio.fail_after(timeout_s):
        while len(got) < want:
            got += await c.receive()
    return got


def keys(records: list[Record]) -> Counter[tuple[int, int]]:
    return Counter((r.queue_id, r.queue_offset) for r in records)


@pytest.mark.slow
async def test_every_message_once_per_group_across_10000_sparse_queues(cluster: Cluster) -> None:
    """Two members share 10,000 queues (a fifth hold a few messages, one holds 3,000,
    the rest none) and read no message twice; one leaves and the other reads what is
    produced next in every queue, from where the leaver committed; a second group
    reads everything again."""
    await cluster.create_topic("many", QUEUES)
    addr = cluster.brokers["broker-a"].addr
    first, second = sparse_bodies(1, "a"), sparse_bodies(2, "b")
    n_first, n_second = sum(map(len, first.values())), sum(map(len, second.values()))
    opts = {**FAST_CONSUMER, "client_id": ""}
    async with open_consumer(cluster.ns, "g", {"many": "*"}, **opts) as a:
        async with open_consumer(cluster.ns, "g", {"many": "*"}, **opts) as b:
            await await_until(
                lambda: (
                    len(a.assignment()) + len(b.assignment()) == QUEUES
                    and not set(a.assignment()) & set(b.assignment())
                ),
                20,
                "the queues split",
            )
            await fill(addr, "many", first)
            got_a: list[Record] = []
            got_b: list[Record] = []
            with trio.fail_after(60):
                async with trio.open_nursery() as n:
                    n.start_soon(_collect, a, got_a, lambda: len(got_a) + len(got_b) >= n_first)
                    n.start_soon(_collect, b, got_b, lambda: len(got_a) + len(got_b) >= n_first)
            assert not keys(got_a) & keys(got_b), "a message read by both members"
            assert sorted(r.body for r in got_a + got_b) == sorted(x for bs in first.values() for x in bs)
        # b left (its last batch acknowledged and committed on close): a takes its queues.
        # Broker, both members and this test share one process: under CI's load (crash
        # and chaos tests beside it) b's close and a's take-over of 5,000 queues took
        # over 20 s once, so the same 60 s as the reads below.
        await await_until(lambda: len(a.assignment()) == QUEUES, 60, "a owns every queue")
        await fill(addr, "many", second)
        rest = await read(a, n_second, 60)
        assert sorted(r.body for r in rest) == sorted(x for bs in second.values() for x in bs)
    async with open_consumer(cluster.ns, "g2", {"many": "*"}, **FAST_CONSUMER) as c:
        again = await read(c, n_first + n_second, 60)
    assert max(keys(again).values()) == 1 and len(again) == n_first + n_second


async def _collect(c: Consumer, into: list[Record], done: Any) -> None:
    """Receive into ``into`` until ``done()``; the other member's task ends it too."""
    while not done():
        with trio.move_on_after(0.2):  # re-check done(): the other member may have read the last
            into += await c.receive()


@pytest.mark.parametrize("seed", range(6))
async def test_fetch_answers_stay_within_max_bytes_and_always_progress(cluster: Cluster, seed: int) -> None:
    """Whatever the sizes: an answer's body is at most ``max_bytes``, unless its first
    record alone is larger (then it holds that record only); repeated fetches read
    every message exactly once."""
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, 2000), rng.randint(1, 40_000)]) for _ in range(rng.randint(1, 40))]
    max_bytes, queues = rng.choice([1, rng.randint(1, 5000), rng.randint(1, 64_000)]), rng.randint(1, 6)
    topic = f"t{random.getrandbits(40)}"
    await cluster.create_topic(topic, queues)
    addr = cluster.brokers["broker-a"].addr
    bodies: dict[int, list[bytes]] = {q: [] for q in range(queues)}
    for i, size in enumerate(sizes):
        bodies[i % queues].append(bytes([i % 251]) * size)
    await fill(addr, topic, bodies)
    await trio.to_thread.run_sync(cluster.brokers["broker-a"].store.catch_up)
    offsets = [0] * queues
    got: list[Record] = []
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        with trio.fail_after(30):
            while len(got) < len(sizes):
                asks = [[topic, q, offsets[q], None] for q in range(queues)]
                reply = await rpc.request(
                    addr, RequestCode.PULL_MESSAGES, {"queues": asks, "max_bytes": max_bytes, "max_messages": 4096}
                )
                records = decode_records(reply.body, "test")
                assert records, "no progress"
                assert len(reply.body) <= max_bytes or len(records) == 1
                for q, row in enumerate(reply.fields["results"]):
                    offsets[q] = row[1]
                got += records
        await rpc.aclose()
        n.cancel_scope.cancel()
    assert sorted(r.body for r in got) == sorted(b for bs in bodies.values() for b in bs)


async def test_a_message_larger_than_fetch_max_bytes_is_still_received(cluster: Cluster) -> None:
    await cluster.create_topic("big", 3)
    await fill(cluster.brokers["broker-a"].addr, "big", {0: [b"x" * 300_000], 1: [b"s"] * 50, 2: [b"y" * 200_000] * 2})
    async with open_consumer(
        cluster.ns, "g", {"big": "*"}, **FAST_CONSUMER, fetch_max_bytes=10_000, prefetch_max_bytes=50_000
    ) as c:
        got = await read(c, 53)
    assert sorted(len(r.body) for r in got) == [1] * 50 + [200_000, 200_000, 300_000]


async def test_prefetch_stays_within_its_bound_while_the_application_does_not_receive(cluster: Cluster) -> None:
    """With 4 MiB waiting in 200 queues and a 256 KiB bound, the consumer fills its
    buffer up to the bound and stops fetching; receive() then gets everything once."""
    await cluster.create_topic("pre", 200)
    body = b"p" * 1000
    await fill(cluster.brokers["broker-a"].addr, "pre", {q: [body] * 20 for q in range(200)})
    bound = 256 << 10
    async with open_consumer(
        cluster.ns,
        "g",
        {"pre": "*"},
        **FAST_CONSUMER,
        prefetch_max_bytes=bound,
        fetch_max_bytes=32 << 10,
        watch_max_bytes=8 << 10,
    ) as c:
        buf = c.prefetch
        await await_until(lambda: buf.buffered_bytes > bound - (32 << 10) - 2000, 10, "the buffer filled")
        for _ in range(10):  # it stays full, and within the bound, while nobody receives
            assert buf.buffered_bytes + buf.reserved_bytes <= bound
            await trio.sleep(0.05)
        got: list[Record] = []
        with trio.fail_after(30):
            while len(got) < 4000:
                got += await c.receive()
                assert buf.buffered_bytes + buf.reserved_bytes <= bound
    assert len(got) == 4000 and max(keys(got).values()) == 1


async def test_receive_returns_at_most_receive_max_messages_and_acknowledges_them_all(cluster: Cluster) -> None:
    """One receive() returns several queues' batches (never more than the bound unless
    one batch is); after the next receive() every returned batch is processed."""
    await cluster.create_topic("rx", 50)
    await fill(cluster.brokers["broker-a"].addr, "rx", {q: [b"m"] * 30 for q in range(50)})
    async with open_consumer(
        cluster.ns, "g", {"rx": "*"}, **FAST_CONSUMER, receive_max_messages=100, pull_batch=30
    ) as c:
        got: list[Record] = []
        with trio.fail_after(20):
            while len(got) < 1500:
                batch = await c.receive()
                assert len(batch) <= 100
                got += batch
        c.ack()
        last = {(r.topic, r.queue_id): r.queue_offset + 1 for r in got}
        assert {(mq.topic, mq.queue_id): o for mq, o in c.processed.items()} == last
    assert len(got) == 1500 and max(keys(got).values()) == 1


async def test_commits_are_one_request_per_broker_per_interval(cluster: Cluster, nursery: trio.Nursery) -> None:
    """Reading 1,000 queues with a 200 ms commit interval: each COMMIT_OFFSET carries
    many queues, and there is at most one per interval (and the one at close)."""
    await cluster.create_topic("cm", 1000)
    addr = cluster.brokers["broker-a"].addr
    await fill(addr, "cm", {q: [b"c"] * 5 for q in range(1000)})
    proxy = CountingProxy(addr)
    await proxy.start(nursery)
    t0 = trio.current_time()
    async with open_consumer(
        None, "g", {"cm": "*"}, broker_addrs=[proxy.addr], **{**FAST_CONSUMER, "commit_interval_ms": 200}
    ) as c:
        got = await read(c, 5000)
        c.ack()
        await await_until(lambda: cluster.brokers["broker-a"].offsets.query("g", "cm", 999) == 5, 10, "committed")
    elapsed = trio.current_time() - t0
    commits = [f for f in proxy.requests if f.code == RequestCode.COMMIT_OFFSET]
    assert len(got) == 5000
    assert 1 <= len(commits) <= elapsed / 0.2 + 2
    assert sum(len(f.fields["offsets"]) for f in commits) >= 1000  # every queue, in few requests


async def test_idle_consumer_of_10000_queues_long_polls_them_together(cluster: Cluster, nursery: trio.Nursery) -> None:
    """Idle on 10,000 empty queues, the consumer keeps about one watch per 1,024 queues
    and asks nothing more; a message in any one of them comes through its watch, well
    before the 20 s wait runs out."""
    await cluster.create_topic("idle", QUEUES)
    broker = cluster.brokers["broker-a"]
    proxy = CountingProxy(broker.addr)
    await proxy.start(nursery)
    async with open_consumer(
        None, "g", {"idle": "*"}, broker_addrs=[proxy.addr], **FAST_CONSUMER, pull_wait_ms=20_000
    ) as c:
        await await_until(lambda: broker.waiters.waiting >= QUEUES, 20, "every queue watched")
        watches = proxy.count(RequestCode.PULL_MESSAGES)
        assert watches <= 2 * (QUEUES // 1024 + 1)
        for q in random.Random(5).sample(range(QUEUES), 3):
            await fill(broker.addr, "idle", {q: [f"late-{q}".encode()]})
            with trio.fail_after(10):  # the watch is woken: no 20 s wait
                got = await c.receive()
            assert [r.body for r in got] == [f"late-{q}".encode()]
        pulls = proxy.count(RequestCode.PULL_MESSAGES) - watches
        assert pulls <= 3 * 4  # per arrival: its woken watch, a fresh watch for the rest, and a few more


@pytest.mark.parametrize(
    "setting",
    [
        "pull_batch",
        "fetch_queues",
        "fetch_max_messages",
        "fetch_max_bytes",
        "watch_max_bytes",
        "fetches_in_flight",
        "watches_in_flight",
        "prefetch_max_bytes",
        "receive_max_messages",
    ],
)
def test_consumer_limits_below_one_are_refused_naming_the_setting(setting: str) -> None:
    """A limit of 0 used to be accepted and, for the byte bounds, made every fetch wait
    for room that never came (the consumer hung)."""
    with pytest.raises(ValueError, match=setting):
        ConsumerOptions(**{setting: 0})


@pytest.mark.parametrize("enabled", [True, False])
async def test_the_collector_is_left_as_the_application_set_it(cluster: Cluster, enabled: bool) -> None:
    """The consumer pauses Python's cyclic collector while it takes queues, looks up
    their offsets, decodes and buffers answers (an object or more per queue and per
    record); whatever the application chose stays chosen around every call."""
    await cluster.create_topic("gc", 2000)
    await fill(cluster.brokers["broker-a"].addr, "gc", {q: [b"m"] * (q % 2) for q in range(2000)})
    (gc.enable if enabled else gc.disable)()
    try:
        async with open_consumer(cluster.ns, "g", {"gc": "*"}, **FAST_CONSUMER) as c:
            assert gc.isenabled() is enabled
            got = 0
            with trio.fail_after(30):
                while got < 1000:
                    got += len(await c.receive())
                    assert gc.isenabled() is enabled
        assert got == 1000 and gc.isenabled() is enabled
    finally:
        gc.enable()
