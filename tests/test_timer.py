"""Scheduled messages: the wheel's invariants, delivery on time, cancel, the checks at
the door, and exactly once across a kill -9 of a real broker process."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.service.timer._wheel import PAGE_ENTRIES, TimerWheel
from clmq.client import Admin, MessageQueue, Record, open_admin, open_consumer, open_producer
from clmq.client.producer._scheduled import encode_scheduled
from clmq.common import PROP_DELIVER_AT, PROP_TIMER_SRC, TIMER_TOPIC, Message, encode_properties, pack_parts
from clmq.protocol import ErrorCode, RequestCode, encode_batch
from clmq.protocol.transport import RpcError
from tests.crash_broker import launch, reap, wait_ready
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until

TICK = {"timer_tick_ms": 20, "timer_checkpoint_interval_ms": 200}


# ---------------------------------------------------------------- the wheel
@given(st.lists(st.integers(0, 40), max_size=300), st.integers(0, 10))
@settings(max_examples=200, deadline=None)
def test_the_wheel_gives_every_offset_once_at_or_after_its_second(dues: list[int], start: int) -> None:
    wheel = TimerWheel(window_s=16, first_second=start)
    for q, due in enumerate(dues):
        wheel.add(q, due)
    taken: dict[int, int] = {}
    while len(taken) < len(dues):
        assert wheel.next_second < start + 100, "entries left behind"  # else a lost entry would loop forever
        second = wheel.next_second
        wheel.skip_empty(second + 1)
        if wheel.next_second != second:
            continue
        for q in wheel.take():
            assert q not in taken, f"offset {q} taken twice"
            taken[q] = second
    for q, due in enumerate(dues):
        assert taken[q] == max(due, start), f"offset {q} due {due} taken at {taken[q]}"
    assert wheel.pending == 0 and not wheel.overflow and wheel.memory_bytes() == 8 * 16


@given(st.lists(st.integers(0, 40), max_size=300), st.integers(0, 10), st.integers(0, 3 * PAGE_ENTRIES))
@settings(max_examples=200, deadline=None)
def test_adding_many_at_once_is_adding_them_one_by_one(dues: list[int], start: int, base: int) -> None:
    one, many = TimerWheel(window_s=16, first_second=start), TimerWheel(window_s=16, first_second=start)
    for q, due in enumerate(dues):
        one.add(base + q, due)
    many.add_many(np.arange(base, base + len(dues), dtype=np.int64), np.array(dues, dtype=np.int64))
    assert (one.pending, sorted(one.overflow)) == (many.pending, sorted(many.overflow))
    for _ in range(60):
        assert one.take() == many.take()
    assert one.memory_bytes() == many.memory_bytes()


def test_a_page_of_links_goes_once_none_of_it_is_pending() -> None:
    wheel = TimerWheel(window_s=10, first_second=0)
    wheel.add(1, 1)
    wheel.add(PAGE_ENTRIES + 1, 2)
    assert wheel.memory_bytes() == 80 + 2 * 8 * PAGE_ENTRIES
    wheel.skip_empty(1)
    assert wheel.take() == [1]
    assert wheel.memory_bytes() == 80 + 8 * PAGE_ENTRIES


# ---------------------------------------------------------------- a live broker
async def _cluster(nursery: trio.Nursery, root: Path, **settings: object) -> Cluster:
    c = Cluster(nursery, root)
    await c.start_nameserver()
    await c.start_broker(**{**TICK, **settings})
    await c.create_topic("t", 2)
    return c


async def _receive(c: Cluster, group: str, n: int, timeout_s: float = 15) -> list[tuple[Record, float]]:
    got: list[tuple[Record, float]] = []
    async with open_consumer(c.ns, group, {"t": "*"}, **FAST_CONSUMER) as consumer:
        with trio.fail_after(timeout_s):
            while len(got) < n:
                got += [(r, time.time()) for r in await consumer.receive()]
    return got


async def test_delayed_messages_arrive_on_time_in_their_queue(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path)
    async with open_producer(c.ns) as producer:
        sent = {}
        for i, delay in enumerate((300, 600, 900, 1200, 1500)):
            r = await producer.send("t", b"m%d" % i, delay_ms=delay, tags="T", keys="k%d" % i)
            sent[b"m%d" % i] = r
        now_ms = int(time.time() * 1000)
        r = await producer.send("t", b"at", deliver_at=now_ms + 400)
        sent[b"at"] = r
    got = await _receive(c, "g", len(sent))
    assert sorted(r.body for r, _ in got) == sorted(sent)
    for record, arrived in got:
        due = int(record.properties[PROP_DELIVER_AT])
        late_ms = arrived * 1000 - due
        assert -5 <= late_ms <= 700, f"{record.body!r} due {due} arrived {late_ms:.0f} ms late"
        assert record.queue_id == sent[record.body].queue.queue_id and record.topic == "t"
        assert PROP_TIMER_SRC in record.properties
        if record.body.startswith(b"m"):
            assert record.tags == "T" and record.keys.startswith("k")
    timer = next(iter(c.brokers.values())).handlers.timer
    await await_until(lambda: timer.saved.pending_from == len(sent), 5, "a checkpoint past every delivered message")


async def test_a_cancelled_message_is_never_delivered(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path, timer_cancel_margin_ms=300)
    async with open_producer(c.ns) as producer, open_admin(c.ns) as admin:
        doomed = await producer.send("t", b"doomed", delay_ms=1500)
        kept = await producer.send("t", b"kept", delay_ms=1600)
        soon = await producer.send("t", b"soon", delay_ms=100)
        assert await _cancel(admin, doomed.msg_ids[0]) == "cancelled"
        await await_until(lambda: _cancelled_known(admin, c), 5, "the timer to read the cancel marker")
        assert await _cancel(admin, doomed.msg_ids[0]) == "already_cancelled"
        assert await _cancel(admin, soon.msg_ids[0]) == "too_late"
        assert await _cancel(admin, kept.msg_ids[0].split("@")[0] + "@0000000000000001") == "not_found"
    got = await _receive(c, "g", 2)
    assert sorted(r.body for r, _ in got) == [b"kept", b"soon"]
    await await_until(lambda: _info(admin_addr(c), "timer_cancelled"), 5, "the cancelled message's time to pass")


def admin_addr(c: Cluster) -> str:
    return next(iter(c.brokers.values())).addr


async def _info(addr: str, field: str) -> int:
    async with open_admin(None, broker_addrs=[addr]) as admin:
        reply = await admin.rpc.request(addr, RequestCode.BROKER_INFO, {})
    value: int = reply.fields[field]
    return value


async def _cancel(admin: Admin, msg_id: str) -> str:
    return (await admin.cancel_message(msg_id)).state


async def _cancelled_known(admin: Admin, c: Cluster) -> bool:
    broker = next(iter(c.brokers.values()))
    return bool(broker.handlers.timer.state and broker.handlers.timer.state.cancelled)


@pytest.mark.parametrize("why", ["no real topic", "unknown topic", "tags differ", "too far", "bad queue", "huge tags"])
async def test_a_malformed_scheduled_message_is_refused(nursery: trio.Nursery, tmp_path: Path, why: str) -> None:
    c = await _cluster(nursery, tmp_path, timer_max_delay_ms=60_000)
    due = int(time.time() * 1000) + 1000
    props = {PROP_DELIVER_AT: str(due), "REAL_TOPIC": "t", "REAL_QID": "1", "REAL_TAGS": ""}
    tags = str(due)
    if why == "no real topic":
        del props["REAL_TOPIC"]
    elif why == "unknown topic":
        props["REAL_TOPIC"] = "nope"
    elif why == "tags differ":
        tags = "x"
    elif why == "too far":
        props[PROP_DELIVER_AT] = tags = str(due + 120_000)
    elif why == "huge tags":  # the delivered message could not be stored: refused now, not at its time
        props["REAL_TAGS"] = "x" * 70_000
    else:
        props["REAL_QID"] = "7"
    body = encode_batch([Message(TIMER_TOPIC, 0, b"x", tags, "", props)])
    addr = admin_addr(c)
    async with open_admin(None, broker_addrs=[addr]) as admin:
        with pytest.raises(RpcError) as e:
            await admin.rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": TIMER_TOPIC}, body)
    assert e.value.code in (ErrorCode.INVALID_MESSAGE, ErrorCode.TOPIC_NOT_FOUND, ErrorCode.INVALID_QUEUE_ID)
    pending = await await_until(lambda: _pending_known(addr), 5, "the timer to start")
    assert pending == [0]


async def _pending_known(addr: str) -> list[int] | None:
    pending = await _info(addr, "timer_pending")
    return [pending] if pending >= 0 else None


@pytest.mark.parametrize("extra", [{"TIMER_SRC": "0"}, {"CANCEL_OF": "0"}, {"REAL_TOPIC": "nope"}, {"REAL_QID": "9"}])
async def test_a_message_sharing_a_checked_lead_cannot_smuggle_routing_properties(
    nursery: trio.Nursery, tmp_path: Path, extra: dict[str, str]
) -> None:
    """The broker checks a batch's shared properties once; a later message that starts
    with them but adds its own routing (or the broker's marks) is refused."""
    c = await _cluster(nursery, tmp_path)
    addr = admin_addr(c)
    due = int(time.time() * 1000) + 60_000
    real = MessageQueue("t", "broker-a", 1, addr)
    good = encode_scheduled([Message("t", 0, b"ok")], real, due)
    lead = encode_properties({PROP_DELIVER_AT: str(due), "REAL_TOPIC": "t", "REAL_QID": "1"})
    props = lead + encode_properties({"REAL_TAGS": "", **extra})
    bad = b"".join(pack_parts(0, 0, 0, str(due).encode(), b"", props, b"bad"))
    async with open_admin(None, broker_addrs=[addr]) as admin:
        with pytest.raises(RpcError) as e:
            await admin.rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": TIMER_TOPIC}, good + bad)
    assert e.value.code in (ErrorCode.INVALID_MESSAGE, ErrorCode.TOPIC_NOT_FOUND, ErrorCode.INVALID_QUEUE_ID)
    assert "message 1" in str(e.value)


async def test_system_topics_are_hidden_from_listings(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path)
    async with open_producer(c.ns) as producer:
        await producer.send("t", b"x", delay_ms=50)
    addr = admin_addr(c)
    async with open_admin(None, broker_addrs=[addr]) as admin:
        plain = await admin.rpc.request(addr, RequestCode.LIST_TOPICS, {})
        every = await admin.rpc.request(addr, RequestCode.LIST_TOPICS, {"include_system": True})
    assert set(plain.fields["topics"]) == {"t"}
    assert set(every.fields["topics"]) == {"t", TIMER_TOPIC}


async def test_a_timer_that_cannot_save_says_so_and_still_delivers_exactly_once(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    (tmp_path / "broker-a").mkdir()
    (tmp_path / "broker-a" / "timer").write_text("a file where the timer's directory goes")
    c = await _cluster(nursery, tmp_path)
    n = 20
    async with open_producer(c.ns) as producer:
        for i in range(n):
            await producer.send("t", b"%d" % i, delay_ms=100 + 100 * i)
    addr = admin_addr(c)
    failure = await await_until(lambda: _failure(addr), 10, "the timer to report that it cannot save")
    assert "timer" in failure
    got = await _receive(c, "g", n)
    with trio.move_on_after(1.0):  # a second copy of any would come now
        got += await _receive(c, "g", 1, timeout_s=2)
    assert sorted(r.body for r, _ in got) == sorted(b"%d" % i for i in range(n))


async def _failure(addr: str) -> str:
    async with open_admin(None, broker_addrs=[addr]) as admin:
        reply = await admin.rpc.request(addr, RequestCode.BROKER_INFO, {})
    failure: str = reply.fields["timer_failure"]
    return failure


async def test_retention_keeps_a_scheduled_message_until_it_is_delivered(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path, segment_bytes=64 * 1024, max_message_bytes=8 * 1024)
    broker = next(iter(c.brokers.values()))
    async with open_producer(c.ns) as producer:
        await producer.send("t", b"filler")
        scheduled = await producer.send("t", b"later", delay_ms=1500)
        for _ in range(8):  # several segments after it
            await producer.send_batch("t", [b"x" * 4000] * 16)
    await await_until(lambda: broker.handlers.timer.pending == 1, 5, "the message in the timer")
    far_future = time.time() + 10**6  # every segment is past retention_ms then
    deleted = await trio.to_thread.run_sync(broker.store.apply_retention, far_future)
    assert broker.store.log.min_offset <= scheduled.commitlog_offsets[0], "retention deleted a pending message"
    assert deleted == 0  # the scheduled record is in the first segment
    got = await _receive(c, "g", 1 + 16 * 8 + 1)
    assert b"later" in [record.body for record, _ in got]
    await await_until(lambda: broker.handlers.timer.pending == 0, 5, "the message delivered")
    assert await trio.to_thread.run_sync(broker.store.apply_retention, far_future) > 0  # now it may go


async def test_a_cancel_holds_while_the_timer_works_through_a_backlog(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The timer reads new entries and cancels before every batch: a message cancelled
    while a long backlog is being delivered is not delivered with it."""
    c = await _cluster(nursery, tmp_path, timer_deliver_batch_messages=10, timer_cancel_margin_ms=500)
    timer = next(iter(c.brokers.values())).handlers.timer
    n = 20_000
    async with open_producer(c.ns) as producer, open_admin(c.ns) as admin:
        due = int(time.time() * 1000) + 300
        for start in range(0, n, 1000):
            await producer.send_batch("t", [b"b%d" % i for i in range(start, start + 1000)], deliver_at=due)
        await await_until(lambda: timer.stats.delivered > 0, 10, "the backlog's delivery to begin")
        doomed = await producer.send("t", b"doomed", delay_ms=1500)
        assert timer.stats.delivered < n - 2000, "the backlog was delivered too fast to test anything"
        assert (await admin.cancel_message(doomed.msg_ids[0])).state == "cancelled"
    await await_until(
        lambda: timer.stats.delivered >= n and timer.stats.cancelled == 1, 60, "the backlog and the cancel"
    )
    assert timer.stats.delivered == n


# ---------------------------------------------------------------- kill -9
def _config(root: Path) -> Path:
    conf = root / "broker.toml"
    conf.write_text(
        f'[broker]\nbroker_name = "timer"\nlisten_port = 0\ndata_dir = "{root / "data"}"\n'
        f"timer_tick_ms = 20\ntimer_checkpoint_interval_ms = 100\n"
    )
    return conf


async def test_scheduled_messages_survive_kill_9_delivered_exactly_once(tmp_path: Path) -> None:
    """Messages due before, during and after a kill -9 (and the restart) each arrive once;
    none early; those due while the broker was down arrive promptly after it starts."""
    conf, log = _config(tmp_path), tmp_path / "broker.log"
    proc = await launch(conf, log)
    n, spread_ms = 300, 3000
    try:
        addr = await wait_ready(proc, log)
        async with open_admin(None, broker_addrs=[addr]) as admin:
            await admin.create_topic("t", 2)
        async with open_producer(None, broker_addrs=[addr]) as producer:
            start = int(time.time() * 1000)
            for i in range(n):
                await producer.send("t", b"%d" % i, deliver_at=start + 300 + i * spread_ms // n)
        # The kill lands in the middle of the schedule: some delivered, some not.
        await await_until(lambda: _delivered_at_least(addr, n // 3), 10, "a third of them delivered")
    finally:
        await reap(proc)
    await trio.sleep(1.0)  # some fall due while the broker is down (the fault being tested: time passing)
    proc = await launch(conf, log)
    addr = await wait_ready(proc, log)
    restarted = time.time() * 1000
    try:
        got = await _read_all(addr, n)
    finally:
        await reap(proc)
    bodies = [r.body for r, _ in got]
    assert sorted(bodies) == sorted(b"%d" % i for i in range(n)), (
        f"{len(bodies)} delivered, {len(set(bodies))} distinct"
    )
    for record, _arrived in got:
        due = int(record.properties[PROP_DELIVER_AT])
        delivered = record.store_timestamp_ms
        assert delivered >= due - 5, f"{record.body!r} delivered {due - delivered} ms early"
        assert delivered <= max(due, restarted) + 1500, (
            f"{record.body!r} delivered {delivered - max(due, restarted)} ms late"
        )


async def _read_all(addr: str, n: int) -> list[tuple[Record, float]]:
    got: list[tuple[Record, float]] = []
    async with open_consumer(None, "g", {"t": "*"}, broker_addrs=[addr], **FAST_CONSUMER) as consumer:
        with trio.move_on_after(20):
            while len(got) < n:
                got += [(r, time.time()) for r in await consumer.receive()]
        with trio.move_on_after(1.0):  # anything delivered twice would come now
            got += [(r, time.time()) for r in await consumer.receive()]
    return got


async def test_many_messages_due_at_the_same_moment_survive_a_kill_mid_delivery_once(tmp_path: Path) -> None:
    """20,000 messages due at one millisecond, delivered 10 per batch with a checkpoint
    every 50 ms; kill -9 while they are being delivered: after the restart each is in
    its queue once (a snapshot never claims a due time it has only partly delivered)."""
    conf, log = _config(tmp_path), tmp_path / "broker.log"
    conf.write_text(
        conf.read_text().replace("timer_checkpoint_interval_ms = 100", "timer_checkpoint_interval_ms = 50")
        + "timer_deliver_batch_messages = 10\n"
    )
    proc = await launch(conf, log)
    n = 20_000
    try:
        addr = await wait_ready(proc, log)
        async with open_admin(None, broker_addrs=[addr]) as admin:
            await admin.create_topic("t", 2)
        async with open_producer(None, broker_addrs=[addr]) as producer:
            due = int(time.time() * 1000) + 1500
            await producer.send("t", b"later", delay_ms=600_000)  # pending below the rest: a start reads them all
            await producer.send("t", b"first", deliver_at=due - 1)  # the first batch: it, then part of the rest
            for start in range(0, n, 500):
                await producer.send_batch("t", [b"%d" % i for i in range(start, start + 500)], deliver_at=due)
        await await_until(lambda: _delivered_at_least(addr, 2000), 20, "part of the messages delivered")
        assert await _info(addr, "timer_delivered") < n, "all delivered before the kill: the test missed its moment"
    finally:
        await reap(proc)
    proc = await launch(conf, log)
    try:
        addr = await wait_ready(proc, log)
        got = await _read_all(addr, n + 1)
    finally:
        await reap(proc)
    bodies = sorted(r.body for r, _ in got)
    assert bodies == sorted([b"first", *(b"%d" % i for i in range(n))]), f"{len(bodies)} for {n + 1}"


async def _delivered_at_least(addr: str, n: int) -> bool:
    return await _info(addr, "timer_delivered") >= n


async def test_deliveries_wait_for_a_full_lane_and_lose_nothing(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Producers keep the append lane at its byte limit while scheduled messages fall
    due: the timer's appends are refused (busy) and tried again; every one arrives once."""
    c = await _cluster(nursery, tmp_path, max_inflight_produce_bytes=4096)
    n = 300
    async with open_producer(c.ns) as producer:
        for start in range(0, n, 50):
            await producer.send_batch("t", [b"s%d" % i for i in range(start, start + 50)], delay_ms=400)
    flooding = trio.Event()

    async def flood() -> None:
        async with open_producer(c.ns, retries=50, retry_budget_ms=60_000) as p:
            while not flooding.is_set():
                futures = [await p.submit("t", b"f" * 1000) for _ in range(64)]
                for f in futures:
                    with contextlib.suppress(Exception):
                        await f.wait()

    async with trio.open_nursery() as n2:
        n2.start_soon(flood)
        timer = next(iter(c.brokers.values())).handlers.timer
        await await_until(lambda: timer.stats.delivered >= n, 30, "every scheduled message delivered")
        flooding.set()
    got = []
    async with open_consumer(c.ns, "g", {"t": "*"}, **FAST_CONSUMER) as consumer:
        with trio.move_on_after(3):
            while sum(1 for r in got if r.body.startswith(b"s")) < n:
                got += await consumer.receive()
    scheduled = sorted(r.body for r in got if r.body.startswith(b"s"))
    assert scheduled == sorted(b"s%d" % i for i in range(n))


# ---------------------------------------------------------------- a million pending
def _rss_anon_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/<pid>/status")


@pytest.mark.slow
async def test_a_million_scheduled_messages_cost_bounded_broker_memory(tmp_path: Path) -> None:
    """1,000,000 messages pending in a real broker process: its anonymous memory grows by
    well under the 64 B per message of the wheel's links and slots (no object per
    message); the timer's own count agrees."""
    conf, log = _config(tmp_path), tmp_path / "broker.log"
    proc = await launch(conf, log)
    n, per_batch = 1_000_000, 2000
    try:
        addr = await wait_ready(proc, log)
        async with open_admin(None, broker_addrs=[addr]) as admin:
            await admin.create_topic("t", 4)
        async with open_producer(None, broker_addrs=[addr]) as producer:
            await producer.send("t", b"warm", delay_ms=600_000)  # the timer topic and its first pages exist
            await await_until(lambda: _pending_is(addr, 1), 10, "the first scheduled message in the timer")
            before = _rss_anon_bytes(proc.pid)

            async def sender(k: int) -> None:
                for start in range(k * per_batch, n, 4 * per_batch):
                    await producer.send_batch(
                        "t", [b"%09d" % i for i in range(start, start + per_batch)], delay_ms=600_000 + start // 100
                    )

            async with trio.open_nursery() as nursery:
                for k in range(4):
                    nursery.start_soon(sender, k)
        await await_until(lambda: _pending_is(addr, n + 1), 120, f"{n + 1} messages pending in the timer")
        grown = _rss_anon_bytes(proc.pid) - before
        timer_bytes = await _info(addr, "timer_memory_bytes")
    finally:
        await reap(proc)
    assert timer_bytes / n <= 64, f"the timer holds {timer_bytes / n:.1f} B per pending message"
    assert grown / n <= 128, f"the broker's anonymous memory grew {grown / n:.1f} B per pending message"


async def _pending_is(addr: str, n: int) -> bool:
    return await _info(addr, "timer_pending") >= n
