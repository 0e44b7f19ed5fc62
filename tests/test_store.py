"""The store facade: put/get, bad input, offsets, restarts, scale, and a full disk."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.store import GetStatus, PartitionStore, PutStatus, Store
from clmq.commitlog import now_ms
from clmq.common import Message, PackedMessages, pack_messages
from tests.waiting import wait_until

from .conftest import msgs, small_config


def test_put_then_get_in_order_per_queue(store: Store) -> None:
    res = store.put_batch(msgs("orders", 200, 4))
    assert res.ok and res.queue_offsets[:8] == [0, 0, 0, 0, 1, 1, 1, 1]
    store.catch_up()
    got = store.get("orders", 2, 0, 100)
    assert got.status is GetStatus.FOUND and [m.queue_offset for m in got.messages] == list(range(50))
    assert [m.body[:8] for m in got.messages] == [b"%08d" % i for i in range(2, 200, 4)]
    assert got.next_offset == 50 and (got.min_offset, got.max_offset) == (0, 50)
    assert store.get("orders", 2, 50, 10).status is GetStatus.NO_MESSAGE
    assert store.get("orders", 2, 51, 10).status is GetStatus.OFFSET_OVERFLOW
    assert store.get("orders", 9, 0, 10).status is GetStatus.NO_QUEUE


@pytest.mark.parametrize(
    ("message", "status", "text"),
    [
        (Message("orders", 0, b"x" * 9000), PutStatus.MESSAGE_TOO_LARGE, "max_message_bytes=8192"),
        (Message("", 0, b"x"), PutStatus.INVALID_TOPIC, "empty"),
        (Message("bad/name", 0, b"x"), PutStatus.INVALID_TOPIC, "invalid topic name"),
        (Message("nosuch", 0, b"x"), PutStatus.UNKNOWN_TOPIC, "does not exist"),
        (Message("orders", -1, b"x"), PutStatus.INVALID_QUEUE_ID, "queue id -1"),
        (Message("orders", 4, b"x"), PutStatus.INVALID_QUEUE_ID, "not in 0..3"),
    ],
)
def test_bad_input_is_a_specific_result_and_writes_nothing(
    store: Store, message: Message, status: PutStatus, text: str
) -> None:
    end = store.end_offset
    res = store.put_batch([Message("orders", 0, b"fine"), message])
    assert res.status is status and text in res.error
    assert store.end_offset == end


def test_tag_filter_uses_hashes_and_rechecks_strings(store: Store) -> None:
    store.put_batch(msgs("orders", 300, 1))
    store.catch_up()
    got = store.get("orders", 0, 0, 1000, tags=["T1", "T2"])
    assert [m.tags for m in got.messages] == [f"T{i % 3}" for i in range(300) if i % 3]
    none = store.get("orders", 0, 0, 10, tags=["nope"])
    assert none.status is GetStatus.NO_MATCHED_MESSAGE and none.next_offset == 300


def test_offset_for_timestamp(store: Store) -> None:
    first = store.put_batch(msgs("orders", 10, 1))
    wait_until(lambda: now_ms() > first.store_timestamp_ms, 1, "the store's clock to pass the first batch's timestamp")
    middle = now_ms()
    wait_until(lambda: now_ms() > middle, 1, "the store's clock to pass the middle")
    store.put_batch(msgs("orders", 10, 1, start=10))
    store.catch_up()
    assert store.offset_for_timestamp("orders", 0, 0) == 0
    assert store.offset_for_timestamp("orders", 0, middle) == 10
    assert store.offset_for_timestamp("orders", 0, middle + 10**9) == 20


def test_long_poll_wakes_when_entries_are_dispatched(store: Store) -> None:
    import threading

    woke: list[bool] = []
    # The put must come while the waiter is blocked (else its first check finds the entry
    # and nothing is woken): note when it goes to sleep on the store's condition. It holds
    # the condition's lock until then, so the put cannot notify before it sleeps.
    asleep, condition = threading.Event(), store._new_entries
    real_wait = condition.wait

    def noted_wait(timeout: float | None = None) -> bool:
        asleep.set()
        return real_wait(timeout)

    condition.wait = noted_wait  # type: ignore[method-assign]
    waiter = threading.Thread(target=lambda: woke.append(store.wait_for_entries("orders", 1, 0, 5)))
    waiter.start()
    assert asleep.wait(5), "the waiter did not block on the store's condition"
    store.put(Message("orders", 1, b"hi"))
    waiter.join(5)
    assert woke == [True]
    assert store.wait_for_entries("orders", 3, 0, 0.05) is False


def test_clean_restart_keeps_everything_and_continues_offsets(store_dir: Path, mode: str) -> None:
    cfg = small_config(store_dir, mode=mode)
    with Store.open(cfg).start() as s:
        s.create_topic("t", 3)
        s.put_batch(msgs("t", 300, 3, size=500))
    with Store.open(cfg).start() as s:
        assert [s.max_offset("t", q) for q in range(3)] == [100, 100, 100]
        assert s.put(Message("t", 1, b"next")).queue_offsets == [100]
        s.catch_up()
        assert s.get("t", 1, 100, 1).messages[0].body == b"next"


def test_a_second_process_cannot_open_the_same_directory(store_dir: Path) -> None:
    with Store.open(small_config(store_dir)):
        code = (
            "import sys; sys.path.insert(0, %r)\n"
            "from broker.store import Store, StoreLockedError\nfrom tests.conftest import small_config\n"
            "try:\n    Store.open(small_config(%r))\nexcept StoreLockedError as e:\n    print('LOCKED', e)\n"
        ) % (str(Path(__file__).parents[1]), str(store_dir))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert "LOCKED" in out.stdout and "in use by another process" in out.stdout, out.stderr


def test_ten_thousand_queues_with_bounded_descriptors(tmp_path: Path, mode: str) -> None:
    cfg = small_config(tmp_path / "s", segment_bytes=4 << 20, max_open_files=128, cq_entries_per_file=1000, mode=mode)
    queues = 10_000
    before = _open_fds()  # the worker's own (an xdist worker has run other tests: CI saw 114)
    with Store.open(cfg).start() as s:
        s.create_topic("many", queues)
        for round_ in range(3):
            assert s.put_batch(msgs("many", queues, queues, size=50, start=round_ * queues)).ok
        s.catch_up()
        s.checkpoint()
        assert _store_fds(s) <= 128
        assert _open_fds() - before < 128 + 100
    with Store.open(cfg).start() as s:
        for q in range(queues):
            got = s.get("many", q, 0, 10)
            assert [m.queue_offset for m in got.messages] == [0, 1, 2], q
            assert [m.body[:8] for m in got.messages] == [b"%08d" % (q + r * queues) for r in range(3)]
        assert _store_fds(s) <= 128


def _store_fds(s: Store) -> int:
    files = s.files if isinstance(s, PartitionStore) else s.queues.files
    return files.open_count


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem (tmpfs), so that writes fail with ENOSPC."""
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_is_an_error_and_the_store_stays_usable(tiny_fs: Path, mode: str) -> None:
    filler = tiny_fs / "filler"
    filler.write_bytes(b"\0" * 400 * 1024)  # what the operator will delete
    cfg = small_config(tiny_fs / "store", segment_bytes=128 * 1024, mode=mode)
    s = Store.open(cfg).start()
    s.create_topic("t", 2)
    acked: list[bytes] = []
    full = None
    for i in range(2000):
        batch = msgs("t", 10, 2, size=1000, start=i * 10)
        res = s.put_batch(batch)
        if not res.ok:
            full = res
            break
        acked += [m.body for m in batch]
    assert full is not None and full.status is PutStatus.DISK_FULL and "No space left" in full.error
    end = s.end_offset
    assert s.put_batch(msgs("t", 10, 2, size=1000)).status is PutStatus.DISK_FULL
    assert s.end_offset == end  # nothing half-written
    s.catch_up()
    bodies = [m.body for q in range(2) for m in s.get("t", q, 0, 10_000).messages]
    assert sorted(bodies) == sorted(acked)  # reads keep working on a full disk
    filler.unlink()  # space is freed: appends work again, no restart needed
    more = msgs("t", 10, 2, size=1000, start=10**6)
    res = s.put_batch(more)
    assert res.ok, res.error
    acked += [m.body for m in more]
    s.close()
    with Store.open(cfg) as s:
        bodies = [m.body for q in range(2) for m in s.get("t", q, 0, 10_000).messages]
        assert sorted(bodies) == sorted(acked)


def test_close_on_a_full_disk_loses_nothing(tiny_fs: Path, mode: str) -> None:
    cfg = small_config(tiny_fs / "store", segment_bytes=128 * 1024, cq_entries_per_file=10_000, mode=mode)
    s = Store.open(cfg)
    s.create_topic("t", 50)
    with open(tiny_fs / "pad", "wb", buffering=0) as pad:  # created while there is room for its inode
        acked = 0
        while s.put_batch(msgs("t", 50, 50, size=500, start=acked)).ok:
            acked += 50
        s.catch_up()
        while True:  # take every last byte, so queue files cannot grow
            try:
                pad.write(b"\0" * 512)
            except OSError:
                break
    s.close()  # cannot write queue files: leaves an unclean marker instead of losing them
    (tiny_fs / "pad").unlink()
    with Store.open(cfg) as s:
        assert sum(s.max_offset("t", q) for q in range(50)) == acked


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
stored = st.builds(
    Message,
    topic=st.sampled_from(["a", "b.c", "%RETRY%g"]),
    queue_id=st.integers(0, 2),
    body=st.binary(max_size=2000),
    tags=texts,
    keys=texts,
    properties=st.dictionaries(texts, texts, max_size=3),
    born_timestamp_ms=st.integers(1, 2**62),
    born_host=st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
)


@given(
    batches=st.lists(st.lists(stored, min_size=1, max_size=20), min_size=1, max_size=6),
    clean=st.booleans(),
    packed=st.booleans(),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_messages_round_trip_through_a_restart(
    tmp_path: Path, mode: str, batches: list[list[Message]], clean: bool, packed: bool
) -> None:
    """As message objects or packed the way producers send them (one packed batch per
    topic of each put), every field comes back."""
    cfg = small_config(tmp_path / uuid.uuid4().hex, segment_bytes=16 * 1024, max_message_bytes=4096, mode=mode)
    s = Store.open(cfg)
    for topic in ("a", "b.c", "%RETRY%g"):
        s.create_topic(topic, 3)
    order: list[Message] = []  # as stored
    for batch in batches:
        if packed:
            by_topic = {t: [m for m in batch if m.topic == t] for t in dict.fromkeys(m.topic for m in batch)}
            result = s.put_packed([PackedMessages(t, pack_messages(ms), ms[0].born_host) for t, ms in by_topic.items()])
            assert result.ok and result.batch_sizes == [len(ms) for ms in by_topic.values()]
            order += [m for ms in by_topic.values() for m in ms]
        else:
            assert s.put_batch(batch).ok
            order += batch
    s.close() if clean else s.abandon()
    with Store.open(cfg) as s:
        expected: dict[tuple[str, int], list[Message]] = {}
        for m in order:
            expected.setdefault((m.topic, m.queue_id), []).append(m)
        for (topic, q), sent in expected.items():
            got = s.get(topic, q, 0, 1000).messages
            assert [(r.body, r.tags, r.keys, r.properties, r.born_timestamp_ms) for r in got] == [
                (m.body, m.tags, m.keys, dict(m.properties), m.born_timestamp_ms) for m in sent
            ]
            assert [r.queue_offset for r in got] == list(range(len(sent)))


def test_retention_moves_queue_minimums_and_deletes_their_files(tmp_path: Path, mode: str) -> None:
    cfg = small_config(
        tmp_path / "s",
        segment_bytes=32 * 1024,
        max_message_bytes=4096,
        cq_entries_per_file=10,
        log={"retention_bytes": 64 * 1024, "retention_ms": None},
        mode=mode,
    )
    queue_dir = tmp_path / "s" / ("consumequeue/t/0" if mode == "commitlog" else "partitions/t-0")
    with Store.open(cfg) as s:
        s.create_topic("t", 2)
        for i in range(0, 400, 20):  # batches, so that partitions roll segments too
            s.put_batch(msgs("t", 20, 2, size=900, start=i))
        s.catch_up()
        s.checkpoint()
        files_before = len(list(queue_dir.iterdir()))
        assert s.apply_retention() > 0
        lo = s.min_offset("t", 0)
        assert lo > 0 and s.get("t", 0, lo, 1).messages[0].queue_offset == lo
        too_small = s.get("t", 0, 0, 5)
        assert too_small.status is GetStatus.OFFSET_TOO_SMALL and too_small.next_offset == lo
        assert len(list(queue_dir.iterdir())) < files_before
    with Store.open(cfg) as s:  # and after a restart
        assert s.min_offset("t", 0) == lo and s.max_offset("t", 0) == 200
        assert s.put(Message("t", 0, b"x")).queue_offsets == [200]


def test_sync_flush_acks_only_durable_bytes_and_reports_timeouts(store_dir: Path, mode: str) -> None:
    from clmq.commitlog import FlushMode

    cfg = small_config(store_dir, log={"flush_mode": FlushMode.SYNC, "sync_flush_timeout_ms": 100}, mode=mode)
    s = Store.open(cfg).start()
    s.create_topic("t", 1)
    res = s.put(Message("t", 0, b"durable"))
    assert res.ok and s.durable_offset >= res.end_offset
    s.close()
    s = Store.open(cfg)  # not started: no flusher thread, so nothing becomes durable
    res = s.put(Message("t", 0, b"stuck"))
    assert res.status is PutStatus.FLUSH_DISK_TIMEOUT and "sync_flush_timeout_ms=100" in res.error
    assert res.queue_offsets == [1]  # it was written, just not confirmed durable
    s.close()


def test_truncation_cuts_queues_and_continues_offsets(store_dir: Path) -> None:
    store = Store.open(small_config(store_dir))  # a replication hook of the CommitLog mode
    store.create_topic("orders", 4)
    res = store.put_batch(msgs("orders", 40, 4))
    cut = res.commitlog_offsets[22]  # keeps messages 0..21: queues 0,1 have 6; 2,3 have 5
    store.truncate(cut)
    assert [store.max_offset("orders", q) for q in range(4)] == [6, 6, 5, 5]
    assert store.put(Message("orders", 2, b"new")).queue_offsets == [5]
    store.catch_up()
    assert store.get("orders", 2, 5, 1).messages[0].body == b"new"
    store.close()


@pytest.mark.parametrize("confirmed_at", [0, 10, 22, 30])
def test_truncation_above_the_confirmed_offset_continues_after_records_not_dispatched(
    store_dir: Path, confirmed_at: int
) -> None:
    """A follower dispatches only up to the confirmed offset; a cut above it keeps
    records that are in no queue yet. Their queue offsets must not be given again
    (found by the failover chaos run: a promoted follower acknowledged a batch at the
    queue offsets of an earlier one, which consumers then never saw)."""
    store = Store.open(small_config(store_dir))
    store.create_topic("orders", 4)
    store.log.set_confirmed_offset(0)  # a follower's view: nothing dispatched past it
    res = store.put_batch(msgs("orders", 40, 4))
    store.log.set_confirmed_offset(res.commitlog_offsets[confirmed_at])
    store.catch_up()
    store.truncate(res.commitlog_offsets[22])  # keeps messages 0..21: queues 0,1 have 6; 2,3 have 5
    assert store.put(Message("orders", 2, b"new")).queue_offsets == [5]
    store.log.set_confirmed_offset(None)  # promoted: the whole log is visible
    store.catch_up()
    assert [store.max_offset("orders", q) for q in range(4)] == [6, 6, 6, 5]
    assert store.get("orders", 2, 5, 1).messages[0].body == b"new"
    store.close()


def _runs_by_loop(offsets: list[int], sizes: list[int], max_run_bytes: int) -> list[tuple[int, int]]:
    """The definition, one record at a time."""
    runs, i = [], 0
    while i < len(offsets):
        j = i + 1
        while (
            j < len(offsets) and offsets[j] == offsets[j - 1] + sizes[j - 1] and offsets[j] - offsets[i] < max_run_bytes
        ):
            j += 1
        runs.append((i, j))
        i = j
    return runs


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 50)), max_size=60), st.integers(1, 200))
def test_contiguous_runs_match_their_definition(gaps_sizes: list[tuple[int, int]], max_run_bytes: int) -> None:
    """Reads coalesce records that follow each other in the log into one send; the
    array version must cut exactly where the record-by-record definition does."""
    import numpy as np

    from clmq.broker.store._store import _contiguous_runs

    offsets, sizes, at = [], [], 1000
    for gap, size in gaps_sizes:  # gap 0: this record follows the previous one
        at += gap
        offsets.append(at)
        sizes.append(size)
        at += size
    got = _contiguous_runs(np.array(offsets, dtype=np.uint64), np.array(sizes, dtype=np.uint32), max_run_bytes)
    assert got == _runs_by_loop(offsets, sizes, max_run_bytes)


def test_read_raw_many_reads_queues_in_order_within_the_bounds(store: Store) -> None:
    """Both modes: queues in the order asked, each up to the per-queue limit, all of
    them up to max_messages and max_bytes (a first record past it answered alone), the
    rest not read (None); early answers as read_raw's."""
    store.put_batch([Message("orders", i % 3, b"m%03d" % i + b"." * 200, "a" if i % 2 else "b") for i in range(60)])
    store.catch_up()
    asks = [
        ("orders", 2, 0, None),
        ("orders", 0, 5, ["a"]),
        ("orders", 3, 0, None),
        ("orders", 1, 999, None),
        ("orders", 1, 0, None),
    ]
    got = store.read_raw_many(asks, 25, 10, 1 << 20)
    assert [r.status if r is not None and not isinstance(r, Exception) else r for r in got] == [
        GetStatus.FOUND,
        GetStatus.FOUND,
        GetStatus.NO_MESSAGE,
        GetStatus.OFFSET_OVERFLOW,
        GetStatus.FOUND,
    ]
    counts = [r.count for r in got if r is not None and not isinstance(r, Exception)]
    assert counts == [10, 8, 0, 0, 7]  # 25 in all: the last queue gets what is left (8 of queue 0 are tagged a)
    for ask, r in zip(asks, got):
        alone = store.read_raw(ask[0], ask[1], ask[2], 10, ask[3])
        assert r is not None and not isinstance(r, Exception)
        assert (r.next_offset, r.min_offset, r.max_offset) == (
            alone.next_offset,
            alone.min_offset,
            alone.max_offset,
        ) or (ask[1] == 1 and ask[2] == 0)
    size = store.read_raw("orders", 0, 0, 1).nbytes
    few = store.read_raw_many(asks[:2], 100, 10, 3 * size)
    assert [r.count if r is not None and not isinstance(r, Exception) else r for r in few] == [3, None]
    one = store.read_raw_many(asks[:2], 100, 10, 1)  # a first record larger than max_bytes: alone
    assert [r.count if r is not None and not isinstance(r, Exception) else r for r in one] == [1, None]
