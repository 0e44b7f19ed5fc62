"""The key index under faults and long queries: an index write error (ENOSPC, EIO)
leaves the store producing and consumers served while the index falls behind, and the
index catches up from the log once writes work again; a file retired while a query
walks it stays open (its descriptor is not reused under the query); a hot key outside
a narrow time range stops at the chain-step bound and says ``truncated``."""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from clmq.broker.service._index_requests import index_fields
from clmq.broker.store import Store, StoreConfig
from clmq.broker.store._key_index import find_by_key
from clmq.client import Admin, open_admin, open_consumer, open_producer
from clmq.commitlog import CommitLogConfig
from clmq.common import Message
from clmq.consumequeue import IndexSettings, KeyIndex, WalkBudget, key_hash
from clmq.consumequeue._index_feed import INDEX_BUSY_RETRY_MS
from tests.faults import SHORT, Fault, inject
from tests.keyindex_helpers import (
    DEADLINE_S,
    held_in_another_thread,
    key_index_store_config,
    poll,
    scan,
    store_and_index,
)
from tests.service_helpers import Cluster
from tests.waiting import await_until

KEYS = [f"k{i}" for i in range(7)]


def store_config(root: Path, per_file: int = 40) -> StoreConfig:
    return key_index_store_config(
        root, 64 * 1024, index_hash_slots=7, index_max_entries_per_file=per_file, cq_flush_interval_ms=20
    )


def consumed(store: Store, topic: str) -> int:
    return len(store.get(topic, 0, 0, 10_000).messages)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO])
def test_an_index_write_error_leaves_the_store_working_and_the_index_catches_up(tmp_path: Path, error: int) -> None:
    store = Store.open(store_config(tmp_path)).start()
    woken = threading.Event()
    store.add_arrival_listener(lambda keys: woken.set())
    try:
        store.put_batch([Message("t1", 0, b"before", keys=k) for k in KEYS])
        poll("the first messages indexed", lambda: store.key_index is not None and store.key_index.entry_count > 0)
        index = store.key_index
        assert index is not None
        faults = [Fault(op, error, path=".idx", times=None) for op in ("pwrite", "fdatasync", "ftruncate")]
        with inject(*faults) as ops:
            for i in range(30):  # enough entries for new files (40 a file) while writes fail
                woken.clear()
                store.put_batch([Message("t1", 0, f"m{i}".encode(), keys=f"{KEYS[i % 7]} {KEYS[(i + 3) % 7]}")])
                poll("the round's arrival", woken.is_set)  # listeners are woken though the index failed
            poll("every message consumable", lambda: consumed(store, "t1") == 37)
            poll("an index failure counted", lambda: index.failures > 0)
            assert ops.fired > 0
            assert store.failure is None
            assert index.end_offset < store.dispatcher.dispatched_offset  # behind, not skipped ahead
            info = index_fields(store)
            assert info["index_failures"] == index.failures and os.strerror(error) in str(info["index_error"])
            store.checkpoint()  # a persist that fails is counted, not raised
            assert store.failure is None
            found = store.find_by_key("t1", KEYS[0])  # answers meanwhile (maybe without the newest)
            assert found is not None and set(r.commitlog_offset for r in found.records) <= set(
                scan(store, "t1", KEYS[0])
            )
        poll("the index caught up", lambda: index.end_offset >= store.log.confirmed_offset and not index.failing)
        store.put_batch([Message("t1", 0, b"after", keys=k) for k in KEYS])
        poll("the last messages indexed", lambda: index.end_offset >= store.log.confirmed_offset)
        for key in KEYS:
            got = store.find_by_key("t1", key, max_results=1000)
            assert got is not None and not got.truncated
            assert [r.commitlog_offset for r in got.records] == scan(store, "t1", key)
        assert store.failure is None
    finally:
        store.close()


WINDOW_S = 0.5  # how long the dispatcher's idle loop is watched (a window to count in, not a wait)


def loop_passes_in(store: Store, window_s: float) -> int:
    """The dispatcher loop's passes during ``window_s`` seconds of watching."""
    first = store.dispatcher.loop_passes
    time.sleep(window_s)
    return store.dispatcher.loop_passes - first


@contextmanager
def index_on_a_full_disk(store: Store, retry_interval_ms: int) -> Iterator[KeyIndex]:
    """The store's index with every write failing (ENOSPC), once it has failed on the
    records of KEYS; when the block ends, writes work again and the index catches up
    with no new append."""
    index = store.key_index
    assert index is not None
    index.retry_interval_ms = retry_interval_ms
    with inject(Fault("pwrite", errno.ENOSPC, path=".idx", times=None)):
        store.put_batch([Message("t1", 0, b"x", keys=k) for k in KEYS])
        poll("an index failure counted", lambda: index.failures > 0)
        yield index
    poll("the index caught up", lambda: index.end_offset >= store.log.confirmed_offset and not index.failing)


def test_an_index_that_cannot_write_does_not_spin_the_dispatcher(tmp_path: Path) -> None:
    """Records due for the index while its writes fail (a full disk): the idle
    dispatcher sleeps until the index's next retry instead of asking again at once (it
    made ~100,000 passes a second, with the GIL), and the index catches up once writes
    work, with no new append."""
    store = Store.open(store_config(tmp_path)).start()
    try:
        with index_on_a_full_disk(store, retry_interval_ms=200) as index:
            passes = loop_passes_in(store, WINDOW_S)
            assert passes < 25, f"{passes} passes of the dispatcher's loop in {WINDOW_S} s"
            assert index.end_offset < store.log.confirmed_offset and store.failure is None
        for key in KEYS:
            got = store.find_by_key("t1", key)
            assert got is not None and got.index_lag_bytes == 0
            assert [r.commitlog_offset for r in got.records] == scan(store, "t1", key)
    finally:
        store.close()


def test_a_failing_index_held_by_a_persist_does_not_spin_the_dispatcher(tmp_path: Path) -> None:
    """Writes failed, their retry is due, and a persist holds the index: the idle
    dispatcher looks again after INDEX_BUSY_RETRY_MS, not at once."""
    store = Store.open(store_config(tmp_path)).start()
    try:
        with index_on_a_full_disk(store, retry_interval_ms=50) as index:
            with held_in_another_thread(index._lock):  # the lock persist() takes, held as a slow fdatasync would
                poll("the retry due", lambda: index.may_write)
                passes = loop_passes_in(store, WINDOW_S)
            assert passes < 2 * WINDOW_S * 1000 / INDEX_BUSY_RETRY_MS + 10, f"{passes} passes in {WINDOW_S} s"
    finally:
        store.close()


def test_after_failed_writes_a_lookup_indexes_a_bounded_backlog_and_says_what_is_left(tmp_path: Path) -> None:
    """While index writes fail, a look-up answers at once with what the index holds and
    says how far behind it is. Once they work, a look-up indexes at most
    ``index_query_catch_up_bytes`` of what the failures left behind (it holds the
    dispatcher's rounds meanwhile), answers exactly for what the index then holds and
    says the rest; the next look-ups go on from there until the index has caught up."""
    log = CommitLogConfig(segment_bytes=1 << 20, max_message_bytes=4096)
    only_lookups = {"index_batch_interval_ms": 3_600_000, "index_batch_bytes": 1 << 40}  # no batch falls due
    cap = 32 << 10
    cfg = StoreConfig(
        tmp_path, log, auto_create_topics=True, dispatch_chunk_bytes=1, index_query_catch_up_bytes=cap, **only_lookups
    )
    with store_and_index(cfg) as (store, index):
        index.retry_interval_ms = 0
        body = b"x" * 500
        with inject(Fault("pwrite", errno.ENOSPC, path=".idx", times=None)) as ops:
            for i in range(3):  # 3 x 100 messages of ~600 B: several caps' worth
                store.put_batch([Message("t1", 0, body, keys=f"k{i}") for _ in range(100)])
            store.catch_up()  # the dispatcher's batch fails
            behind = store.find_by_key("t1", "k2", max_results=1000)
            assert ops.fired > 0 and behind is not None and behind.records == []
            assert behind.index_lag_bytes == store.log.confirmed_offset - index.end_offset > 4 * cap
        lags = []
        while not lags or lags[-1]:
            got = store.find_by_key("t1", "k2", max_results=1000)
            assert got is not None and len(lags) < 50
            end = store.log.confirmed_offset - got.index_lag_bytes
            assert [r.commitlog_offset for r in got.records] == [o for o in scan(store, "t1", "k2") if o < end]
            lags.append(got.index_lag_bytes)
        assert len(lags) > 3 and lags == sorted(set(lags), reverse=True)  # each look-up went on from the last
        assert len(store.find_by_key("t1", "k2", max_results=1000).records) == 100  # type: ignore[union-attr]


def test_an_index_behind_catches_up_across_a_reopen(tmp_path: Path) -> None:
    """A store closed while the index still fails: the next open re-indexes from the
    index's own end (the files never claimed more than they hold)."""
    config = store_config(tmp_path, per_file=25)
    store = Store.open(config)
    try:
        store.put_batch([Message("t1", 0, b"a", keys=k) for k in KEYS])
        store.catch_up()
        with inject(Fault("pwrite", errno.ENOSPC, path=".idx", times=None)):
            for i in range(10):
                store.put_batch([Message("t1", 0, b"b", keys=" ".join(KEYS[i % 3 :]))])
            store.catch_up()
            assert store.key_index is not None and store.key_index.failures > 0
            assert consumed(store, "t1") == 17
    finally:
        store.close()  # its checkpoint fails for the index only
    store = Store.open(config)
    try:
        store.catch_up()
        for key in KEYS:
            got = store.find_by_key("t1", key)
            assert got is not None and [r.commitlog_offset for r in got.records] == scan(store, "t1", key)
    finally:
        store.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    op=st.sampled_from(["pwrite", "fdatasync", "ftruncate"]),
    error=st.sampled_from([errno.ENOSPC, errno.EIO, SHORT]),
    after=st.integers(0, 40),
    times=st.integers(1, 30),
    batches=st.lists(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3), min_size=5, max_size=40),
)
@example(  # found in CI: a look-up during the fault answered a record beyond what it said it held
    op="ftruncate", error=errno.ENOSPC, after=0, times=2, batches=[["k0"], ["k0"], ["k0"] * 2, ["k0"] * 3, ["k0"] * 3]
)
def test_wherever_index_writes_fail_the_index_ends_up_exact(
    op: str, error: int, after: int, times: int, batches: list[list[str]]
) -> None:
    """Any index file operation failing from any point for a while: the store stays
    up, every message is consumable, and once the fault is over the index agrees with
    a full scan, and again after a reopen."""
    with tempfile.TemporaryDirectory() as tmp:
        with store_and_index(store_config(Path(tmp), per_file=9)) as (store, index):
            index.retry_interval_ms = 0
            with inject(Fault(op, error, path=".idx", after=after, times=times)):
                for i, keys in enumerate(batches):
                    store.put_batch([Message("t1", 0, b"x", keys=" ".join(keys))])
                    store.catch_up()
                    if i % 7 == 6:
                        store.checkpoint()
                    if i % 5 == 4:  # a look-up meanwhile: all it says it holds, and says the rest
                        got = store.find_by_key("t1", keys[0], max_results=1000)
                        assert got is not None
                        end = store.log.confirmed_offset - got.index_lag_bytes
                        every = scan(store, "t1", keys[0])
                        offsets = [r.commitlog_offset for r in got.records]
                        assert [o for o in offsets if o < end] == [o for o in every if o < end]
                        # Beyond the end it states, a failed write may have left entries of
                        # its batch readable: only true matches, each once (found in CI).
                        assert len(set(offsets)) == len(offsets) and set(offsets) <= set(every)
                assert store.failure is None and consumed(store, "t1") == len(batches)
            store.catch_up()
            store.checkpoint()
            assert index.end_offset == store.log.confirmed_offset
            for key in KEYS:
                got = store.find_by_key("t1", key, max_results=1000)
                assert got is not None and [r.commitlog_offset for r in got.records] == scan(store, "t1", key)
        store = Store.open(store_config(Path(tmp), per_file=9))  # and what the files say after a reopen
        try:
            store.catch_up()
            for key in KEYS:
                got = store.find_by_key("t1", key, max_results=1000)
                assert got is not None and [r.commitlog_offset for r in got.records] == scan(store, "t1", key)
        finally:
            store.close()


def test_a_failed_fdatasync_rewinds_the_index_to_what_was_durable(tmp_path: Path) -> None:
    """After a failed fdatasync the kernel may have dropped the pages it calls clean:
    the entries since the last good persist are written again, from the log."""
    config = store_config(tmp_path, per_file=1000)
    with store_and_index(config) as (store, index):
        index.retry_interval_ms = 0
        store.put_batch([Message("t1", 0, b"a", keys=k) for k in KEYS])
        store.catch_up()
        store.checkpoint()
        durable = index.end_offset
        store.put_batch([Message("t1", 0, b"b", keys=" ".join(KEYS))])
        store.catch_up()
        with inject(Fault("fdatasync", errno.EIO, path=".idx")) as ops:
            store.checkpoint()
        assert ops.fired == 1 and store.failure is None
        assert index.end_offset == durable < store.log.confirmed_offset  # rewound to the last good persist
        store.catch_up()  # indexed again from the log
        assert index.end_offset == store.log.confirmed_offset
        store.checkpoint()
        for key in KEYS:
            got = store.find_by_key("t1", key)
            assert got is not None and [r.commitlog_offset for r in got.records] == scan(store, "t1", key)
    store = Store.open(config)
    try:
        for key in KEYS:
            got = store.find_by_key("t1", key)
            assert got is not None and [r.commitlog_offset for r in got.records] == scan(store, "t1", key)
    finally:
        store.close()


def test_a_failed_append_leaves_the_chains_whole(tmp_path: Path) -> None:
    """Entries that could not be written are not linked: the next ones chain to the
    entries really in the file."""
    index = KeyIndex(tmp_path, IndexSettings(slots=3, max_entries=1000))
    h = np.array([key_hash("t", k) for k in KEYS], dtype=np.uint32)
    times = np.full(len(KEYS), 5_000, dtype=np.int64)
    index.add(h, np.arange(7, dtype=np.int64), times)
    with inject(Fault("pwrite", errno.EIO, path=".idx")), pytest.raises(OSError):
        index.add(h, np.arange(7, 14, dtype=np.int64), times)
    index.add(h, np.arange(14, 21, dtype=np.int64), times)
    for i, key in enumerate(KEYS):
        assert [c.offset for c in index.candidates("t", key)] == [14 + i, i]
    index.close()


def deleted_idx_fds() -> list[str]:
    """Descriptors of this process open on deleted index files."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if ".idx" in target and target.endswith("(deleted)"):
            out.append(target)
    return out


def test_a_file_retired_under_a_query_stays_open_until_the_query_ends(tmp_path: Path) -> None:
    index = KeyIndex(tmp_path / "index", IndexSettings(slots=1, max_entries=10))
    n = 100  # ten files of ten entries, all one key's chain
    index.add(np.full(n, key_hash("t", "k"), dtype=np.uint32), np.arange(n, dtype=np.int64), np.full(n, 9_000))
    assert len(index.files) == 10
    walk = index.candidates("t", "k")
    seen = []
    for cand in walk:  # newest first, into the oldest file
        seen.append(cand.offset)
        if cand.offset == 9:
            break
    assert index.delete_before(95) == 9  # every file but the active one
    assert index.delete_before(95) == 0  # a second pass: the old code closed the retired files here
    junk = [os.open(tmp_path / f"junk{i}", os.O_RDWR | os.O_CREAT) for i in range(12)]
    try:
        for fd in junk:  # a reused descriptor would read this
            os.pwrite(fd, b"\xff" * 4096, 0)
        seen += [c.offset for c in walk]
    finally:
        for fd in junk:
            os.close(fd)
    assert seen == list(range(n - 1, -1, -1))
    assert deleted_idx_fds() == []  # closed once the query let go
    assert [c.offset for c in index.candidates("t", "k")] == list(range(n - 1, 89, -1))
    index.close()


def test_a_query_stopped_early_releases_its_files(tmp_path: Path) -> None:
    index = KeyIndex(tmp_path, IndexSettings(slots=1, max_entries=5))
    index.add(np.full(20, key_hash("t", "k"), dtype=np.uint32), np.arange(20, dtype=np.int64), np.full(20, 9_000))
    walk = index.candidates("t", "k")
    assert next(walk).offset == 19
    walk.close()
    index.delete_before(20)
    assert deleted_idx_fds() == []
    index.close()


def test_a_hot_key_outside_a_narrow_time_range_is_truncated_at_the_step_bound(tmp_path: Path) -> None:
    """One old message of a hot key, then 2000 newer: a query for the old second walks
    the newer entries (they fail the time filter) only up to the bound."""
    store = Store.open(store_config(tmp_path, per_file=100_000))
    try:
        store.put_batch([Message("t1", 0, b"old", keys="hot")])
        store.catch_up()
        first = next(store.log.iter_records(store.log.min_offset))
        poll("the next second", lambda: int(time.time()) > first.store_timestamp_ms // 1000)  # entries keep seconds
        for _ in range(20):
            store.put_batch([Message("t1", 0, b"x", keys="hot") for _ in range(100)])
        store.catch_up()
        index = store.key_index
        assert index is not None
        narrow = {"since_ms": first.store_timestamp_ms, "until_ms": first.store_timestamp_ms}
        with inject(Fault("pread", errno.EIO, path=".idx", times=0)) as ops:  # counts index reads, fails none
            got = find_by_key(index, store.log, "t1", "hot", **narrow, max_chain_steps=100)
        assert got.records == [] and got.truncated
        assert ops.faults[0].seen <= 100
        whole = find_by_key(index, store.log, "t1", "hot", **narrow)
        assert [r.commitlog_offset for r in whole.records] == [first.commitlog_offset] and not whole.truncated
        some = find_by_key(index, store.log, "t1", "hot", max_results=5000, max_chain_steps=500)
        assert some.truncated and [r.commitlog_offset for r in some.records] == scan(store, "t1", "hot")[:500]
    finally:
        store.close()


def test_time_filtered_entries_count_against_the_budget(tmp_path: Path) -> None:
    index = KeyIndex(tmp_path, IndexSettings(slots=1, max_entries=10_000))
    times = np.array([1_000_000] + [5_000_000] * 1000, dtype=np.int64)
    index.add(np.full(1001, key_hash("t", "hot"), dtype=np.uint32), np.arange(1001, dtype=np.int64), times)
    budget = WalkBudget(100)
    assert list(index.candidates("t", "hot", 1_000_000, 1_000_999, budget)) == [] and budget.exhausted
    unbounded = WalkBudget(2000)
    assert [c.offset for c in index.candidates("t", "hot", 1_000_000, 1_000_999, unbounded)] == [0]
    assert not unbounded.exhausted
    index.close()


def test_a_budget_stops_the_walk_across_files(tmp_path: Path) -> None:
    index = KeyIndex(tmp_path, IndexSettings(slots=2, max_entries=4))
    index.add(np.full(12, key_hash("t", "k"), dtype=np.uint32), np.arange(12, dtype=np.int64), np.full(12, 9_000))
    budget = WalkBudget(6)
    assert [c.offset for c in index.candidates("t", "k", budget=budget)] == list(range(11, 5, -1))
    assert budget.exhausted
    exact = WalkBudget(12)
    assert len(list(index.candidates("t", "k", budget=exact))) == 12 and not exact.exhausted
    index.close()


async def test_a_broker_whose_index_cannot_write_serves_on(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A real broker (in this process, so the fault reaches its files): with every index
    write failing, sends and a consumer group go on, a look-up says how far its index is
    behind and BROKER_INFO counts the failures; once writes work, ``find_by_key`` finds
    every message again."""
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    await cluster.start_broker("broker-a", index_hash_slots=64, index_max_entries_per_file=40)
    await cluster.create_topic("orders", 2)
    addr = cluster.brokers["broker-a"].addr
    got: list[bytes] = []
    async with open_admin(cluster.ns) as admin, open_producer(cluster.ns) as producer:
        await producer.send("orders", b"m-first", keys="all")
        await await_until(lambda: _count(admin, "all", 1), 10, "the first message indexed")
        with inject(Fault("pwrite", errno.ENOSPC, path=".idx", times=None)) as ops:
            for i in range(40):
                await producer.send("orders", f"m{i}".encode(), keys="all")
            async with open_consumer(cluster.ns, "g", {"orders": "*"}, pull_wait_ms=200) as consumer:
                with trio.fail_after(DEADLINE_S):
                    while len(got) < 41:
                        got += [r.body for r in await consumer.receive()]
            behind = await admin.find_by_key("orders", "all", max_results=100)  # feeds the index: fails
            assert behind.index_lag_bytes > 0 and len(behind.records) < 41  # says it is behind, never wrong
            info = await admin.broker_info(addr)
            assert ops.fired > 0 and info["index_failures"] > 0 and "No space left" in info["index_error"]
        await await_until(lambda: _count(admin, "all", 41), DEADLINE_S, "the index caught up")
    assert sorted(got) == sorted([b"m-first"] + [f"m{i}".encode() for i in range(40)])


async def _count(admin: Admin, key: str, want: int) -> bool:
    found = await admin.find_by_key("orders", key, max_results=100)
    return len(found.records) == want and not found.truncated and found.index_lag_bytes == 0
