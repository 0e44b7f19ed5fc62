"""The consumer's redelivery API against real brokers: nack (CONSUMER_SEND_BACK), the
group's retry topic read by the same group only, dead letters after
max_reconsume_times, run() with handlers, and the facades."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from clmq.client import (
    BlockingConsumer,
    ConsumeStatus,
    Record,
    RpcClient,
    SendBackError,
    open_asyncio_consumer,
    open_consumer,
)
from clmq.common import PROP_ORIGIN_TOPIC, Message, dlq_topic, retry_topic
from clmq.protocol import RequestCode, encode_batch
from tests.service_helpers import FAST_CONSUMER, Cluster, cluster_in_thread
from tests.waiting import await_until

BROKER = {"timer_tick_ms": 20}


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker(**BROKER)
    return c


async def _send(addr: str, topic: str, bodies: list[bytes], queue: int = 0) -> None:
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(
            addr, RequestCode.SEND_MESSAGE, {"topic": topic}, encode_batch([Message(topic, queue, b) for b in bodies])
        )
        await rpc.aclose()


async def _receive(consumer: object, want: int, timeout_s: float = 10) -> list[Record]:
    got: list[Record] = []
    with trio.fail_after(timeout_s):
        while len(got) < want:
            got += await consumer.receive()  # type: ignore[attr-defined]
    return got


async def test_a_nacked_message_comes_back_to_its_group_only_after_its_delay(cluster: Cluster) -> None:
    await cluster.create_topic("rt", 1)
    broker = cluster.brokers["broker-a"]
    await _send(broker.addr, "rt", [b"a", b"b"])
    async with (
        open_consumer(cluster.ns, "g1", {"rt": "*"}, **FAST_CONSUMER) as g1,
        open_consumer(cluster.ns, "g2", {"rt": "*"}, **FAST_CONSUMER) as g2,
    ):
        first = await _receive(g1, 2)
        assert [r.body for r in first] == [b"a", b"b"]
        assert [r.body for r in await _receive(g2, 2)] == [b"a", b"b"]
        t0 = trio.current_time()
        (result,) = await g1.nack([first[0]], delay_ms=300)
        assert (result.record, result.destination, result.reconsume_times) == (first[0], "retry", 1)
        again = await _receive(g1, 1)
        waited = trio.current_time() - t0
        assert 0.3 <= waited <= 1.5, waited
        (r,) = again
        assert (r.topic, r.body, r.reconsume_times) == (retry_topic("g1"), b"a", 1)
        assert r.properties[PROP_ORIGIN_TOPIC] == "rt"
        await g1.commit()
        assert broker.offsets.query("g1", "rt", 0) == 2  # the original queue moved past the nacked message
        assert retry_topic("g1") in {mq.topic for mq in g1.assignment()}
        assert not any(mq.topic.startswith("%") and mq.topic != retry_topic("g2") for mq in g2.assignment())
        with trio.move_on_after(0.3):  # not a wait for an event: g2 must get nothing more in this time
            extra = await g2.receive()
            raise AssertionError(f"g2 got {extra}")


async def test_run_redelivers_what_a_handler_failed_on_or_raised_for(cluster: Cluster) -> None:
    await cluster.create_topic("rr", 1)
    broker = cluster.brokers["broker-a"]
    await _send(broker.addr, "rr", [b"ok", b"later", b"boom"])
    seen: list[tuple[str, bytes, int]] = []

    async def handler(r: Record) -> ConsumeStatus | None:
        seen.append((r.topic, r.body, r.reconsume_times))
        if r.reconsume_times == 0 and r.body == b"later":
            return ConsumeStatus.RECONSUME_LATER
        if r.reconsume_times == 0 and r.body == b"boom":
            raise ValueError("boom")
        return None

    options = {**FAST_CONSUMER, "retry_delays_ms": (100, 5000)}  # the consumer's own back-off
    async with open_consumer(cluster.ns, "rg", {"rr": "*"}, **options) as consumer:
        assert await consumer.run(handler, max_messages=5) == 5
    assert seen[:3] == [("rr", b"ok", 0), ("rr", b"later", 0), ("rr", b"boom", 0)]
    assert sorted(seen[3:]) == [(retry_topic("rg"), b"boom", 1), (retry_topic("rg"), b"later", 1)]
    assert broker.offsets.query("rg", "rr", 0) == 3
    assert broker.offsets.query("rg", retry_topic("rg"), 0) == 2


async def test_after_max_reconsume_times_a_message_goes_to_the_dead_letters(cluster: Cluster) -> None:
    await cluster.create_topic("dl", 1)
    broker = cluster.brokers["broker-a"]
    await _send(broker.addr, "dl", [b"bad"])
    options = {**FAST_CONSUMER, "retry_delays_ms": (50,), "max_reconsume_times": 1}
    async with open_consumer(cluster.ns, "dg", {"dl": "*"}, **options) as consumer:
        (r,) = await _receive(consumer, 1)
        assert [x.destination for x in await consumer.reconsume_later([r])] == ["retry"]
        (r,) = await _receive(consumer, 1)
        assert (r.topic, r.reconsume_times) == (retry_topic("dg"), 1)
        (result,) = await consumer.nack([r])
        assert (result.destination, result.deliver_at_ms) == ("dlq", 0)

    def dead_letters() -> list[Record]:
        return (
            broker.store.get(dlq_topic("dg"), 0, 0, 10).messages
            if broker.store.queue_exists(dlq_topic("dg"), 0)
            else []
        )

    dead = await await_until(dead_letters, 5, "the dead letter")
    assert [(m.body, m.properties[PROP_ORIGIN_TOPIC]) for m in dead] == [(b"bad", "dl")]


async def test_nack_is_refused_in_broadcasting_mode_and_for_records_not_pending(cluster: Cluster) -> None:
    await cluster.create_topic("bc", 1)
    await _send(cluster.brokers["broker-a"].addr, "bc", [b"x"])
    async with open_consumer(cluster.ns, "bg", {"bc": "*"}, mode="broadcasting", **FAST_CONSUMER) as consumer:
        records = await _receive(consumer, 1)
        with pytest.raises(ValueError, match="clustering"):
            await consumer.nack(records)
        assert retry_topic("bg") not in consumer.filters
    async with open_consumer(cluster.ns, "cg", {"bc": "*"}, **FAST_CONSUMER) as consumer:
        records = await _receive(consumer, 1)
        consumer.ack()
        with pytest.raises(ValueError, match="not among the messages the last receive"):
            await consumer.nack(records)
        with pytest.raises(ValueError, match="delay_ms"):
            await consumer.nack([], delay_ms=-5)


async def test_a_send_back_that_fails_raises_and_the_message_is_read_again(cluster: Cluster) -> None:
    await cluster.create_topic("sf", 1)
    broker = cluster.brokers["broker-a"]
    await _send(broker.addr, "sf", [b"m0", b"m1", b"m2"])
    port = int(broker.addr.rsplit(":", 1)[1])
    async with open_consumer(cluster.ns, "fg", {"sf": "*"}, retry_budget_ms=300, **FAST_CONSUMER) as consumer:
        records = await _receive(consumer, 3)
        await cluster.stop_broker("broker-a")
        with pytest.raises(SendBackError) as failed:
            await consumer.nack([records[1]])
        assert failed.value.records == [records[1]] and failed.value.results == []
        await cluster.start_broker(port=port, **BROKER)
        again = await _receive(consumer, 2, timeout_s=15)  # read again from the first not sent back
        assert [(r.body, r.reconsume_times) for r in again] == [(b"m1", 0), (b"m2", 0)]


def test_the_blocking_consumer_runs_a_handler_and_nacks(tmp_path: Path) -> None:
    with cluster_in_thread(tmp_path) as c:
        from clmq.client import BlockingProducer

        with BlockingProducer(c.ns) as producer:
            producer.send("sync", b"once")
        seen: list[tuple[bytes, int]] = []

        def handler(r: Record) -> ConsumeStatus:
            seen.append((r.body, r.reconsume_times))
            return ConsumeStatus.RECONSUME_LATER if r.reconsume_times == 0 else ConsumeStatus.SUCCESS

        with BlockingConsumer(c.ns, "bk", {"sync": "*"}, retry_delays_ms=(50,), **FAST_CONSUMER) as consumer:
            assert consumer.run(handler, max_messages=2) == 2
        assert seen == [(b"once", 0), (b"once", 1)]


async def _asyncio_run(ns: list[str]) -> list[tuple[bytes, int]]:
    import asyncio

    seen: list[tuple[bytes, int]] = []

    async def handler(r: Record) -> ConsumeStatus:
        await asyncio.sleep(0)  # an asyncio coroutine, run on the asyncio loop
        seen.append((r.body, r.reconsume_times))
        return ConsumeStatus.RECONSUME_LATER if r.reconsume_times == 0 else ConsumeStatus.SUCCESS

    async with open_asyncio_consumer(ns, "ak", {"sync": "*"}, retry_delays_ms=(50,), **FAST_CONSUMER) as consumer:
        assert await asyncio.wait_for(consumer.run(handler, max_messages=2), 15) == 2
    return seen


def test_the_asyncio_consumer_runs_a_coroutine_handler(tmp_path: Path) -> None:
    import asyncio

    with cluster_in_thread(tmp_path) as c:
        from clmq.client import BlockingProducer

        with BlockingProducer(c.ns) as producer:
            producer.send("sync", b"async")
        assert asyncio.run(_asyncio_run(c.ns)) == [(b"async", 0), (b"async", 1)]
