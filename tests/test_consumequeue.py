"""ConsumeQueue files, the descriptor LRU, the dispatcher and the vectorised parser."""

from __future__ import annotations

import errno
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.commitlog import CommitLog, CommitLogConfig
from clmq.commitlog._encoder import BatchEncoder
from clmq.common import (
    TIMER_TOPIC,
    CorruptRecordError,
    Message,
    decode_record,
    gather_headers,
    timer_tag,
    timer_tag_code,
    walk_records,
)
from clmq.consumequeue import (
    ENTRY,
    ENTRY_DTYPE,
    ENTRY_SIZE,
    HOLE_TAG,
    Arrivals,
    ConsumeQueue,
    ConsumeQueueSet,
    Dispatcher,
    FileCache,
    _dispatch,
    _set,
    tag_hash,
)

from .conftest import msgs
from .faults import Fault, inject


def entries(first_phys: int, n: int) -> bytes:
    return b"".join(ENTRY.pack(first_phys + 100 * i, 100, 7) for i in range(n))


def test_entries_split_across_fixed_size_files(tmp_path: Path) -> None:
    files = FileCache(4)
    cq = ConsumeQueue(tmp_path / "q", "t", 0, 10, files)
    assert cq.append(0, entries(0, 25)) == 25
    cq.flush()
    names = sorted(os.listdir(tmp_path / "q"))
    assert names == ["00000000000000000000", "00000000000000000010", "00000000000000000020"]
    assert [os.path.getsize(tmp_path / "q" / n) for n in names] == [200, 200, 100]
    reopened = ConsumeQueue(tmp_path / "q", "t", 0, 10, files)
    assert reopened.next_offset == 25 and reopened.entry(17) == (1700, 100, 7)
    at, raw = reopened.read_entries(8, 5)
    assert at == 8 and [ENTRY.unpack_from(raw, 20 * i)[0] for i in range(5)] == [800, 900, 1000, 1100, 1200]


def test_append_is_idempotent_and_holes_are_marked(tmp_path: Path) -> None:
    cq = ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4))
    cq.append(0, entries(0, 5))
    assert cq.append(0, entries(0, 5)) == 0  # re-dispatch of the same records
    assert cq.append(3, entries(300, 4)) == 2  # overlap: only the new tail is added
    assert cq.next_offset == 7
    cq.append(9, entries(900, 1))  # offsets 7 and 8 were never seen
    cq.flush()
    assert cq.entry(8) == (0, 0, HOLE_TAG) and cq.entry(9) == (900, 100, 7)
    assert ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4)).entry(7) == (0, 0, HOLE_TAG)


def test_a_hole_across_whole_files_survives_a_reload(tmp_path: Path) -> None:
    """A hole used to be left sparse: a file it covered entirely was never created, and
    the next load cut the queue at the gap, deleting every later file."""
    cq = ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4))
    cq.append(0, entries(0, 5))
    cq.append(25, entries(2500, 3))
    cq.flush()
    again = ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4))
    assert again.next_offset == 28 and again.damage is None
    assert again.entry(26) == (2600, 100, 7) and again.entry(15) == (0, 0, HOLE_TAG)


@pytest.mark.parametrize("damage", ["zeroed", "short", "missing"])
def test_damage_inside_the_extent_is_an_error_not_a_hole(tmp_path: Path, damage: str) -> None:
    """Zeros, a short file or a missing file where the extent says entries are: reads
    (and searches, which skip holes) raise CorruptRecordError naming the file."""
    files = FileCache(4)
    cq = ConsumeQueue(tmp_path / "q", "t", 0, 10, files)
    cq.append(0, entries(100, 30))
    cq.flush()
    victim = tmp_path / "q" / "00000000000000000010"
    if damage == "zeroed":
        with open(victim, "r+b") as f:
            f.seek(3 * ENTRY_SIZE)
            f.write(bytes(2 * ENTRY_SIZE))
    elif damage == "short":
        os.truncate(victim, 3 * ENTRY_SIZE)
    else:
        files.forget(victim)
        victim.unlink()
    for probe in (
        lambda: cq.read_entries(11, 5),
        lambda: cq.read_entries(0, 30),
        lambda: cq.search(lambda e: e[0] >= 100 + 100 * 14),
    ):
        with pytest.raises(CorruptRecordError) as info:
            probe()
        assert info.value.file == str(victim) and info.value.check.startswith("consume queue")
    assert cq.read_entries(0, 10)[1] == entries(100, 10)  # the intact file is still served


def test_truncate_and_search(tmp_path: Path) -> None:
    cq = ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4))
    cq.append(0, entries(0, 35))
    cq.flush()
    assert cq.search(lambda e: e[0] >= 1234) == 13
    assert cq.truncate_past(2050) == 20  # entries whose record ends past 2050 are gone
    assert not (tmp_path / "q" / "00000000000000000030").exists()
    cq.append(20, entries(2000, 1))
    assert cq.next_offset == 21
    cq.truncate(5)
    cq.flush()
    assert ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4)).next_offset == 5


def test_min_offset_follows_truncation_and_retention_of_the_first_entry(tmp_path: Path) -> None:
    """The first entry is remembered (no file read per look-up), never past its change."""
    cq = ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4))
    cq.append(0, entries(1000, 25))
    cq.flush()
    assert cq.min_offset(log_min=0) == 0  # remembered from here on
    assert cq.min_offset(log_min=1250) == 3  # records below 1250 fell out of the log
    cq.truncate(0)  # everything gone (a follower cut back)...
    cq.append(0, entries(400, 4))  # ...and offsets 0.. taken by records that retention has passed
    assert cq.min_offset(log_min=1000) == 4  # not 0, as the remembered entry (at 1000) would say
    cq.reset()
    cq.append(0, entries(9000, 2))
    assert cq.min_offset(log_min=8000) == 0 and cq.min_offset(log_min=9050) == 1


def test_descriptor_cache_stays_bounded(tmp_path: Path) -> None:
    files = FileCache(3)
    for i in range(20):
        files.pwrite(tmp_path / f"f{i}", b"x" * 20, 0)
        assert files.open_count <= 3
    assert files.pread(tmp_path / "f0", 20, 0) == b"x" * 20  # evicted files reopen
    files.close()


def test_a_descriptor_evicted_while_in_use_stays_open_until_its_last_use(tmp_path: Path) -> None:
    """I/O runs outside the cache's lock on a leased descriptor: an eviction meanwhile
    must not close it (the kernel could hand its number to another file)."""
    files = FileCache(1)
    a, b = tmp_path / "a", tmp_path / "b"
    files.pwrite(a, b"a" * 20, 0)
    lease = files._lease(a, False)  # a read of a in progress
    files.pwrite(b, b"b" * 20, 0)  # evicts a
    assert files.open_count == 1
    assert os.pread(lease.fd, 20, 0) == b"a" * 20  # still a's descriptor
    files._release(lease)
    try:
        os.fstat(lease.fd)
        raise AssertionError("the last lease should have closed the evicted descriptor")
    except OSError:
        pass
    files.close()


def test_a_file_forgotten_while_being_opened_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = FileCache(4)
    path = tmp_path / "f"
    files.pwrite(path, b"x" * 20, 0)
    files.forget(path)
    real_open = os.open

    def open_then_delete(file: object, *args: object, **kwargs: object) -> int:
        fd = real_open(file, *args, **kwargs)  # type: ignore[arg-type]
        if file == path:  # another thread deletes this file meanwhile
            files.forget(path)
            path.unlink()
        return fd

    monkeypatch.setattr(os, "open", open_then_delete)
    assert files.pread(path, 20, 0) == b"x" * 20  # the read itself is served
    monkeypatch.undo()
    assert files.open_count == 0  # ... but the deleted file's descriptor is not kept
    files.close()


def test_descriptor_cache_under_concurrent_reads_and_writes(tmp_path: Path) -> None:
    """Threads writing and reading 40 files through a cache of 3 descriptors: every
    read sees its own file's bytes (a descriptor closed or reused under a reader
    would show another file's bytes or fail)."""
    import threading

    files, errors = FileCache(3), []

    def worker(k: int) -> None:
        try:
            for i in range(300):
                n = (k * 7 + i) % 40
                files.pwrite(tmp_path / f"f{n}", bytes([n]) * 64, 0)
                assert files.pread(tmp_path / f"f{n}", 64, 0) == bytes([n]) * 64
        except BaseException as e:  # reported below, with the thread's assertion
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert files.open_count <= 3
    files.close()


def test_dispatch_builds_queues_and_rerunning_it_changes_nothing(tmp_path: Path) -> None:
    lg = CommitLog.open(
        tmp_path / "log",
        CommitLogConfig(segment_bytes=32 * 1024, max_message_bytes=4096),
        clean=False,
        checkpoint_offset=None,
    )
    queues = ConsumeQueueSet(tmp_path / "cq", 16, 8)
    d = Dispatcher(lg, queues, 0, chunk_bytes=8192)
    res = lg.append(msgs("a", 300, 5, size=300) + msgs("b", 40, 2, size=50))
    assert d.lag_bytes == lg.write_offset
    assert d.catch_up() == 340 and d.lag_bytes == 0
    snapshot = {k: queues.queue(*k).read_entries(0, 1000) for k in queues.known()}
    again = Dispatcher(lg, queues, 0, chunk_bytes=5000)  # different chunking, same result
    again.catch_up()
    assert {k: queues.queue(*k).read_entries(0, 1000) for k in queues.known()} == snapshot
    a3 = queues.queue("a", 3)
    assert a3.next_offset == 60
    phys = [o for o, m in zip(res.commitlog_offsets, msgs("a", 300, 5)) if m.queue_id == 3]
    assert [a3.entry(i)[0] for i in range(60)] == phys
    assert a3.entry(0)[2] == tag_hash("T0")
    lg.close()


def test_dispatch_wakes_listeners_with_the_queues_it_touched(tmp_path: Path) -> None:
    lg = CommitLog.open(tmp_path / "log", CommitLogConfig(), clean=False, checkpoint_offset=None)
    d = Dispatcher(lg, ConsumeQueueSet(tmp_path / "cq", 16, 8), 0)
    seen: list[Arrivals] = []
    d.add_listener(seen.append)
    lg.append([Message("x", 1, b"a"), Message("y", 0, b"b"), Message("x", 1, b"c")])
    d.dispatch_once()
    assert len(seen) == 1 and set(seen[0]) == {("x", 1), ("y", 0)} and len(seen[0]) == 2
    assert ("x", 1) in seen[0] and ("x", 0) not in seen[0] and ("nope", 1) not in seen[0]
    lg.close()


sizes = st.lists(st.integers(0, 700), min_size=1, max_size=120)


@given(sizes, st.booleans())
@settings(max_examples=60, deadline=None)
def test_vectorised_walk_agrees_with_decoding_one_by_one(body_sizes: list[int], uniform: bool) -> None:
    rng = random.Random(len(body_sizes))
    if uniform:
        body_sizes = [body_sizes[0]] * len(body_sizes)
    batch = [
        Message(rng.choice(["t", "topic-two"]), rng.randrange(9), b"z" * n, tags=rng.choice(["", "A", "BB"]))
        for n in body_sizes
    ]
    data = bytes(BatchEncoder(1 << 30, 1 << 20, ("1.2.3.4", 5)).encode(batch, 4096, 0, {}, {}, 77).groups[0].data)
    cut = len(data) - rng.randrange(0, 50)  # sometimes a torn last record
    walk = walk_records(data[:cut])
    expected, p = [], 0
    while p < cut:
        size = int.from_bytes(data[p : p + 4], "little")
        if p + size > cut:
            break
        expected.append(p)
        p += size
    assert walk.starts.tolist() == expected and walk.stop == p
    heads = gather_headers(np.frombuffer(data, np.uint8), walk)
    decoded = [decode_record(data, s) for s in expected]
    assert heads["queue_id"].tolist() == [r.queue_id for r in decoded]
    assert heads["commitlog_offset"].tolist() == [r.commitlog_offset for r in decoded]
    assert heads["total_size"].tolist() == [r.size for r in decoded]


def test_nothing_past_the_confirmed_offset_is_dispatched(tmp_path: Path) -> None:
    lg = CommitLog.open(tmp_path / "log", CommitLogConfig(), clean=False, checkpoint_offset=None)
    queues = ConsumeQueueSet(tmp_path / "cq", 16, 8)
    d = Dispatcher(lg, queues, 0)
    res = lg.append(msgs("t", 10, 1))
    lg.set_confirmed_offset(res.commitlog_offsets[4])  # e.g. replicated up to here
    d.catch_up()
    assert queues.queue("t", 0).next_offset == 4
    lg.set_confirmed_offset(None)
    d.catch_up()
    assert queues.queue("t", 0).next_offset == 10
    lg.close()


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "bb", "topic.c"]),
            st.integers(0, 5),
            st.sampled_from(["", "T1", "TagB"]),
            st.binary(max_size=200),
        ),
        min_size=1,
        max_size=60,
    )
)
@settings(max_examples=40, deadline=None)
def test_small_rounds_parse_like_large_ones(records: list[tuple[str, int, str, bytes]]) -> None:
    """The per-record path for small rounds and the vectorised one give the same columns."""
    with tempfile.TemporaryDirectory() as tmp:
        lg = CommitLog.open(Path(tmp) / "log", CommitLogConfig(), clean=False, checkpoint_offset=None)
        lg.append([Message(t, q, b, tags=g) for t, q, g, b in records])
        d = Dispatcher(lg, ConsumeQueueSet(Path(tmp) / "cq", 16, 8), 0)
        at, data = lg.map_chunk(0, 1 << 20, lg.confirmed_offset)
        walk = walk_records(data)
        small = d._parse_small(data, walk.starts.tolist())
        saved, _dispatch.SMALL_ROUND = _dispatch.SMALL_ROUND, 0
        try:
            large, _consumed = d._parse(at, data)
        finally:
            _dispatch.SMALL_ROUND = saved
        assert large is not None
        for a, b in zip(small, large):
            assert np.array_equal(a, b)
        lg.close()


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), max_size=40),
)
def test_small_merges_group_queue_runs_like_large_ones(rows: list[tuple[int, int]]) -> None:
    """A round's entries grouped into per-queue runs in plain Python (few entries) and
    with numpy: the same runs (stable within a queue, cut where queue offsets skip)."""
    codes = np.array([c for c, _ in rows], dtype=np.uint64)
    qoffs = np.array([q for _, q in rows], dtype=np.int64)
    entries = np.zeros(len(rows), dtype=ENTRY_DTYPE)
    entries["offset"] = np.arange(len(rows)) * 100
    entries["size"] = 100
    small = _set._queue_runs(codes, qoffs, entries)
    saved, _set.SMALL_MERGE_ENTRIES = _set.SMALL_MERGE_ENTRIES, -1
    try:
        assert _set._queue_runs(codes, qoffs, entries) == small
    finally:
        _set.SMALL_MERGE_ENTRIES = saved


def test_a_queue_starting_inside_a_file_has_no_zeroed_entries(tmp_path: Path) -> None:
    """A queue whose first record is at offset 13 (retention took the earlier ones)
    writes its file from entry 13 on: the bytes before are no entries, not damage."""
    cq = ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4))
    cq.append(13, entries(1300, 4))
    cq.flush()
    again = ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4))
    assert again.first_offset == 13  # from the start marker in slot 0
    assert again.first_zeroed() is None
    assert again.read_entries(13, 4) == (13, entries(1300, 4))
    with open(tmp_path / "q" / "00000000000000000010", "r+b") as f:
        f.seek(5 * ENTRY_SIZE)
        f.write(bytes(ENTRY_SIZE))
    assert again.first_zeroed() == 15


def test_a_failed_flush_keeps_the_queue_appendable_and_loses_nothing(tmp_path: Path) -> None:
    """A write that fails (disk full) leaves the entries in memory; the error, kept
    alive by whoever logged it, must not pin the buffer so that appends then fail."""
    cq = ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4))
    cq.append(0, entries(0, 15))
    with inject(Fault("pwrite", errno.ENOSPC, path="/q/", after=1)), pytest.raises(OSError) as kept:
        cq.flush()
    assert kept.value.errno == errno.ENOSPC
    cq.append(15, entries(1500, 5))  # raised BufferError while the error was alive
    cq.flush()
    assert ConsumeQueue(tmp_path / "q", "t", 0, 10, FileCache(4)).read_entries(0, 20) == (
        0,
        entries(0, 15) + entries(1500, 5),
    )


@pytest.mark.parametrize("n", [3, 400])  # a small round (record by record) and a vectorised one
def test_a_timer_record_s_entry_holds_its_due_time_as_the_tag_code(tmp_path: Path, n: int) -> None:
    lg = CommitLog.open(tmp_path / "log", CommitLogConfig(), clean=False, checkpoint_offset=None)
    queues = ConsumeQueueSet(tmp_path / "cq", 1024, 8)
    d = Dispatcher(lg, queues, 0)
    due = [1_795_000_000_000 + 7 * i for i in range(n)]
    batch = []
    for when in due:
        batch.append(Message(TIMER_TOPIC, 0, b"x", timer_tag(when)))
        batch.append(Message("plain", 0, b"y", timer_tag(when)))  # the same tags elsewhere: a hash as ever
    lg.append(batch)
    d.catch_up()
    timer, plain = queues.queue(TIMER_TOPIC, 0), queues.queue("plain", 0)
    assert [timer.entry(i)[2] for i in range(n)] == due
    assert [plain.entry(i)[2] for i in range(n)] == [tag_hash(timer_tag(w)) for w in due]
    lg.close()


@given(st.binary(max_size=20))
def test_a_timer_tag_code_is_its_digits_or_zero(raw: bytes) -> None:
    code = timer_tag_code(raw)
    assert code == (int(raw) if raw.isdigit() and len(raw) <= 15 else 0)
    assert 0 <= code < 10**15


@pytest.mark.parametrize("collector_on", [True, False])
def test_a_merge_that_makes_many_queues_writes_them_where_they_belong_and_leaves_the_collector_as_it_was(
    tmp_path: Path, collector_on: bool
) -> None:
    # A new topic's first round makes its queues in the merge, with the collector paused
    # and each queue's folder joined only when first needed: the files must still land
    # in cq/<topic>/<queue id>, and an application's collector setting must survive.
    import gc

    queues = ConsumeQueueSet(tmp_path / "cq", 16, 8)
    tid = queues.topic_id("t")
    n = 3000
    codes = (np.uint64(tid) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
    rows = np.zeros(n, dtype=ENTRY_DTYPE)
    rows["offset"], rows["size"] = np.arange(n) * 100, 100
    was = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    try:
        queues.add_round(codes, np.zeros(n, dtype=np.int64), rows)
        queues.merge()
        assert gc.isenabled() is collector_on
    finally:
        (gc.enable if was else gc.disable)()
    assert queues.queue("t", 2999).directory == tmp_path / "cq" / "t" / "2999"
    queues.flush()
    assert sorted(os.listdir(tmp_path / "cq" / "t" / "2999")) == ["00000000000000000000"]
    reopened = ConsumeQueueSet(tmp_path / "cq", 16, 8)
    assert reopened.queue("t", 2999).entry(0) == (2999 * 100, 100, 0)
