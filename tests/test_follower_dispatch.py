"""Consume queues when retention removes records the dispatcher has not reached yet.

A broker's dispatcher builds queue entries only below the log's confirmed offset (on a
leader: what its in-sync followers hold; on a follower: what its leader confirmed), and
a round runs in its own thread: it can be behind the log's end for a while. Retention
(a leader's own, or a follower's following its leader's) may remove segments in that
time. The queue offsets of those records then become hole markers. A queue's bounds
must not depend on that: the first offset is the first record still in the log, on a
broker that dispatched the records before they went as on one that never had them (a
new follower copying from the leader's log start). CI once saw them differ
(test_replication's retention test: the leader's queue t/0 had a hole at 11..15, so its
first offset was 11, the new follower's 16).
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.service import Broker
from clmq.broker.store import Store
from clmq.commitlog import whole_prefix
from clmq.common import Message
from clmq.protocol import RequestCode
from clmq.protocol.transport import RpcClient
from tests.conftest import small_config
from tests.service_helpers import Cluster
from tests.test_replication import FAST, caught_up, send_raw, start_group
from tests.waiting import await_until, wait_until

SEGMENT = 16 * 1024


def expected_queues(store: Store, topic: str, queues: int) -> dict[int, list[tuple[int, bytes]]]:
    """Every queue's (queue offset, body) of the records still in the log, from the log itself."""
    out: dict[int, list[tuple[int, bytes]]] = {q: [] for q in range(queues)}
    for rec in store.log.iter_records():
        out[rec.queue_id].append((rec.queue_offset, rec.body))
    return out


def dispatched_all(broker: Broker) -> bool:
    """The broker's queues hold its whole log (its confirmed offset, which waits for
    its followers' reports, is at the log's end, and so is its dispatcher)."""
    return broker.store.dispatcher.dispatched_offset == broker.store.log.write_offset


def queue_contents(store: Store, topic: str, q: int) -> tuple[tuple[int, int], list[tuple[int, bytes]]]:
    """The queue's bounds and every (queue offset, body) read from its first offset on."""
    lo, hi = store.bounds(topic, q)
    got: list[tuple[int, bytes]] = []
    offset = lo
    while offset < hi:
        result = store.get(topic, q, offset, 32)
        got += [(m.queue_offset, m.body) for m in result.messages]
        assert result.next_offset > offset, (offset, result)
        offset = result.next_offset
    return (lo, hi), got


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(50, 6000), min_size=8, max_size=40),
    queues=st.integers(1, 3),
    held=st.floats(0, 1),
    dropped=st.integers(1, 3),
)
def test_a_queue_starts_at_its_first_record_in_the_log_when_retention_overtook_the_dispatcher(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], queues: int, held: float, dropped: int
) -> None:
    """Records are dispatched up to a confirmed offset held anywhere in the log, then
    retention removes segments past it, then the rest is dispatched: every queue's
    bounds start at its first record still in the log, and reads from there give
    exactly the log's records of that queue."""
    cfg = small_config(tmp_path_factory.mktemp("s"), segment_bytes=SEGMENT, max_message_bytes=8 * 1024)
    with Store.open(cfg) as s:
        s.create_topic("t", queues)
        ends = []
        for i, size in enumerate(sizes):
            assert s.put_batch([Message("t", i % queues, (b"%d." % i).ljust(size, b"x"))]).ok
            ends.append(s.log.write_offset)
        s.log.set_confirmed_offset(ends[int(held * (len(ends) - 1))])  # a replica not yet heard from
        s.catch_up()
        bases = [base for base, _, _ in s.log.segments()]
        s.log.delete_before(bases[min(dropped, len(bases) - 1)])  # never the active segment
        s.log.set_confirmed_offset(None)
        s.catch_up()
        want = expected_queues(s, "t", queues)
        for q in range(queues):
            nxt = s.max_offset("t", q)
            first = want[q][0][0] if want[q] else nxt
            assert queue_contents(s, "t", q) == ((first, nxt), want[q]), q


async def test_a_leader_whose_dispatcher_was_behind_its_retention_has_the_bounds_of_a_new_follower(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """test_replication's retention test with the race CI lost made certain: the
    leader's dispatcher is held mid-segment while its retention removes that segment.
    The leader, its old follower and a new follower that copies from the leader's log
    start then give every queue the same bounds and the same records."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    small = {"segment_bytes": 128 * 1024, "max_message_bytes": 32 * 1024}
    lead, (f,) = await start_group(c, 1, small)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 2})
        for i in range(40):
            if i == 22:  # the middle of the second segment: the leader's dispatcher stops here
                await caught_up(lead, [f])
                await await_until(lambda: dispatched_all(lead), 10, "the leader's dispatch")
                lead.store.dispatcher._round_lock.acquire()  # a round's lock: its thread waits for it
            await send_raw(rpc, lead.addr, "t", [Message("t", i % 2, b"%d" % i + b"." * 8000)])
        try:
            await caught_up(lead, [f])
            bases = [base for base, _, _ in lead.store.log.segments()]
            assert lead.store.log.delete_before(bases[2]) == 2
        finally:
            lead.store.dispatcher._round_lock.release()
            lead.store.dispatcher.wake()
        await send_raw(rpc, lead.addr, "t", [Message("t", 0, b"after retention")])
        await await_until(lambda: f.store.log.min_offset == bases[2], 10, "the follower's retention")
        new = await c.start_broker(
            "g", key="g5", broker_id=5, role="follower", leader_addr=lead.addr, **{**FAST, **small}
        )
        brokers = [lead, f, new]
        await caught_up(lead, [f, new])
        await await_until(lambda: dispatched_all(lead), 10, "the leader's dispatch")
        ends = [lead.store.max_offset("t", q) for q in range(2)]
        await await_until(
            lambda: all([b.store.max_offset("t", q) for q in range(2)] == ends for b in brokers), 10, "queues built"
        )
        await await_until(lambda: new.store.topics.all() == {"t": 2}, 10, "the topic copied")
        for q in range(2):
            contents = [queue_contents(b.store, "t", q) for b in brokers]
            assert contents[0] == contents[1] == contents[2], (q, [bounds for bounds, _ in contents])
            assert contents[0][1] == expected_queues(lead.store, "t", 2)[q]
        await rpc.aclose()


def copy_log(source: Store, target: Store, chunk_sizes: list[int], confirm_every: int) -> None:
    """Copy ``source``'s log into ``target`` as a follower does: chunks read from one
    segment, cut to whole records (``whole_prefix``), appended raw; the confirmed offset
    raised every ``confirm_every`` chunks, to the end of the chunk before (a leader
    confirms what was held at the follower's previous report)."""
    end, offset, told = source.log.write_offset, 0, 0
    for i in itertools.count():
        if offset >= end:
            break
        want = chunk_sizes[i % len(chunk_sizes)]
        while True:
            at, data = source.log.read_chunk(offset, want, end)
            n, needed, _sealed = whole_prefix(data, source.log.config.max_message_bytes)
            if n:
                break
            want = max(want * 2, needed)
        assert target.log.append_raw(at, data[:n]).ok
        if i % confirm_every == 0:
            target.log.set_confirmed_offset(told)
            told = target.log.write_offset
        offset = target.log.write_offset
    target.log.set_confirmed_offset(None)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(50, 7000), min_size=20, max_size=80),
    chunk_sizes=st.lists(st.integers(1, 40_000), min_size=1, max_size=8),
    confirm_every=st.integers(1, 3),
)
def test_a_follower_s_running_dispatcher_builds_every_copied_record_whatever_the_chunks(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], chunk_sizes: list[int], confirm_every: int
) -> None:
    """A follower's store with its threads running (the dispatcher's small ``pread``
    rounds and memory-mapped large ones, segment rolls and blank markers in the copied
    chunks, a reader hurrying the dispatcher from another thread all along) builds
    queues equal to the leader's: no hole, every record once."""
    root = tmp_path_factory.mktemp("copy")
    queues = 3
    with Store.open(small_config(root / "lead", segment_bytes=SEGMENT, max_message_bytes=8 * 1024)) as lead:
        lead.create_topic("t", queues)
        for i, size in enumerate(sizes):
            assert lead.put_batch([Message("t", i % queues, (b"%d." % i).ljust(size, b"x"))]).ok
        lead.catch_up()
        cfg = small_config(root / "follower", segment_bytes=SEGMENT, max_message_bytes=8 * 1024)
        with Store.open(cfg).start() as follower:
            follower.create_topic("t", queues)
            follower.log.set_confirmed_offset(0)
            done = threading.Event()
            hurrier = threading.Thread(target=_hurry_until, args=(follower, done))
            hurrier.start()
            try:
                copy_log(lead, follower, chunk_sizes, confirm_every)
            finally:
                done.set()
                hurrier.join()
            wait_until(lambda: follower.dispatch_lag_bytes == 0, 10, "the follower's dispatch")
            for q in range(queues):
                assert queue_contents(follower, "t", q) == queue_contents(lead, "t", q), q


def _hurry_until(store: Store, done: threading.Event) -> None:
    """A reader long-polling the store over and over (each poll that finds nothing hurries)."""
    while not done.wait(0.0005):
        store.dispatcher.hurry()
