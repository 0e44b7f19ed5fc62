"""Shared pieces of the key index's tests: a small store configuration, the truth a
look-up is compared with (a full scan of the log), a poll with a deadline, and a lock
held by another thread for as long as a test needs (a persist in the middle of its
fdatasync, or a dispatcher stuck before its round), and a store opened with its index."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from clmq.broker.store import Store, StoreConfig
from clmq.commitlog import CommitLogConfig
from clmq.consumequeue import KeyIndex
from tests.waiting import wait_until

DEADLINE_S = 20.0


def key_index_store_config(root: Path, segment_bytes: int, **settings: Any) -> StoreConfig:
    """A store whose every round and look-up moves by the smallest step, so that a test
    sees each state in between; ``settings``: the test's own index shape and timing."""
    return StoreConfig(
        root,
        CommitLogConfig(segment_bytes=segment_bytes, max_message_bytes=4096),
        auto_create_topics=True,
        dispatch_chunk_bytes=1,  # the floor: a record's bytes
        index_query_catch_up_bytes=1,  # a look-up after failed writes indexes a chunk of what they left
        **settings,
    )


def scan(store: Store, topic: str, key: str) -> list[int]:
    """The truth: the commit-log offsets of every record of ``topic`` with ``key`` (as
    one of its keys or as its UNIQ_KEY), newest first."""
    hits = [
        r
        for r in store.log.iter_records(store.log.min_offset, store.log.write_offset)
        if r.topic == topic and (key in r.keys.split() or r.properties.get("UNIQ_KEY") == key)
    ]
    hits.sort(key=lambda r: (r.store_timestamp_ms, r.commitlog_offset), reverse=True)
    return [r.commitlog_offset for r in hits]


def poll(what: str, ok: Callable[[], object]) -> None:
    """Wait until ``ok()`` holds (a deadline of DEADLINE_S, no fixed sleep)."""
    wait_until(ok, DEADLINE_S, what)


@contextmanager
def held_in_another_thread(lock: threading.Lock) -> Iterator[None]:
    """Hold ``lock`` from another thread for the body of the ``with`` block, as the
    housekeeping thread's persist holds the key index's lock through a slow fdatasync.
    Another thread, not this one: the lock is not re-entrant, so any call of the test's
    own that takes it would hang instead of finding it busy."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(DEADLINE_S)

    holder = threading.Thread(target=hold, name="lock-holder")
    holder.start()
    try:
        assert held.wait(DEADLINE_S), "the lock was never taken"
        yield
    finally:
        release.set()
        holder.join()


@contextmanager
def store_and_index(config: StoreConfig, start: bool = False) -> Iterator[tuple[Store, KeyIndex]]:
    """A store opened on ``config`` (its threads started if ``start``) and its key
    index; the store is closed after the block."""
    store = Store.open(config)
    try:
        if start:
            store.start()
        index = store.key_index
        assert index is not None, "the store has no key index"
        yield store, index
    finally:
        store.close()
