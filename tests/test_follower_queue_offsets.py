"""Queue offsets of queues whose records retention removed, on every replica.

A queue keeps numbering where it was when retention removes all its records: the
leader's queue then shows ``(5, 5)`` and its next message gets queue offset 5, never 0
again (a consumer group may have committed 5). A new follower starts its log at the
leader's log start and copies no record of such a queue, so it must learn the queue's
next offset from its leader, keep it durably (across its own restarts, clean or not),
and, once promoted, number the queue's next message 5 as the old leader would have.
"""

from __future__ import annotations

import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.service import Broker
from clmq.broker.store import Store
from clmq.common import Message
from clmq.consumequeue import ENTRY, ConsumeQueue, FileCache
from clmq.protocol import RequestCode, decode_records
from clmq.protocol.transport import RpcClient
from tests.conftest import small_config
from tests.service_helpers import Cluster
from tests.test_replication import FAST, caught_up, send_raw, start_group
from tests.waiting import await_until

SMALL = {"segment_bytes": 32 * 1024, "max_message_bytes": 8 * 1024}
EMPTIED = ("t", 1)  # the queue whose every record retention removes


async def leader_with_an_emptied_queue(c: Cluster, rpc: RpcClient) -> Broker:
    """A leader whose queue t/1 got 5 messages (a group committed 5), all removed by
    retention since (traffic on t/0 filled later segments)."""
    lead, _ = await start_group(c, 0, SMALL)
    await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 2})
    await send_raw(rpc, lead.addr, "t", [Message("t", 1, b"old %d" % i) for i in range(5)])
    for i in range(20):
        await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"%d" % i + b"." * 6000)])
    await rpc.request(lead.addr, RequestCode.COMMIT_OFFSET, {"group": "grp", "offsets": [["t", 1, 5]]})
    lead.store.catch_up()
    bases = [base for base, _, _ in lead.store.log.segments()]
    assert len(bases) >= 3
    lead.store.log.delete_before(bases[-1])  # as retention_ms would
    lead.store.apply_retention()
    assert lead.store.bounds(*EMPTIED) == (5, 5)
    return lead


async def joined(c: Cluster, lead: Broker, broker_id: int) -> Broker:
    """A new, empty follower, caught up with the leader and holding its metadata."""
    f = await c.start_broker(
        "g", key=f"g{broker_id}", broker_id=broker_id, role="follower", leader_addr=lead.addr, **{**FAST, **SMALL}
    )
    await caught_up(lead, [f])
    await await_until(lambda: f.offsets.query("grp", "t", 1) == 5, 10, "the group's offset copied")
    assert f.store.log.min_offset == lead.store.log.min_offset > 0
    return f


@asynccontextmanager
async def emptied_group(
    nursery: trio.Nursery, tmp_path: Path
) -> AsyncIterator[tuple[Cluster, RpcClient, Broker, Broker]]:
    """A leader with an emptied queue and a new follower joined to it, and a client."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        lead = await leader_with_an_emptied_queue(c, rpc)
        yield c, rpc, lead, await joined(c, lead, 1)


async def test_a_new_follower_promoted_after_retention_numbers_an_emptied_queue_on(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with emptied_group(nursery, tmp_path) as (c, rpc, _lead, f):
        assert f.store.bounds(*EMPTIED) == (5, 5)  # as the leader shows it
        assert f.store.log.queue_offset_table().get(EMPTIED) == 5
        await c.stop_broker("g0")
        promoted = await rpc.request(f.addr, RequestCode.PROMOTE, {"force": True})
        assert promoted.fields["role"] == "leader"
        reply = await send_raw(rpc, f.addr, "t", [Message("t", 1, b"new")])
        assert reply.error_code == 0, reply
        f.store.catch_up()
        assert f.store.bounds(*EMPTIED) == (5, 6)
        # What a consumer of the group asks: its committed offset and the queue's bounds, then a pull from there.
        asked = await rpc.request(f.addr, RequestCode.QUERY_QUEUE_OFFSETS, {"group": "grp", "queues": [["t", 1]]})
        assert asked.fields["offsets"] == [[5, 5, 6]]
        pulled = await rpc.request(
            f.addr, RequestCode.PULL_MESSAGE, {"topic": "t", "queue_id": 1, "offset": 5, "max_messages": 10}
        )
        assert [(r.queue_offset, bytes(r.body)) for r in decode_records(pulled.body)] == [(5, b"new")]
        await rpc.aclose()


async def test_a_follower_keeps_an_emptied_queues_offset_across_its_restart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with emptied_group(nursery, tmp_path) as (c, rpc, lead, f):
        await c.stop_broker("g1")
        f = await c.start_broker(
            "g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **{**FAST, **SMALL}
        )
        assert f.store.bounds(*EMPTIED) == (5, 5)
        assert f.store.log.queue_offset_table().get(EMPTIED) == 5
        await rpc.aclose()


def test_a_store_keeps_an_emptied_queues_offset_across_a_crash(tmp_path: Path) -> None:
    """The leader's own case: an unclean open must not take a queue whose records
    retention removed for damage and number it from 0 again."""
    config = small_config(tmp_path, segment_bytes=32 * 1024, max_message_bytes=4096, cq_entries_per_file=16)
    s = Store.open(config)
    s.create_topic("t", 2)
    assert s.put_batch([Message("t", 1, b"old %d" % i) for i in range(5)]).ok
    for i in range(40):
        assert s.put(Message("t", 0, b"%d" % i + b"." * 2000)).ok
    s.catch_up()
    s.checkpoint(sync=True)
    s.log.delete_before([base for base, _, _ in s.log.segments()][-1])
    s.apply_retention()
    s.checkpoint(sync=True)
    assert s.bounds(*EMPTIED) == (5, 5)
    s.abandon()
    s = Store.open(config)
    try:
        assert s.bounds(*EMPTIED) == (5, 5)
        assert s.put(Message("t", 1, b"new")).queue_offsets == [5]
    finally:
        s.close()


async def test_a_follower_away_longer_than_retention_continues_its_queues_where_the_leader_does(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """An existing follower that held the queue's first 3 records (0..2) restarts its log
    at the leader's log start: it must continue the queue at 5, not 3 (a hole of 3..4),
    and numbers of queues it never loaded since its own restart must survive too."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        lead, (f,) = await start_group(c, 1, SMALL, replica_lag_max_ms=300)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 3})
        await send_raw(rpc, lead.addr, "t", [Message("t", 1, b"old %d" % i) for i in range(3)])
        await send_raw(rpc, lead.addr, "t", [Message("t", 2, b"kept %d" % i) for i in range(4)])
        await caught_up(lead, [f])
        await await_until(lambda: f.store.bounds("t", 2) == (0, 4), 10, "the follower's queues built")
        await c.stop_broker("g1")
        leader = lead.replica.leader
        assert leader is not None
        # Out of the in-sync set, so that the leader dispatches what the follower misses.
        await await_until(lambda: leader.isr.size() == 1, 10, "the follower out of the in-sync set")
        await send_raw(rpc, lead.addr, "t", [Message("t", 1, b"missed %d" % i) for i in range(2)])
        for i in range(20):
            await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"%d" % i + b"." * 6000)])
        lead.store.catch_up()
        lead.store.log.delete_before([base for base, _, _ in lead.store.log.segments()][-1])
        lead.store.apply_retention()
        assert lead.store.bounds(*EMPTIED) == (5, 5)
        f = await c.start_broker(
            "g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **{**FAST, **SMALL}
        )
        await caught_up(lead, [f])
        assert f.store.log.min_offset == lead.store.log.min_offset
        table = f.store.log.queue_offset_table()
        assert (table.get(EMPTIED), table.get(("t", 2))) == (5, 4)
        assert f.store.bounds(*EMPTIED) == lead.store.bounds(*EMPTIED) == (5, 5)
        assert f.store.bounds("t", 2) == lead.store.bounds("t", 2) == (4, 4)
        await rpc.aclose()


@settings(max_examples=60, deadline=None)
@given(
    per_file=st.integers(1, 8),
    held=st.integers(0, 20),
    flushed=st.booleans(),
    ahead=st.integers(0, 20),
)
def test_a_queue_continued_at_an_offset_keeps_it_when_opened_again(
    per_file: int, held: int, flushed: bool, ahead: int
) -> None:
    """Any file size, any number of entries before (flushed or only in memory), any
    offset at or past the end: the queue ends there, the same once opened again from
    its files (start_at wrote them: no close first), and its next entry lands there."""
    with tempfile.TemporaryDirectory() as d:
        files = FileCache(8)
        cq = ConsumeQueue(Path(d) / "t" / "1", "t", 1, per_file, files)
        cq.append(0, b"".join(ENTRY.pack(100 * i, 50, 0) for i in range(held)))
        if flushed:
            cq.flush()
        target = held + ahead
        assert cq.start_at(target) == (ahead > 0)
        assert cq.next_offset == target
        if not ahead:
            cq.close()  # nothing to continue: only what was appended, once written
        opened = ConsumeQueue(Path(d) / "t" / "1", "t", 1, per_file, files)
        assert opened.bounds(log_min=10**6) == (target, target)  # every record retention removed
        assert opened.append(target, ENTRY.pack(10**6, 50, 0)) == 1
        assert opened.bounds(log_min=10**6) == (target, target + 1)
        opened.close()
        assert ConsumeQueue(Path(d) / "t" / "1", "t", 1, per_file, files).bounds(log_min=10**6) == (target, target + 1)
        files.close()


@pytest.mark.parametrize("nxt", [1, 5, 16, 17, 40])
def test_a_continued_queue_of_a_restarted_log_survives_a_crash(tmp_path: Path, nxt: int) -> None:
    """A follower's store: its log restarted at a leader's log start, a queue continued
    at ``nxt`` (16 entries per file: at, just past and between file starts), then a
    crash before any checkpoint: the queue is still there, and numbers on from ``nxt``."""
    config = small_config(tmp_path, segment_bytes=32 * 1024, max_message_bytes=4096, cq_entries_per_file=16)
    s = Store.open(config)
    s.create_topic("t", 2)
    s.restart_at(64 * 1024)
    assert s.continue_queues([("t", 1, nxt)]) == 1
    assert s.continue_queues([("t", 1, nxt - 1)]) == 0  # never backwards
    assert s.put(Message("t", 0, b"other queue")).ok
    s.abandon()
    s = Store.open(config)
    try:
        assert s.bounds(*EMPTIED) == (nxt, nxt)
        assert s.put(Message("t", 1, b"next")).queue_offsets == [nxt]
        s.catch_up()
        assert s.bounds(*EMPTIED) == (nxt, nxt + 1)
    finally:
        s.close()
