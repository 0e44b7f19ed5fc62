"""The CommitLog-mode store never serves another queue's record and never loses a
message the log still holds, whatever happened to the files between two runs.

Every test damages real files of a real store between a close and an open (or under
a running store), then checks one of two outcomes: every acknowledged message reads
back exactly (rebuilt from the log), or the read fails with a named corruption error
and the queue is rebuilt at the next open. Never: a record of another queue, or a
message silently skipped.
"""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.store import PutStatus, Store, StoreConfig
from clmq.common import HEADER_SIZE, CorruptRecordError, LogDamageError, Message
from clmq.consumequeue import ENTRY, ENTRY_DTYPE, ENTRY_SIZE, affected_queues

from .conftest import small_config
from .faults import Fault, inject
from .waiting import wait_until

QUEUES = 3
PER_FILE = 16  # entries per queue file: several files per queue


def config(path: Path, **more: Any) -> StoreConfig:
    more.setdefault("cq_entries_per_file", PER_FILE)
    return small_config(path, segment_bytes=16 * 1024, max_message_bytes=2048, **more)


def body(q: int, i: int) -> bytes:
    return b"q%d-m%05d" % (q, i) + b"." * (40 + (i * 7) % 60)


def fill(path: Path, per_queue: int = 60, topic: str = "a") -> dict[int, list[bytes]]:
    """A cleanly closed store holding ``per_queue`` messages in each queue of ``topic``."""
    sent: dict[int, list[bytes]] = {q: [] for q in range(QUEUES)}
    with Store.open(config(path)) as s:
        s.create_topic(topic, QUEUES)
        for i in range(per_queue):
            batch = [Message(topic, q, body(q, i), tags="T") for q in range(QUEUES)]
            assert s.put_batch(batch).ok
            for q in range(QUEUES):
                sent[q].append(batch[q].body)
        s.catch_up()
    return sent


def read_all(s: Store, topic: str, q: int, start: int = 0) -> list[bytes]:
    """Every message of a queue through ``get`` (decoded path), checking identity."""
    out: list[bytes] = []
    offset = start
    while True:
        res = s.get(topic, q, offset, 7)
        if not res.messages:
            assert res.next_offset >= s.max_offset(topic, q) or res.status.name != "FOUND"
            return out
        for r in res.messages:
            assert (r.topic, r.queue_id) == (topic, q) and r.queue_offset >= offset
        out += [r.body for r in res.messages]
        offset = res.next_offset


def raw_records(s: Store, topic: str, q: int, offset: int, n: int) -> list[tuple[str, int, int, bytes]]:
    """What the zero-copy path would send: ``(topic, queue id, queue offset, bytes)``."""
    res = s.read_raw(topic, q, offset, n)
    out = []
    for span in res.spans:
        with open(span.path, "rb") as f:
            f.seek(span.position)
            data = f.read(span.length)
        pos = 0
        while pos < len(data):
            size, _m, _c, _cl, qoff, qid = struct.unpack_from("<IIIQQI", data, pos)
            tl = struct.unpack_from("<H", data, pos + 92)[0]
            out.append(
                (
                    data[pos + HEADER_SIZE : pos + HEADER_SIZE + tl].decode("utf-8", "replace"),
                    qid,
                    qoff,
                    data[pos : pos + size],
                )
            )
            pos += size
    return out


def queue_file(path: Path, topic: str, q: int, start: int) -> Path:
    return path / "consumequeue" / topic / str(q) / f"{start:020d}"


# ------------------------------------------------------------ wrong records served
def test_a_shortened_newest_segment_never_serves_another_queues_records(tmp_path: Path) -> None:
    """The user's case: the newest segment lost its tail (at a record boundary), the
    store opened cleanly, and old offsets of queue a/q then returned the records of b
    written after the reopen (same sizes, so they landed exactly where a's had been)."""
    sent = fill(tmp_path)
    newest = max((tmp_path / "commitlog").glob("*.log"))
    base = int(newest.stem)
    lost = sorted(
        (int(e["offset"]), q, i)
        for q in range(QUEUES)
        for i, e in enumerate(_entries(tmp_path, "a", q))
        if e["offset"] >= base
    )
    cut = lost[len(lost) // 2][0]
    os.truncate(newest, cut - base)
    try:
        s = Store.open(config(tmp_path))
    except LogDamageError as e:  # refused at open: the log end is checked against the checkpoint
        assert e.queues and {t for t, *_ in e.queues} == {"a"}
        return
    with s:
        s.create_topic("b", QUEUES)
        for _off, q, i in lost[len(lost) // 2 :]:  # the same sizes, in the same order: aligned records
            assert s.put(Message("b", q, body(q, i), tags="T")).ok
        s.catch_up()
        for q in range(QUEUES):
            for offset in range(0, s.max_offset("a", q), 5):
                try:
                    got = s.get("a", q, offset, 5).messages
                except CorruptRecordError:
                    got = []
                for r in got:
                    assert (r.topic, r.queue_id) == ("a", q) and r.body == sent[q][r.queue_offset]
                try:
                    raws = raw_records(s, "a", q, offset, 5)
                except CorruptRecordError:
                    raws = []
                assert all((t, qid) == ("a", q) for t, qid, _o, _d in raws)


def _entries(path: Path, topic: str, q: int) -> np.ndarray:
    qdir = path / "consumequeue" / topic / str(q)
    parts = [np.fromfile(p, dtype=ENTRY_DTYPE) for p in sorted(qdir.iterdir()) if p.name.isdigit()]
    return np.concatenate(parts)


def _rewrite_entry(
    path: Path, topic: str, q: int, offset: int, entry: tuple[int, int, int], per_file: int = PER_FILE
) -> None:
    start = offset - offset % per_file
    with open(queue_file(path, topic, q, start), "r+b") as f:
        f.seek((offset - start) * ENTRY_SIZE)
        f.write(ENTRY.pack(*entry))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(victim=st.integers(0, 59), donor_queue=st.integers(0, QUEUES - 1), donor=st.integers(0, 59), raw=st.booleans())
def test_an_entry_pointing_at_another_record_is_refused_and_rebuilt(
    tmp_path_factory: pytest.TempPathFactory, victim: int, donor_queue: int, donor: int, raw: bool
) -> None:
    """A queue entry that points at some other valid record (another queue's, or this
    queue's at another offset): the read fails naming the field; the next open rebuilds."""
    if donor_queue == 0 and donor == victim:
        return
    path = tmp_path_factory.mktemp("entry")
    sent = fill(path)
    donor_entry = _entries(path, "a", donor_queue)[donor]
    _rewrite_entry(
        path, "a", 0, victim, (int(donor_entry["offset"]), int(donor_entry["size"]), int(donor_entry["tag"]))
    )
    with Store.open(config(path)) as s:
        with pytest.raises(CorruptRecordError) as info:
            if raw:
                raw_records(s, "a", 0, victim, 3)
            else:
                s.get("a", 0, victim, 3)
        assert info.value.check in {"queue id", "queue offset", "topic"}
        assert info.value.file.endswith(".log")
    assert (path / "rebuild-queues").exists()
    with Store.open(config(path)) as s:  # marked for rebuild: rebuilt from the log at this open
        assert not (path / "rebuild-queues").exists() and not (path / "rebuild-queues.prev").exists()
        assert read_all(s, "a", 0) == sent[0]
        assert [r[1:3] for r in raw_records(s, "a", 0, victim, 1)] == [(0, victim)]


# ------------------------------------------------------- damaged queue files
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(q=st.integers(0, QUEUES - 1), first=st.integers(0, 59), count=st.integers(1, 20))
def test_zeroed_entries_are_never_skipped(
    tmp_path_factory: pytest.TempPathFactory, q: int, first: int, count: int
) -> None:
    """Entries zeroed inside the checkpointed extent (a lost page): a read refuses
    them instead of skipping them as holes, and the queue is whole after a reopen."""
    path = tmp_path_factory.mktemp("zeros")
    sent = fill(path)
    for offset in range(first, min(60, first + count)):
        _rewrite_entry(path, "a", q, offset, (0, 0, 0))
    with Store.open(config(path)) as s:
        try:
            got = read_all(s, "a", q)
        except CorruptRecordError as e:
            assert e.check == "consume queue entry"
        else:
            assert got == sent[q]  # rebuilt at open: nothing missing
    with Store.open(config(path)) as s:
        assert read_all(s, "a", q) == sent[q]
        assert s.min_offset("a", q) == 0


@pytest.mark.parametrize("damage", ["truncate", "delete", "zero-extend"])
def test_a_damaged_non_last_queue_file_is_rebuilt_at_a_clean_open(tmp_path: Path, damage: str) -> None:
    """A short, missing or altered middle file of a queue: the clean open notices it
    from the sizes and rebuilds the queue from the log; nothing is cut short."""
    sent = fill(tmp_path)
    middle = queue_file(tmp_path, "a", 1, PER_FILE)
    if damage == "truncate":
        os.truncate(middle, 5 * ENTRY_SIZE + 7)
    elif damage == "delete":
        middle.unlink()
    else:
        os.truncate(middle, 5 * ENTRY_SIZE)
        os.truncate(middle, PER_FILE * ENTRY_SIZE)  # the size is right again, the entries are zeros
    with Store.open(config(tmp_path)) as s:
        try:
            got = read_all(s, "a", 1)
        except CorruptRecordError:
            got = None
        assert got is None or got == sent[1]
    with Store.open(config(tmp_path)) as s:
        assert read_all(s, "a", 1) == sent[1]
        assert [read_all(s, "a", q) for q in range(QUEUES)] == [sent[q] for q in range(QUEUES)]


def test_a_truncated_non_last_file_is_rebuilt_at_the_same_open(tmp_path: Path) -> None:
    sent = fill(tmp_path)
    os.truncate(queue_file(tmp_path, "a", 2, 2 * PER_FILE), 3 * ENTRY_SIZE)
    with Store.open(config(tmp_path)) as s:
        assert read_all(s, "a", 2) == sent[2]
        assert s.open_stats.get("queues_rebuilt", 0) >= 1


def test_open_says_what_it_rebuilt_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fill(tmp_path)
    for q in range(QUEUES):
        queue_file(tmp_path, "a", q, 0).unlink()
    caplog.set_level("INFO")
    with Store.open(config(tmp_path)):
        pass
    lines = [r.getMessage() for r in caplog.records if "queue(s) rebuilt" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"{QUEUES} queue(s) rebuilt" in lines[0] and "entries" in lines[0] and "log bytes" in lines[0]


# -------------------------------------------------------------- log damage at open
def test_log_damage_names_the_queues_and_offsets_it_affects(tmp_path: Path) -> None:
    fill(tmp_path)
    with Store.open(config(tmp_path)) as s:
        entries = {q: _entries(tmp_path, "a", q) for q in range(QUEUES)}
        lo = int(entries[1]["offset"][10])
        hi = int(entries[1]["offset"][20])
        queues = affected_queues(s.queues.root, lo, hi)
    expected = []
    for q in range(QUEUES):
        offs = entries[q]["offset"]
        hit = np.flatnonzero((offs >= lo) & (offs < hi))
        expected.append(("a", q, int(hit[0]), int(hit[-1])))
    assert sorted(queues) == expected


def test_log_damage_refuses_the_open_naming_the_lost_messages_and_frees_the_directory(tmp_path: Path) -> None:
    """A middle segment lost its tail: the open refuses with LogDamageError naming, per
    queue, the offsets whose records were there; the directory lock is released, so
    the next open (or ``clmq store repair``) can run, and it refuses the same way."""
    fill(tmp_path)
    entries = {q: _entries(tmp_path, "a", q) for q in range(QUEUES)}
    segments = sorted((tmp_path / "commitlog").glob("*.log"))
    os.truncate(segments[1], 100)
    for _ in range(2):  # a second open is not refused as "locked"
        with pytest.raises(LogDamageError) as info:
            Store.open(config(tmp_path))
    e = info.value
    expected = []
    for q in range(QUEUES):
        offs, sizes = entries[q]["offset"].astype(np.int64), entries[q]["size"].astype(np.int64)
        hit = np.flatnonzero((offs < e.end) & (offs + sizes > e.start))
        if len(hit):
            expected.append(("a", q, int(hit[0]), int(hit[-1])))
    assert expected and sorted(e.queues) == expected
    assert "a/0 offsets" in str(e)


# ------------------------------------------------------------------ the seam
def test_queue_file_operations_go_through_the_seam(tmp_path: Path) -> None:
    with Store.open(config(tmp_path)) as s:
        s.create_topic("a", 1)
        assert s.put(Message("a", 0, b"x")).ok
        s.catch_up()
        with inject(Fault("pwrite", errno.EIO, path="consumequeue/")) as faults, pytest.raises(OSError):
            s.checkpoint()
        assert faults.fired == 1
        s.checkpoint()
        assert s.put(Message("a", 0, b"y")).ok
        s.catch_up()
        with inject(
            Fault("fdatasync", errno.EIO, path="consumequeue/"), Fault("pread", errno.EIO, path="consumequeue/")
        ) as faults:
            with pytest.raises(OSError):
                s.checkpoint(sync=True)
            with pytest.raises(OSError):
                s.queues.queue("a", 0).read_entries(0, 1)
        assert faults.fired == 2


# ---------------------------------------------------------- background failures
def _sent_ok(s: Store, n: int) -> list[bytes]:
    bodies = [b"m%04d" % i for i in range(n)]
    for b in bodies:
        assert s.put(Message("a", 0, b)).ok
    return bodies


def test_an_fsync_error_on_queue_files_fails_the_store(tmp_path: Path) -> None:
    cfg = config(tmp_path, cq_flush_interval_ms=10, cq_full_flush_interval_ms=10)
    with Store.open(cfg) as s:
        s.create_topic("a", 1)
    s = Store.open(cfg)
    # The housekeeping checkpoint does not fsync queue files; a queue write does fail:
    with inject(Fault("pwrite", errno.EIO, path="consumequeue/", times=None)):
        s.start()
        bodies = _sent_ok(s, 20)
        wait_until(lambda: not s.healthy, 10, "the store to fail")
    res = s.put(Message("a", 0, b"late"))
    assert res.status is PutStatus.STORE_FAILED
    s.close()
    with Store.open(cfg) as s:
        assert [r.body for r in s.get("a", 0, 0, 100).messages] == bodies


def test_a_full_disk_for_queue_files_is_retried(tmp_path: Path) -> None:
    cfg = config(tmp_path, cq_flush_interval_ms=10, cq_full_flush_interval_ms=10)
    with Store.open(cfg) as s:
        s.create_topic("a", 1)
    with Store.open(cfg) as s:
        with inject(Fault("pwrite", errno.ENOSPC, path="consumequeue/", times=3)) as faults:
            s.start()
            bodies = _sent_ok(s, 20)
            wait_until(lambda: faults.fired == 3, 10, "three failed queue writes")
            wait_until(
                lambda: s._parts.saved is not None and s._parts.saved.queues.get(("a", 0), (0, 0))[1] == 20,
                10,
                "the queue files written once there was room",
            )
        assert s.healthy
        assert s.put(Message("a", 0, b"more")).ok
    with Store.open(cfg) as s:
        assert [r.body for r in s.get("a", 0, 0, 100).messages] == bodies + [b"more"]


def test_a_dispatcher_failure_fails_the_store(tmp_path: Path) -> None:
    """The queue's directory became a file under the running store: loading it fails
    in the dispatcher thread, which must fail the store, not retry silently forever."""
    cfg = config(tmp_path)
    with Store.open(cfg) as s:
        s.create_topic("a", 2)
        assert s.put(Message("a", 0, b"first")).ok
    s = Store.open(cfg).start()  # clean open: queue a/0 is not loaded yet
    qdir = tmp_path / "consumequeue" / "a" / "0"
    for p in qdir.iterdir():
        p.unlink()
    qdir.rmdir()
    qdir.write_bytes(b"not a directory")
    assert s.put(Message("a", 0, b"second")).ok
    wait_until(lambda: not s.healthy, 10, "the store to fail")
    assert s.put(Message("a", 1, b"third")).status is PutStatus.STORE_FAILED
    s.close()
    qdir.unlink()
    with Store.open(cfg) as s:
        assert [r.body for r in s.get("a", 0, 0, 10).messages] == [b"first", b"second"]


def test_zeroed_tail_entries_after_a_machine_crash_are_rebuilt_at_open(tmp_path: Path) -> None:
    """A machine crash can leave a queue file's size written and its last pages not
    (zeros): the unclean open finds them in the last files and rebuilds them at once."""
    cfg = config(tmp_path)
    sent = fill(tmp_path)
    s = Store.open(cfg)
    for i in range(60, 70):
        assert s.put_batch([Message("a", q, body(q, i), tags="T") for q in range(QUEUES)]).ok
        for q in range(QUEUES):
            sent[q].append(body(q, i))
    s.catch_up()
    s.checkpoint()
    s.abandon()  # as a crash: the abort marker stays
    last = queue_file(tmp_path, "a", 0, 64)
    with open(last, "r+b") as f:
        f.seek(2 * ENTRY_SIZE)
        f.write(bytes(3 * ENTRY_SIZE))
    with Store.open(cfg) as s:
        assert s.open_stats["unclean"]
        assert [read_all(s, "a", q) for q in range(QUEUES)] == [sent[q] for q in range(QUEUES)]


def test_a_checkpoint_from_the_previous_generation_means_an_unclean_open(tmp_path: Path) -> None:
    """The current checkpoint is damaged and the previous one is used: it is older than
    what the files hold, so the open validates as after a crash."""
    cfg = config(tmp_path)
    sent = fill(tmp_path)
    with Store.open(cfg) as s:  # a second checkpoint generation (the close writes another)
        assert s.put(Message("a", 0, b"late")).ok
        sent[0].append(b"late")
    with open(tmp_path / "checkpoint", "r+b") as f:
        f.seek(10)
        f.write(b"#")
    with Store.open(cfg) as s:
        assert s.open_stats["unclean"]
        assert [read_all(s, "a", q) for q in range(QUEUES)] == [sent[q] for q in range(QUEUES)]


def test_queues_rebuilt_after_retention_start_inside_a_file_and_read_whole(tmp_path: Path) -> None:
    """After retention, a rebuilt queue begins at its first record still in the log,
    inside a queue file: the entries before it were never written (not damage), and a
    later lazy load must neither refuse them nor skip anything after them."""
    cfg = small_config(
        tmp_path,
        segment_bytes=16 * 1024,
        max_message_bytes=2048,
        cq_entries_per_file=PER_FILE,
        log={"retention_bytes": 8 * 1024},
    )
    sent = fill(tmp_path)
    with Store.open(cfg) as s:
        assert s.apply_retention() > 0
        firsts = [s.min_offset("a", q) for q in range(QUEUES)]
        assert any(f % PER_FILE for f in firsts)  # some queue begins inside a file
    for p in (tmp_path / "consumequeue").rglob("0*"):
        if p.is_file():
            p.unlink()
    with Store.open(cfg) as s:  # rebuilt from what the log still holds
        assert [s.min_offset("a", q) for q in range(QUEUES)] == firsts
    with Store.open(cfg) as s:  # clean: loaded lazily from the files
        for q in range(QUEUES):
            assert s.min_offset("a", q) == firsts[q]
            assert read_all(s, "a", q, firsts[q]) == sent[q][firsts[q] :]


@pytest.mark.parametrize("field", ["queue offset", "topic", "total size", "none"])
def test_long_zero_copy_runs_are_checked_record_by_record(tmp_path: Path, field: str) -> None:
    """A pull of hundreds of log-contiguous records (the vectorised check) catches one
    bad record among them as the record-by-record check does."""
    with Store.open(config(tmp_path, cq_entries_per_file=1000)) as s:
        s.create_topic("a", 1)
        s.create_topic("bb", 1)
        assert s.put_batch([Message("a", 0, b"%04d" % i + b"." * 20) for i in range(150)]).ok
        assert s.put_batch([Message("bb", 0, b"%04d" % i + b"." * 19) for i in range(3)]).ok
    rows = _entries(tmp_path, "a", 0)
    other = _entries(tmp_path, "bb", 0)
    victim = 97
    if field == "queue offset":
        _rewrite_entry(tmp_path, "a", 0, victim, (int(rows["offset"][5]), int(rows["size"][5]), 0), 1000)
    elif field == "topic":  # the same size, another topic: b's record
        _rewrite_entry(tmp_path, "a", 0, victim, (int(other["offset"][0]), int(other["size"][0]), 0), 1000)
    elif field == "total size":
        _rewrite_entry(tmp_path, "a", 0, victim, (int(rows["offset"][victim]), int(rows["size"][victim]) + 1, 0), 1000)
    with Store.open(config(tmp_path, cq_entries_per_file=1000)) as s:
        if field == "none":
            got = raw_records(s, "a", 0, 0, 150)
            assert [(t, q, o) for t, q, o, _d in got] == [("a", 0, o) for o in range(150)]
            return
        with pytest.raises(CorruptRecordError) as info:
            raw_records(s, "a", 0, 0, 150)
        assert info.value.check == field or (field == "total size" and info.value.check == "record extent")


def _deleted_segments_open() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(".log (deleted)"):
            out.append(target)
    return out


def test_segments_removed_by_retention_are_not_kept_open_by_zero_copy_reads(tmp_path: Path) -> None:
    cfg = small_config(
        tmp_path,
        segment_bytes=16 * 1024,
        max_message_bytes=2048,
        cq_entries_per_file=PER_FILE,
        log={"retention_bytes": 8 * 1024},
    )
    fill(tmp_path)
    with Store.open(cfg) as s:
        for q in range(QUEUES):
            assert raw_records(s, "a", q, 0, 60)  # every segment read through the zero-copy check
        assert s.apply_retention() > 0
        s.apply_retention()  # descriptors dropped by one pass are closed by the next
        assert [p for p in _deleted_segments_open() if str(tmp_path) in p] == []


def test_an_entry_garbled_below_the_logs_start_is_not_taken_for_retention(tmp_path: Path) -> None:
    """After retention, entries pointing below the log's start are skipped as deleted,
    but only at a queue's head: one in the middle of live entries is damage."""
    cfg = small_config(
        tmp_path,
        segment_bytes=16 * 1024,
        max_message_bytes=2048,
        cq_entries_per_file=PER_FILE,
        log={"retention_bytes": 20 * 1024},
    )
    fill(tmp_path)
    with Store.open(cfg) as s:
        assert s.apply_retention() > 0
        lo = s.min_offset("a", 1)
    assert 0 < lo < 50
    victim = lo + 5
    _rewrite_entry(tmp_path, "a", 1, victim, (0, 150, 0))  # offset 0: long gone
    with Store.open(cfg) as s:
        with pytest.raises(CorruptRecordError) as info:
            read_all(s, "a", 1, lo)
        assert info.value.check == "consume queue entry" and info.value.offset == victim


def test_retention_over_a_damaged_queue_marks_it_and_goes_on(tmp_path: Path) -> None:
    """Retention reads the last entry of a queue's first file; if that entry is zeroed,
    the queue is marked for rebuild and retention goes on (the housekeeping thread
    must not fail the whole store for one damaged queue)."""
    cfg = small_config(
        tmp_path,
        segment_bytes=16 * 1024,
        max_message_bytes=2048,
        cq_entries_per_file=PER_FILE,
        log={"retention_bytes": 20 * 1024},
    )
    sent = fill(tmp_path)
    _rewrite_entry(tmp_path, "a", 2, PER_FILE - 1, (0, 0, 0))
    with Store.open(cfg) as s:
        assert read_all(s, "a", 2, PER_FILE)[0] == sent[2][PER_FILE]  # loaded, from the intact part
        assert s.apply_retention() > 0
        assert s.healthy
    assert (tmp_path / "rebuild-queues").exists()
    with Store.open(cfg) as s:
        lo = s.min_offset("a", 2)
        assert read_all(s, "a", 2, lo) == sent[2][lo:]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(victim=st.integers(0, 149), field=st.sampled_from(["offset", "size"]), bit=st.integers(0, 20))
def test_any_damaged_entry_of_a_long_run_is_caught_by_the_zero_copy_check(
    tmp_path: Path, victim: int, field: str, bit: int
) -> None:
    """The zero-copy path checks the two ends of each log-contiguous run; a damaged
    offset or size anywhere breaks the run, so the damaged entry is checked on its own:
    the read fails, or what it sends is exactly this queue's records in order."""
    d = tmp_path / f"{victim}-{field}-{bit}"
    with Store.open(config(d, cq_entries_per_file=1000)) as s:
        s.create_topic("a", 1)
        s.create_topic("bb", 1)
        assert s.put_batch([Message("bb", 0, b"x" * 30)]).ok
        assert s.put_batch([Message("a", 0, b"%04d" % i + b"." * 20) for i in range(150)]).ok
        assert s.put_batch([Message("bb", 0, b"y" * 30) for i in range(3)]).ok
    rows = _entries(d, "a", 0)
    offset, size = int(rows["offset"][victim]), int(rows["size"][victim])
    entry = (offset ^ (1 << bit), size, 0) if field == "offset" else (offset, size ^ (1 << bit), 0)
    _rewrite_entry(d, "a", 0, victim, entry, 1000)
    with Store.open(config(d, cq_entries_per_file=1000)) as s:
        try:
            got = raw_records(s, "a", 0, 0, 150)
        except CorruptRecordError:
            return
        assert [(t, q, o) for t, q, o, _d in got] == [("a", 0, o) for o in range(len(got))]
