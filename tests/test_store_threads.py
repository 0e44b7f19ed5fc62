"""The store read from many threads at once, as the broker's pull workers do, while
the appending, dispatching, housekeeping (checkpoints, retention) and flushing
threads run: no exception, no false damage, and every record read is the one its
queue offset names.

Races are shaken out with a tiny switch interval and with garbage collections that
let other threads run (``gc.callbacks``): a collection can start inside any C-level
allocation, even in the middle of ``list(d.items())``, and the finalizers it runs are
Python code, during which another thread may change ``d``.
"""

from __future__ import annotations

import gc
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from clmq.broker.store import GetStatus, Store
from clmq.common import Message, Record, decode_record

from .conftest import small_config

RUN_S = 6.0  # how long the threads hammer the store
READERS = 4  # as many as the broker's default pull_read_threads
WIDE_QUEUES = 3000  # a topic whose queues readers create lazily (a consumer of thousands of queues)
BUSY_QUEUES = 32  # queues the writer fills


@pytest.fixture
def shaken() -> Iterator[None]:
    """Switch threads as often as possible, also inside garbage collections."""
    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()

    def yield_gil(_phase: str, _info: dict[str, Any]) -> None:
        time.sleep(0)  # releases the GIL: another thread runs mid-collection

    sys.setswitchinterval(1e-6)
    gc.set_threshold(50, 5, 5)
    gc.callbacks.append(yield_gil)
    try:
        yield
    finally:
        gc.callbacks.remove(yield_gil)
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)


def body(topic: str, qid: int, qoffset: int) -> bytes:
    return f"{topic}/{qid}/{qoffset}/".encode().ljust(200, b"x")


class Hammer:
    """The threads of one run and the errors they met."""

    def __init__(self, store: Store, deadline: float) -> None:
        self.store = store
        self.deadline = deadline
        self.errors: list[str] = []
        self.written = 0
        self.read = 0
        self.stop = threading.Event()

    def guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                while not self.stop.is_set() and time.monotonic() < self.deadline:
                    fn()
            except BaseException as e:  # every error is the test's failure, with its traceback
                import traceback

                self.errors.append(f"{threading.current_thread().name}: {e!r}\n{traceback.format_exc()}")
                self.stop.set()

        return run

    def write(self, counts: dict[int, int]) -> None:
        batch = []
        for _ in range(16):
            qid = random.randrange(BUSY_QUEUES)
            batch.append(Message("busy", qid, body("busy", qid, counts[qid]), tags=f"T{counts[qid] % 3}"))
            counts[qid] += 1
        res = self.store.put_batch(batch)
        assert res.ok, res
        self.written += len(batch)

    def housekeep(self) -> None:
        self.store.checkpoint(full=random.random() < 0.5)
        self.store.apply_retention()
        self.stop.wait(0.02)  # paced like the real loop: a read still holding a deleted segment finishes

    def read_one(self, positions: dict[tuple[str, int], int]) -> None:
        if random.random() < 0.5:
            key = ("wide", random.randrange(WIDE_QUEUES))
        else:
            key = ("busy", random.randrange(BUSY_QUEUES))
        offset = positions.get(key, 0)
        lo, hi = self.store.bounds(*key)
        assert lo <= hi, (key, lo, hi)
        if random.random() < 0.1:
            found = self.store.offset_for_timestamp(*key, 0)
            assert found >= 0, (key, found)
        if random.random() < 0.5:
            positions[key] = self._get(key, offset)
        else:
            positions[key] = self._read_raw(key, offset)

    def _get(self, key: tuple[str, int], offset: int) -> int:
        res = self.store.get(*key, offset, 16, tags=["T1", "T2"] if random.random() < 0.3 else None)
        if res.status in (GetStatus.OFFSET_TOO_SMALL, GetStatus.NO_MESSAGE):
            return res.next_offset
        if res.status is GetStatus.NO_MATCHED_MESSAGE:  # filtered out, or retention took them after the bounds
            assert res.next_offset > offset, (key, offset, res)
            return res.next_offset
        assert res.status is GetStatus.FOUND, (key, offset, res.status)
        self.check(key, offset, res.messages)
        return res.next_offset

    def _read_raw(self, key: tuple[str, int], offset: int) -> int:
        res = self.store.read_raw(*key, offset, 16)
        if res.status is GetStatus.NO_MATCHED_MESSAGE:  # no filter: retention took them after the bounds were read
            assert res.next_offset > offset, (key, offset, res)
            return res.next_offset
        if res.status is not GetStatus.FOUND:
            assert res.status in (GetStatus.OFFSET_TOO_SMALL, GetStatus.NO_MESSAGE), (key, offset, res.status)
            return res.next_offset
        records: list[Record] = []
        for span in res.spans:
            assert span.path is not None
            try:
                with open(span.path, "rb") as f:
                    f.seek(span.position)
                    data = f.read(span.length)
            except FileNotFoundError:  # retention deleted the segment since (the broker's sendfile holds it open)
                return res.next_offset
            pos = 0
            while pos < len(data):
                rec = decode_record(data, pos, span.path, -1)
                records.append(rec)
                pos += rec.size
        assert len(records) == res.count, (key, offset, len(records), res.count)
        self.check(key, offset, records)
        return res.next_offset

    def check(self, key: tuple[str, int], offset: int, records: list[Record]) -> None:
        offsets = [r.queue_offset for r in records]
        assert offsets == sorted(set(offsets)) and offsets[0] >= offset, (key, offset, offsets)
        for r in records:
            assert (r.topic, r.queue_id) == key and r.body == body(*key, r.queue_offset), (key, r)
        self.read += len(records)


def test_reads_from_many_threads_during_writes_checkpoints_and_retention(tmp_path: Path, shaken: None) -> None:
    config = small_config(
        tmp_path / "store",
        log={"retention_bytes": 512 * 1024},
        cq_flush_interval_ms=5,
        retention_check_interval_ms=10,
        max_open_files=64,
    )
    store = Store.open(config).start()
    try:
        store.create_topic("busy", BUSY_QUEUES)
        store.create_topic("wide", WIDE_QUEUES)
        hammer = Hammer(store, time.monotonic() + RUN_S)
        counts = {q: 0 for q in range(BUSY_QUEUES)}
        work = [("writer", lambda: hammer.write(counts)), ("housekeeper", hammer.housekeep)]
        for i in range(READERS):
            positions: dict[tuple[str, int], int] = {}
            work.append((f"reader-{i}", lambda p=positions: hammer.read_one(p)))  # type: ignore[misc]
        threads = [threading.Thread(target=hammer.guarded(fn), name=name) for name, fn in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RUN_S + 60)
        assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock?)"
        assert store.failure is None, store.failure  # a background thread died: its error says why
        assert not hammer.errors, "\n".join(hammer.errors[:3])
        assert not store._parts.rebuild.marked, store._parts.rebuild.marked  # no false damage
        assert hammer.written > 1000 and hammer.read > 100, (hammer.written, hammer.read)
        assert store.log.min_offset > 0  # retention ran
    finally:
        store.close()


def test_zero_copy_reads_while_segments_roll_under_back_to_back_retention_passes(tmp_path: Path, shaken: None) -> None:
    """Retention passes with nothing to delete still drop the zero-copy reader's
    descriptors of segments no longer in the log: a segment the log rolled to during
    a pass must not be taken for one of them (its descriptor closed under readers)."""
    config = small_config(tmp_path / "store", segment_bytes=16 * 1024, max_message_bytes=2048)
    store = Store.open(config).start()
    try:
        store.create_topic("busy", BUSY_QUEUES)
        hammer = Hammer(store, time.monotonic() + RUN_S / 2)
        counts = {q: 0 for q in range(BUSY_QUEUES)}

        def tail_reader(positions: dict[tuple[str, int], int]) -> None:
            key = ("busy", random.randrange(BUSY_QUEUES))
            positions[key] = hammer._read_raw(key, max(positions.get(key, 0), store.max_offset(*key) - 2))

        work = [("writer", lambda: hammer.write(counts))]
        work += [(f"retention-{i}", lambda: store.apply_retention()) for i in range(2)]  # housekeeping and truncate
        for i in range(READERS):
            positions: dict[tuple[str, int], int] = {}
            work.append((f"reader-{i}", lambda p=positions: tail_reader(p)))  # type: ignore[misc]
        threads = [threading.Thread(target=hammer.guarded(fn), name=name) for name, fn in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RUN_S + 60)
        assert store.failure is None, store.failure
        assert not hammer.errors, "\n".join(hammer.errors[:3])
        assert not store._parts.rebuild.marked, store._parts.rebuild.marked
        assert len(store.log.segments()) > 10 and hammer.read > 100, (len(store.log.segments()), hammer.read)
    finally:
        store.close()


def test_a_zero_copy_read_between_retentions_unlink_and_its_new_log_start_finds_the_records(tmp_path: Path) -> None:
    """Retention unlinks a segment's file a moment before it moves the log's start; a
    pull thread that opens the file in between must not take the records for lost
    (it raised "record extent" and marked a healthy queue for rebuild)."""
    store = Store.open(small_config(tmp_path / "store", segment_bytes=16 * 1024, max_message_bytes=2048)).start()
    try:
        store.create_topic("busy", 1)
        for k in range(200):
            assert store.put(Message("busy", 0, body("busy", 0, k))).ok
        store.catch_up()
        first = Path(store.log.segments()[0][2])
        first.unlink()  # as retention does, under the log's lock, before the new start is published
        res = store.read_raw("busy", 0, 0, 16)
        assert res.status is GetStatus.FOUND and res.count == 16, res
        assert not store._parts.rebuild.marked, store._parts.rebuild.marked
    finally:
        store.abandon()


@pytest.mark.parametrize("mode", ["commitlog", "partition-per-file"])
def test_a_durability_failure_is_the_stores_failure_the_moment_waiters_are_released(tmp_path: Path, mode: str) -> None:
    """The flushing thread fails the durable offset (releasing sync waiters) before the
    store's guard hears of the exception: a waiter woken then must already see the store
    failed, or it reports a flush timeout for what was a failed fsync."""
    from clmq.common import StoreFailedError

    store = Store.open(small_config(tmp_path, storage_mode=mode)).start()
    try:
        seen: list[object] = []
        store.on_durable(10**9, lambda: seen.append(store.failure))
        store._durability().fail(StoreFailedError("commitlog flush", OSError(5, "injected")))
        assert seen and seen[0] is not None and "injected" in str(seen[0])
        assert store.failure is not None and not store.healthy
    finally:
        store.close()
