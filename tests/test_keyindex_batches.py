"""The key index fed in batches (``index_batch_interval_ms``, ``index_batch_bytes``):
dispatch rounds build consume-queue entries at once and leave the index behind until a
batch is due; a look-up first brings the index up to the log, so it finds every message
stored before it whatever the batching; a crash rebuilds what was not persisted; an
idle dispatcher feeds due records without new appends; consumers are woken before a
batch is indexed; a persist holding the index never holds up a round."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.service import BrokerConfig
from clmq.broker.store import Store, StoreConfig
from clmq.commitlog import CommitLogConfig
from clmq.common import ConfigError, Message
from clmq.consumequeue._index_feed import INDEX_BUSY_RETRY_MS, QUERY_CATCH_UP_BYTES
from tests.keyindex_helpers import held_in_another_thread, key_index_store_config, poll, scan, store_and_index

KEYS = ["a", "b", "order-1", "x" * 30]
HOUR_MS = 3_600_000  # a batch interval no test outlasts: only bytes or a query feed the index
WINDOW_S = 0.5  # how long an idle dispatcher's loop is watched (a window to count its passes in)


def config(root: Path, interval_ms: int = HOUR_MS, batch_bytes: int = 1 << 30) -> StoreConfig:
    return key_index_store_config(
        root,
        32 * 1024,
        index_hash_slots=5,
        index_max_entries_per_file=9,
        index_batch_interval_ms=interval_ms,
        index_batch_bytes=batch_bytes,
    )


def found(store: Store, key: str) -> list[int]:
    got = store.find_by_key("t", key, max_results=10_000)
    assert got is not None and not got.truncated and got.index_lag_bytes == 0
    return [r.commitlog_offset for r in got.records]


def batch(n: int, key: str, first: int = 0) -> list[Message]:
    return [Message("t", i % 2, b"body", keys=key, properties={"UNIQ_KEY": f"u{first + i}"}) for i in range(n)]


def consumable(store: Store) -> int:
    return sum(len(store.get("t", q, 0, 10_000).messages) for q in (0, 1))


def test_rounds_make_messages_consumable_at_once_and_the_index_waits_for_its_batch(tmp_path: Path) -> None:
    with store_and_index(config(tmp_path)) as (store, index):
        start = index.end_offset
        for i in range(5):
            store.put_batch(batch(3, "a", 3 * i))
            assert store.dispatcher.dispatch_once() == 3
            assert consumable(store) == 3 * (i + 1)  # the entries: every round
        assert index.end_offset == start and index.entry_count == 0  # the index: not yet due
        assert found(store, "a") == scan(store, "t", "a") and len(scan(store, "t", "a")) == 15  # a query feeds it first
        assert index.end_offset == store.log.confirmed_offset
        assert found(store, "u7") == scan(store, "t", "u7") and len(scan(store, "t", "u7")) == 1


def test_a_batch_is_due_once_its_bytes_wait_and_a_big_round_is_indexed_at_once(tmp_path: Path) -> None:
    with store_and_index(config(tmp_path, batch_bytes=2000)) as (store, index):
        store.put_batch(batch(1, "a"))
        store.dispatcher.dispatch_once()
        size = store.log.confirmed_offset  # one record's bytes
        assert index.end_offset == 0 and size < 2000
        rounds = 1
        while store.log.confirmed_offset < 2000:  # small rounds: the index waits until 2000 bytes do
            assert index.end_offset == 0
            store.put_batch(batch(1, "a", rounds))
            store.dispatcher.dispatch_once()
            rounds += 1
        assert index.end_offset == store.log.confirmed_offset  # the round that made them 2000: all indexed
        before = index.end_offset
        store.put_batch(batch(2000 // size + 1, "b"))  # one round of 2000 bytes by itself
        store.dispatcher.dispatch_once()
        assert index.end_offset == store.log.confirmed_offset > before
        assert found(store, "a") == scan(store, "t", "a") and found(store, "b") == scan(store, "t", "b")


def test_an_idle_dispatcher_indexes_due_records_without_new_appends(tmp_path: Path) -> None:
    with store_and_index(config(tmp_path, interval_ms=30), start=True) as (store, index):
        store.put_batch(batch(2, "a"))
        # No query, no append: the interval alone.
        poll("the waiting records indexed", lambda: index.end_offset >= store.log.confirmed_offset)
        assert index.entry_count == 4  # a key and a UNIQ_KEY each


def test_a_lookup_finds_every_acknowledged_message_however_far_behind_the_dispatcher_is(tmp_path: Path) -> None:
    """A burst of acknowledged messages, more than QUERY_CATCH_UP_BYTES of log, the
    dispatcher behind all of it (not started) and index writes working: the first
    look-up finds the newest key, and every other (it missed them: the catch-up's cap
    counted the dispatcher's own lag)."""
    log = CommitLogConfig(segment_bytes=64 << 20, max_message_bytes=1 << 20)
    store = Store.open(StoreConfig(tmp_path, log, auto_create_topics=True))
    try:
        body = b"x" * 4000
        n = 4200  # ~17 MB
        for first in range(0, n, 100):
            store.put_batch([Message("t", 0, body, keys=f"k{i}") for i in range(first, first + 100)])
        index = store.key_index
        assert index is not None and store.log.confirmed_offset - index.end_offset > 2 * QUERY_CATCH_UP_BYTES
        assert store.dispatch_lag_bytes == store.log.confirmed_offset  # nothing dispatched
        for key in (f"k{n - 1}", "k0", f"k{n // 2}"):
            got = store.find_by_key("t", key)
            assert got is not None and got.index_lag_bytes == 0
            assert [r.commitlog_offset for r in got.records] == scan(store, "t", key), key
    finally:
        store.close()


def test_waiting_consumers_are_woken_before_a_due_batch_is_indexed(tmp_path: Path) -> None:
    """A round whose batch is due wakes its listeners (long polls) first, then indexes."""
    with store_and_index(config(tmp_path, interval_ms=0)) as (store, index):
        seen: list[tuple[int, int]] = []
        store.add_arrival_listener(lambda keys: seen.append((index.end_offset, store.dispatcher.dispatched_offset)))
        store.put_batch(batch(3, "a"))
        assert store.dispatcher.dispatch_once() == 3
        assert seen == [(0, store.log.confirmed_offset)]  # woken while the index still waited
        assert index.end_offset == store.log.confirmed_offset  # indexed in the same call, after


def test_a_persist_holding_the_index_does_not_hold_up_a_round(tmp_path: Path) -> None:
    """The housekeeping thread's persist (an fdatasync) holds the index's lock: a round
    then builds its entries and leaves the index for later instead of waiting."""
    with store_and_index(config(tmp_path, interval_ms=0)) as (store, index):
        with held_in_another_thread(index._lock):  # the lock persist() takes, held as a slow fdatasync would
            store.put_batch(batch(4, "a"))
            assert store.dispatcher.dispatch_once() == 4  # returns: did not wait for the lock
            assert consumable(store) == 4 and index.end_offset == 0
        store.put_batch(batch(1, "b", 4))
        store.dispatcher.dispatch_once()  # interval 0: due at once, from the index's end
        assert index.end_offset == store.log.confirmed_offset and index.entry_count == 10


def test_a_persist_holding_the_index_does_not_spin_the_idle_dispatcher(tmp_path: Path) -> None:
    """Records due (interval 0) while a persist holds the index: the idle dispatcher
    looks again after INDEX_BUSY_RETRY_MS instead of at once (it made ~100,000 passes a
    second), and indexes them once the index is free, with no new append."""
    with store_and_index(config(tmp_path, interval_ms=0), start=True) as (store, index):
        with held_in_another_thread(index._lock):  # the lock persist() takes, held as a slow fdatasync would
            store.put_batch(batch(4, "a"))
            poll("the round", lambda: consumable(store) == 4)
            first = store.dispatcher.loop_passes
            time.sleep(WINDOW_S)  # a window to count the loop's passes in, not a wait for an event
            passes = store.dispatcher.loop_passes - first
            assert passes < 2 * WINDOW_S * 1000 / INDEX_BUSY_RETRY_MS + 10, f"{passes} passes in {WINDOW_S} s"
            assert index.end_offset == 0
        poll("the index caught up", lambda: index.end_offset == store.log.confirmed_offset)
        assert found(store, "a") == scan(store, "t", "a") and len(scan(store, "t", "a")) == 4


def test_a_damaged_record_met_by_a_lookup_and_then_by_the_dispatcher_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record header damaged under a running store: a look-up's catch-up meets it
    first (the index is fed ahead of the dispatcher), then the dispatcher's round: one
    error names it (it was logged by both)."""
    store = Store.open(config(tmp_path))
    try:
        store.put_batch(batch(3, "a"))
        base, _, path = store.log.segments()[0]
        second = [r.commitlog_offset for r in store.log.iter_records(store.log.min_offset)][1]
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\0" * 8, second - base + 4)  # the second record's magic and CRC
        finally:
            os.close(fd)
        with caplog.at_level(logging.ERROR):
            got = store.find_by_key("t", "a")
            store.catch_up()
        assert got is not None and len(got.records) == 1
        reports = [r for r in caplog.records if "corrupt record header" in r.getMessage()]
        assert len(reports) == 1 and f"offset {second}" in reports[0].getMessage()
    finally:
        store.close()


round_plans = st.lists(
    st.tuples(st.integers(1, 12), st.sampled_from(KEYS), st.sampled_from(["round", "query", "none"])),
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=round_plans,
    interval_ms=st.sampled_from([0, HOUR_MS]),
    batch_bytes=st.sampled_from([1, 700, 5000, 1 << 30]),
    crash=st.booleans(),
)
def test_lookups_find_every_stored_message_whatever_the_batching(
    plan: list[tuple[int, str, str]], interval_ms: int, batch_bytes: int, crash: bool
) -> None:
    """Appends, dispatch rounds and look-ups interleaved: every look-up finds exactly
    what a full scan of the log finds, dispatched or not, indexed or not; after a crash
    (nothing persisted since the last checkpoint) the reopened index agrees too."""
    with tempfile.TemporaryDirectory() as d:
        cfg = config(Path(d), interval_ms, batch_bytes)
        store = Store.open(cfg)
        try:
            for i, (n, key, then) in enumerate(plan):
                store.put_batch(batch(n, key, 100 * i))
                if then == "round":
                    store.dispatcher.dispatch_once()
                elif then == "query":
                    assert found(store, key) == scan(store, "t", key)
                    assert found(store, f"u{100 * i}") == scan(store, "t", f"u{100 * i}")
                if i == len(plan) // 2:
                    store.checkpoint()  # the index persisted at whatever it held
            if crash:
                store.abandon()
                store = Store.open(cfg)
            for key in KEYS:
                assert found(store, key) == scan(store, "t", key), key
        finally:
            store.close()


def test_batch_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="index_batch_interval_ms"):
        StoreConfig(Path("/nonexistent"), index_batch_interval_ms=-1)
    with pytest.raises(ConfigError, match="index_batch_bytes"):
        StoreConfig(Path("/nonexistent"), index_batch_bytes=0)
    with pytest.raises(ValueError, match="index_batch_interval_ms"):
        BrokerConfig(data_dir="/nonexistent", index_batch_interval_ms=-5)
    with pytest.raises(ValueError, match="index_batch_bytes"):
        BrokerConfig(data_dir="/nonexistent", index_batch_bytes=0)
    with pytest.raises(ConfigError, match="index_query_catch_up_bytes"):
        StoreConfig(Path("/nonexistent"), index_query_catch_up_bytes=0)
    with pytest.raises(ValueError, match="index_query_catch_up_bytes"):
        BrokerConfig(data_dir="/nonexistent", index_query_catch_up_bytes=0)
    assert BrokerConfig(data_dir="/x", index_query_catch_up_bytes=5).store_config().index_query_catch_up_bytes == 5
