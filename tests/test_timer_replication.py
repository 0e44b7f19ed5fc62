"""Scheduled messages across a fail-over: the follower adopts its leader's timer
checkpoint; promoted, it delivers what is left, each message once, none early."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from clmq.client import open_producer
from clmq.common import PROP_DELIVER_AT, TIMER_TOPIC
from clmq.protocol import RequestCode
from clmq.protocol.transport import RpcClient
from tests.service_helpers import Cluster
from tests.test_replication import caught_up, start_group
from tests.waiting import await_until

TIMER = {"timer_tick_ms": 20, "timer_checkpoint_interval_ms": 100}


async def test_a_promoted_follower_delivers_the_rest_once(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, (f,) = await start_group(c, 1, common=TIMER)
    await c.create_topic("t", 2)
    n, start = 60, int(time.time() * 1000)
    async with open_producer(c.ns) as producer:
        for i in range(n):
            await producer.send("t", b"%d" % i, deliver_at=start + 500 + i * 50)  # due over 0.5-3.5 s
    await await_until(lambda: lead.handlers.timer.stats.delivered >= n // 4, 10, "a quarter delivered by the leader")
    await await_until(lambda: f.handlers.timer.saved.done_ms >= start + 500, 10, "the follower adopting a checkpoint")
    assert f.handlers.timer.pending == -1, "a follower's timer does not deliver"
    await caught_up(lead, [f])
    await c.stop_broker("g0")
    async with trio.open_nursery() as rpc_nursery:
        rpc = RpcClient(rpc_nursery)
        promoted = await rpc.request(f.addr, RequestCode.PROMOTE, {"force": True})
        assert promoted.fields["role"] == "leader"
        await rpc.aclose()

    def delivered() -> list[tuple[bytes, int, int]]:
        out = []
        for q in range(2):
            for m in f.store.get("t", q, 0, 1000).messages:
                out.append((m.body, int(m.properties[PROP_DELIVER_AT]), m.store_timestamp_ms))
        return out

    await await_until(lambda: len(delivered()) >= n, 15, f"all {n} delivered on the new leader")
    await trio.sleep(0.5)  # a second copy of any would be stored by now
    got = delivered()
    assert sorted(b for b, _, _ in got) == sorted(b"%d" % i for i in range(n)), f"{len(got)} stored for {n}"
    assert all(stored >= due - 5 for _, due, stored in got), "delivered early"
    assert f.store.queue_exists(TIMER_TOPIC, 0)


async def test_a_follower_s_retention_keeps_the_scheduled_messages_its_leader_has_pending(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, (f,) = await start_group(c, 1, common={**TIMER, "segment_bytes": 64 * 1024, "max_message_bytes": 8 * 1024})
    await c.create_topic("t", 1)
    async with open_producer(c.ns) as producer:
        scheduled = await producer.send("t", b"next week", delay_ms=600_000)
        for _ in range(8):  # segments after it
            await producer.send_batch("t", [b"x" * 4000] * 16)
    await await_until(lambda: lead.handlers.timer.pending == 1, 5, "the message pending on the leader")
    await caught_up(lead, [f])
    far_future = time.time() + 10**6
    await trio.to_thread.run_sync(f.store.apply_retention, far_future)
    assert f.store.log.min_offset <= scheduled.commitlog_offsets[0], (
        "the follower's retention deleted a pending message"
    )
