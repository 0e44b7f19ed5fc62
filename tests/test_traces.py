"""Message traces on real brokers (docs/traces.md): the life of a message sent, nacked
and retried, dead-lettered and resent, found by its id and by its key, in order; a
full trace buffer drops and counts without holding up sends; tracing off records
nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import trio

from clmq.broker.cli._errors import EXIT_FAILED, EXIT_USAGE
from clmq.client import (
    BlockingAdmin,
    BlockingProducer,
    open_admin,
    open_asyncio_admin,
    open_asyncio_producer,
    open_consumer,
    open_producer,
)
from clmq.common import TRACE_TOPIC, TraceEvent, decode_events
from clmq.protocol import RequestCode
from tests.cli_helpers import clmq
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until, wait_until

SETTINGS = {"timer_tick_ms": 20, "retry_delays_ms": [100], "max_reconsume_times": 1, "trace_enabled": True}
TRACED = {"trace": True, "trace_flush_interval_ms": 20}
LIFE = [
    "sent",  # the producer, with the stored queue offset
    "delivered",  # billing-1, attempt 0
    "sent_back",  # the broker stored its retry
    "sent_back",  # billing-1 nacked it
    "delivered",  # billing-1, attempt 1, the retry
    "sent_back",  # billing-1 nacked it again
    "dead_lettered",  # the broker moved it to %DLQ%billing
    "sent",  # the resend's own send (the admin's producer, traced)
    "resent",  # the admin sent the dead letter again, as a new message
    "delivered",  # billing-2, the copy
    "acked",  # billing-2 acknowledged it
]


async def _cluster(nursery: trio.Nursery, root: Path, **settings: Any) -> Cluster:
    c = Cluster(nursery, root)
    await c.start_nameserver()
    await c.start_broker(**{**SETTINGS, **settings})
    await c.create_topic("orders", 1)
    return c


async def _trace_routed(c: Cluster) -> None:
    await c.wait_routed(TRACE_TOPIC, {b.config.broker_name for b in c.brokers.values()})


def _kinds(events: list[TraceEvent]) -> list[str]:
    return [e.kind for e in events]


async def _dead_letters_are(admin: Any, group: str, n: int) -> bool:
    return len(await admin.dead_letters(group)) == n


async def _receive_one(consumer: Any) -> Any:
    with trio.fail_after(10):
        (record,) = await consumer.receive()
    return record


async def test_a_message_sent_retried_dead_lettered_and_resent_has_its_whole_life_in_order(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = await _cluster(nursery, tmp_path)
    await _trace_routed(c)
    async with open_producer(c.ns, **TRACED) as producer:
        sent = await producer.send("orders", b"order 7", keys="order-7")
    msg_id = sent.msg_ids[0]
    async with open_consumer(
        c.ns, "billing", {"orders": "*"}, client_id="billing-1", **FAST_CONSUMER, **TRACED
    ) as cons:
        first = await _receive_one(cons)
        assert (await cons.nack([first]))[0].destination == "retry"
        retry = await _receive_one(cons)  # through %RETRY%billing after 100 ms
        assert retry.reconsume_times == 1
        assert (await cons.nack([retry]))[0].destination == "dlq"
    async with open_admin(c.ns) as admin:
        # The send-back's answer comes once the dead letter is stored; the DLQ's queue
        # shows it once dispatched, a moment later (a fresh-clone CI run resent nothing).
        await await_until(lambda: _dead_letters_are(admin, "billing", 1), 10, "the dead letter in %DLQ%billing's queue")
        resent = await admin.resend_dead_letters("billing")
        assert len(resent.resent) == 1
        async with open_consumer(
            c.ns, "billing", {"orders": "*"}, client_id="billing-2", **FAST_CONSUMER, **TRACED
        ) as cons:
            copy = await _receive_one(cons)
            assert copy.body == b"order 7"
            cons.ack()

        async def whole_life() -> list[TraceEvent] | None:
            trace = await admin.trace(msg_id)
            return trace.events if sorted(_kinds(trace.events)) == sorted(LIFE) else None

        events = await await_until(whole_life, 15, "the whole life of the message in its trace")
    # Each recorder's events in the order it saw them; the broker's and a client's of one
    # step may share a millisecond (the broker stores, then answers).
    client_side = [e.kind for e in events if e.client_id]
    assert [k for k in client_side if k != "resent"] == [
        "sent",
        "delivered",
        "sent_back",
        "delivered",
        "sent_back",
        "sent",
        "delivered",
        "acked",
    ]
    assert [e.kind for e in events if not e.client_id] == ["sent_back", "dead_lettered"]  # the broker's
    order = _kinds(events)
    assert order[0] == "sent" and order[-1] == "acked", events
    delivered = [i for i, k in enumerate(order) if k == "delivered"]
    assert order.index("sent_back") < delivered[1] < order.index("dead_lettered") < order.index("resent") < delivered[2]
    assert [e.time_ms for e in events] == sorted(e.time_ms for e in events)
    by_kind = {k: [e for e in events if e.kind == k] for k in set(_kinds(events))}
    assert by_kind["sent"][0].msg_id == msg_id and by_kind["sent"][0].queue_offset == sent.queue_offset
    assert by_kind["sent"][0].latency_ms >= 0 and by_kind["sent"][0].keys == "order-7"
    assert [e.client_id for e in by_kind["delivered"]] == ["billing-1", "billing-1", "billing-2"]
    assert [e.attempt for e in by_kind["delivered"]] == [0, 1, 0]
    assert by_kind["delivered"][1].origin_msg_id == msg_id  # the retry names the first message
    assert by_kind["dead_lettered"][0].broker == "broker-a" and by_kind["dead_lettered"][0].group == "billing"
    assert by_kind["resent"][0].msg_id == resent.resent[0].msg_id == by_kind["delivered"][2].msg_id
    first_life = events[: order.index("dead_lettered") + 1]
    assert len({e.uniq_key for e in first_life}) == 1  # retries and dead letters keep the UNIQ_KEY
    assert by_kind["resent"][0].uniq_key == first_life[0].uniq_key  # the resent event links both

    async with open_admin(c.ns) as admin:
        by_key = await admin.trace(key="order-7", topic="orders")
        from_copy = await admin.trace(resent.resent[0].msg_id)
        elsewhere = await admin.trace(key="order-7", topic="payments")
    assert by_key.events == events  # the key finds the message, and the trace follows its ids
    assert from_copy.events == events  # the resent copy's id leads back to the dead letter's life
    assert elsewhere.events == []


async def test_tracing_off_records_nothing(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A broker with trace_enabled (so %TRACE% exists) and clients without trace: the
    topic stays empty."""
    c = await _cluster(nursery, tmp_path)
    await _trace_routed(c)
    async with open_producer(c.ns) as producer:
        sent = await producer.send("orders", b"x", keys="k")
    async with open_consumer(c.ns, "g", {"orders": "*"}, **FAST_CONSUMER) as cons:
        first = await _receive_one(cons)
        await cons.nack([first])  # on the broker, tracing is on: only its own event
    async with open_admin(c.ns) as admin:
        info = await admin.broker_info(c.brokers["broker-a"].addr)

        async def broker_wrote() -> bool:
            info = await admin.broker_info(c.brokers["broker-a"].addr)
            return info["trace_events"]["written"] == 1

        await await_until(broker_wrote, 10, "the broker's sent_back event written")
        rows = await admin.describe_topic(TRACE_TOPIC)
        trace = await admin.trace(sent.msg_ids[0])
    assert sum(q["max_offset"] for q in rows) == 1
    assert [e.kind for e in trace.events] == ["sent_back"] and trace.events[0].broker == "broker-a"
    assert info["trace_enabled"] is True


async def test_a_broker_without_trace_enabled_has_no_trace_topic_and_traced_clients_lose_nothing_else(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = await _cluster(nursery, tmp_path, trace_enabled=False)
    async with open_producer(c.ns, **TRACED) as producer:
        results = [await producer.send("orders", b"%d" % i) for i in range(20)]
        tracer = producer.tracer
        assert tracer is not None
    assert [r.queue_offset for r in results] == list(range(20))
    counts = tracer.dispatcher.counts()
    assert counts["recorded"] == 20 and counts["written"] == 0
    assert counts["failed"] + counts["dropped"] == 20  # nowhere to write: counted, the sends unharmed
    async with open_admin(c.ns) as admin:
        topics = await admin.rpc.request(c.brokers["broker-a"].addr, RequestCode.LIST_TOPICS, {"include_system": True})
    assert TRACE_TOPIC not in topics.fields["topics"]


async def test_a_full_trace_buffer_drops_and_counts_without_blocking_sends(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = await _cluster(nursery, tmp_path)
    await _trace_routed(c)
    options = {"trace": True, "trace_buffer_max_events": 5, "trace_flush_interval_ms": 60_000}
    async with open_producer(c.ns, **options) as producer:
        tracer = producer.tracer
        assert tracer is not None
        batch = [b"m%d" % i for i in range(50)]
        with trio.fail_after(10):  # the sends never wait for the trace
            result = await producer.send_batch("orders", batch)
        assert len(result.queue_offsets) == 50
        counts = tracer.dispatcher.counts()
        assert counts["recorded"] == 5 and counts["dropped"] == 45 and counts["buffered"] == 5
    assert tracer.dispatcher.counts()["written"] == 5  # the buffer was written on close
    async with open_admin(c.ns) as admin:

        async def stored() -> list[TraceEvent]:
            queues = await admin.describe_topic(TRACE_TOPIC)
            records = [r for q in queues for r in await admin.read_queue(TRACE_TOPIC, q["queue_id"], 0, 100)]
            return [e for r in records for e in decode_events(r.body)]

        events = await await_until(stored, 10, "5 trace events")
    assert [e.kind for e in events] == ["sent"] * 5 and len({e.msg_id for e in events}) == 5


async def test_clmq_message_trace_prints_the_timeline_by_id_and_by_key(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path)
    await _trace_routed(c)
    async with open_producer(c.ns, **TRACED) as producer:
        sent = await producer.send("orders", b"x", keys="cli-key")
    async with open_consumer(c.ns, "g", {"orders": "*"}, client_id="reader", **FAST_CONSUMER, **TRACED) as cons:
        await _receive_one(cons)
        cons.ack()
    async with open_admin(c.ns) as admin:

        async def acked() -> bool:
            return [e.kind for e in (await admin.trace(sent.msg_ids[0])).events] == ["sent", "delivered", "acked"]

        await await_until(acked, 10, "the acked event written")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return clmq("message", "trace", *args, "--namesrv", c.ns[0], cwd=tmp_path)

    as_json = await trio.to_thread.run_sync(run, sent.msg_ids[0], "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert [e["kind"] for e in doc["events"]] == ["sent", "delivered", "acked"]
    assert doc["events"][1]["client_id"] == "reader" and doc["events"][1]["group"] == "g"
    plain = await trio.to_thread.run_sync(run, "--key", "cli-key", "--topic", "orders")
    assert plain.returncode == 0, plain.stderr
    rows = [line.split("\t") for line in plain.stdout.splitlines()[2:]]  # title, header, then one row per event
    assert [r[2] for r in rows] == ["sent", "delivered", "acked"]
    assert rows[1][3] == "g/reader" and rows[0][4] == f"orders[0]@{sent.queue_offset}"
    missing = await trio.to_thread.run_sync(run, "--key", "no-such-key")
    assert missing.returncode == EXIT_FAILED and "no trace events" in missing.stderr
    neither = await trio.to_thread.run_sync(run)
    assert neither.returncode == EXIT_USAGE and "message id or --key" in neither.stderr


async def test_the_blocking_and_asyncio_clients_trace_and_look_up_alike(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path)
    await _trace_routed(c)

    def blocking() -> list[str]:
        with BlockingProducer(c.ns, trace=True, trace_flush_interval_ms=20) as producer:
            msg_id = producer.send("orders", b"x", keys="blocking-key").msg_ids[0]
        admin = BlockingAdmin(c.ns)
        try:
            kinds = wait_until(lambda: [e.kind for e in admin.trace(msg_id).events], 10, "the blocking send's event")
        finally:
            admin.close()
        return list(kinds)

    async def from_asyncio() -> tuple[str, list[TraceEvent]]:
        async with open_asyncio_producer(c.ns, trace=True, trace_flush_interval_ms=20) as producer:
            msg_id = (await producer.send("orders", b"y", keys="asyncio-key")).msg_ids[0]
        async with open_asyncio_admin(c.ns) as admin:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # a poll of the broker with a deadline
                trace = await admin.trace(key="asyncio-key", topic="orders")
                if trace.events:
                    break
                await asyncio.sleep(0.05)
        return msg_id, trace.events

    assert await trio.to_thread.run_sync(blocking) == ["sent"]
    msg_id, events = await trio.to_thread.run_sync(asyncio.run, from_asyncio())
    assert [(e.kind, e.msg_id) for e in events] == [("sent", msg_id)]


async def test_a_scheduled_message_is_traced_from_its_scheduled_copy_to_its_delivery(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = await _cluster(nursery, tmp_path)
    await _trace_routed(c)
    async with open_producer(c.ns, **TRACED) as producer:
        sent = await producer.send("orders", b"later", keys="later-1", delay_ms=50)
    async with open_consumer(c.ns, "g", {"orders": "*"}, client_id="reader", **FAST_CONSUMER, **TRACED) as cons:
        assert (await _receive_one(cons)).body == b"later"
        cons.ack()
    async with open_admin(c.ns) as admin:

        async def life() -> list[TraceEvent] | None:
            events = (await admin.trace(sent.msg_ids[0])).events
            return events if _kinds(events) == ["sent", "delivered", "acked"] else None

        events = await await_until(life, 10, "the scheduled message's events")
    assert events[0].topic == "%TIMER%" and events[0].msg_id == sent.msg_ids[0]  # the scheduled copy
    assert events[0].detail.startswith("scheduled for orders[0] at ")
    assert events[1].topic == "orders" and events[1].uniq_key == events[0].uniq_key  # the copy the timer delivered
