"""The CommitLog's integrity under faults, on real files: every file operation goes
through the seam, one flusher owns the durable offset, an fsync error is final, every
open verifies what was promised, boundary indexes carry checksums, and reads never
invent or drop data."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.commitlog import AppendStatus, CommitLog, CommitLogConfig, FlushMode, fileops, read_boundary_index
from clmq.commitlog._flush import _sync as sync_segment
from clmq.commitlog._segment import Segment
from clmq.common import CorruptRecordError, LogDamageError, StoreFailedError
from tests.faults import SHORT, Fault, inject

from .conftest import msgs

CFG = CommitLogConfig(segment_bytes=32 * 1024, max_message_bytes=4096, boundary_interval_bytes=4096)
SYNC = CommitLogConfig(
    segment_bytes=32 * 1024, max_message_bytes=4096, boundary_interval_bytes=4096, flush_mode=FlushMode.SYNC
)


def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "commitlog"  # fault paths match "commitlog"


def seg_path(directory: Path, base: int) -> Path:
    return directory / f"{base:020d}.log"


def filled(directory: Path, segments: int = 4, cfg: CommitLogConfig = CFG) -> tuple[int, list[tuple[int, int, Path]]]:
    """A cleanly closed log of more than ``segments`` segments; its end and segments."""
    lg = CommitLog.open(directory, cfg, clean=False, checkpoint_offset=None)
    i = 0
    while len(lg.segments()) <= segments:
        assert lg.append(msgs("t", 10, 3, size=300 + 37 * (i % 5), start=i * 10)).ok
        i += 1
    assert lg.append(msgs("t", 10, 3, size=300, start=i * 10)).ok  # the newest segment holds records
    end, segs = lg.write_offset, lg.segments()
    lg.close()
    return end, segs


def open_clean(directory: Path, end: int | None, cfg: CommitLogConfig = CFG) -> CommitLog:
    return CommitLog.open(directory, cfg, clean=True, checkpoint_offset=end, expected_end=end)


def open_unclean(directory: Path, checkpoint: int | None, cfg: CommitLogConfig = CFG) -> CommitLog:
    return CommitLog.open(directory, cfg, clean=False, checkpoint_offset=checkpoint)


def set_size(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x5A]))


# ------------------------------------------------------------------ the seam
@pytest.mark.parametrize("op", ["pwrite", "ftruncate"])
def test_appends_write_through_the_seam(tmp_path: Path, op: str) -> None:
    """A write fault is an append's IO_ERROR with nothing written; a failed rollback
    (ftruncate) leaves a file whose length no longer says where the log ends: the log
    takes no more writes."""
    lg = CommitLog.open(log_dir(tmp_path), CFG, clean=False, checkpoint_offset=None)
    assert lg.append(msgs("t", 5, 1)).ok
    end = lg.write_offset
    faults = [Fault("pwrite", errno.EIO, path="commitlog/")]
    if op == "ftruncate":  # rollback after the write fault fails as well
        faults.append(Fault("ftruncate", errno.EIO, path="commitlog/"))
    with inject(*faults) as ops:
        res = lg.append(msgs("t", 5, 1))
    assert ops.fired == len(faults)
    assert res.status is AppendStatus.IO_ERROR and lg.write_offset == end
    if op == "ftruncate":
        assert isinstance(lg.durability.failure, StoreFailedError)
        assert lg.append(msgs("t", 1, 1)).status is AppendStatus.STORE_FAILED
    else:
        assert lg.append(msgs("t", 1, 1)).ok
    lg.abandon()


def test_short_writes_are_finished_and_the_records_read_back(tmp_path: Path) -> None:
    lg = CommitLog.open(log_dir(tmp_path), CFG, clean=False, checkpoint_offset=None)
    with inject(Fault("pwrite", SHORT, path="commitlog/", times=None)) as ops:
        res = lg.append(msgs("t", 20, 2, size=500))
    assert ops.fired > 0 and res.ok
    assert [r.body for r in lg.iter_records()] == [m.body for m in msgs("t", 20, 2, size=500)]
    lg.close()


@pytest.mark.parametrize("op", ["fsync", "ftruncate"])
def test_truncation_and_its_fsync_go_through_the_seam(tmp_path: Path, op: str) -> None:
    lg = CommitLog.open(log_dir(tmp_path), CFG, clean=False, checkpoint_offset=None)
    res = lg.append(msgs("t", 20, 1, size=300))
    with inject(Fault(op, errno.EIO, path="commitlog/")) as ops, pytest.raises(OSError):
        lg.truncate(res.commitlog_offsets[10])
    assert ops.fired == 1
    # the cut may or may not be on disk: the log takes no more writes
    assert isinstance(lg.durability.failure, StoreFailedError)
    assert lg.append(msgs("t", 1, 1)).status is AppendStatus.STORE_FAILED
    lg.abandon()


def test_boundary_index_write_fault_never_fails_an_append(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = log_dir(tmp_path)
    lg = CommitLog.open(directory, CFG, clean=False, checkpoint_offset=None)
    with inject(Fault("pwrite", errno.ENOSPC, path=".bidx")) as ops:
        res = lg.append(msgs("t", 40, 1, size=300))
    assert ops.fired == 1 and res.ok
    expected = lg.boundaries(0)
    assert expected and "boundary index" in caplog.text
    end = lg.write_offset
    lg.close()
    lg = open_clean(directory, end)  # rebuilt by a scan
    assert lg.boundaries(0) == expected
    lg.close()


# ------------------------------------------------------------ one flusher
class BlockingSync(fileops.FileOps):
    """fdatasync of one file waits for ``release``; every sync and its return are logged."""

    def __init__(self, victim: Path) -> None:
        self.victim = str(victim)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.events: list[str] = []

    def fdatasync(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path == self.victim and not self.release.is_set():
            self.entered.set()
            assert self.release.wait(30)
        os.fdatasync(fd)
        self.events.append(f"synced {Path(path).name}")


def test_overlapping_flushes_publish_only_what_every_fsync_covers(tmp_path: Path) -> None:
    """Flush A swaps out {s0, s1} and is still fsyncing s0 when flush B swaps out {s1},
    fsyncs it and would publish past bytes of s0 that are not durable yet."""
    directory = log_dir(tmp_path)
    lg = CommitLog.open(directory, CFG, clean=False, checkpoint_offset=None)
    while len(lg.segments()) < 2:
        assert lg.append(msgs("t", 10, 1, size=500)).ok
    first_end = lg.write_offset
    ops = BlockingSync(seg_path(directory, 0))
    lg.on_durable(1, lambda: ops.events.append(f"durable {lg.durable_offset}"))
    previous = fileops.install(ops)
    try:
        a = threading.Thread(target=lg.flush)
        a.start()
        assert ops.entered.wait(10)
        assert lg.append(msgs("t", 10, 1, size=500)).ok  # lands in s1 only
        b = threading.Thread(target=lg.flush)
        b.start()
        b.join(1.0)  # unfixed, B finishes at once; fixed, it waits for A: give it the chance
        assert lg.durable_offset == 0, ops.events
        ops.release.set()
        a.join()
        b.join()
    finally:
        fileops.install(previous)
    first_durable = next(i for i, e in enumerate(ops.events) if e.startswith("durable"))
    assert ops.events.index(f"synced {seg_path(directory, 0).name}") < first_durable, ops.events
    assert int(ops.events[first_durable].split()[1]) >= first_end
    assert lg.durable_offset == lg.write_offset
    lg.close()


class FlushWhileClosing(fileops.FileOps):
    """Runs a segment's flush step in the instant between its descriptor closing and
    the close returning: where a flush thread may run while retention closes a
    segment that flush had already taken from the dirty set."""

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.outcomes: list[str] = []

    def close(self, fd: int) -> None:
        os.close(fd)
        try:
            sync_segment(self.seg)
            self.outcomes.append("skipped")
        except OSError as e:
            self.outcomes.append(f"failed: {e!r}")


def test_a_flush_meeting_a_segment_as_retention_closes_it_is_no_failure(tmp_path: Path) -> None:
    """CI met it once: the flush loop fdatasynced a segment retention had just closed,
    read the descriptor before it was marked closed, and failed the store for good."""
    seg = Segment(tmp_path, 0, 4096, create=True)
    seg.write(0, b"x" * 100)
    ops = FlushWhileClosing(seg)
    previous = fileops.install(ops)
    try:
        seg.close()
    finally:
        fileops.install(previous)
    assert ops.outcomes == ["skipped"]
    assert seg.fd == -1
    seg.close()  # a second close is a no-op
    assert ops.outcomes == ["skipped"]


# --------------------------------------------------------- fsync errors are final
def run_flusher(lg: CommitLog, stop: threading.Event, errors: list[BaseException]) -> threading.Thread:
    def loop() -> None:
        try:
            lg.run_flusher(stop)
        except BaseException as e:  # what the store's guarded thread does
            errors.append(e)

    t = threading.Thread(target=loop)
    t.start()
    return t


@pytest.mark.parametrize(("op", "err"), [("fdatasync", errno.EIO), ("fdatasync", errno.ENOSPC), ("fsync", errno.EIO)])
def test_an_fsync_error_fails_the_log_for_good(tmp_path: Path, op: str, err: int) -> None:
    """Sync mode: the waiting writer is released at once with the failure, later appends
    are refused, the durable offset never moves again, a reopen recovers every record
    that was durable. (``fsync`` is the directory's, after a roll.)"""
    directory = log_dir(tmp_path)
    lg = CommitLog.open(directory, SYNC, clean=False, checkpoint_offset=None)
    assert lg.append(msgs("t", 10, 2, size=400)).ok
    durable = lg.flush()
    stop, errors = threading.Event(), []
    flusher = run_flusher(lg, stop, errors)
    called: list[bool] = []
    with inject(Fault(op, err, path="commitlog", times=None)) as ops:
        batch = msgs("t", 100, 2, size=400, start=10)  # rolls: the directory needs its fsync
        res = lg.append(batch)
        assert res.ok
        lg.on_durable(res.end_offset, lambda: called.append(lg.durability.failure is not None))
        started = time.monotonic()
        assert not lg.wait_durable(res.end_offset, 10)
        assert time.monotonic() - started < 5
        flusher.join(10)
        assert not flusher.is_alive() and ops.fired >= 1
    assert called == [True]
    assert len(errors) == 1 and isinstance(errors[0], StoreFailedError)
    assert isinstance(lg.durability.failure, StoreFailedError)
    end = lg.write_offset
    refused = lg.append(msgs("t", 1, 1))
    assert refused.status is AppendStatus.STORE_FAILED and lg.write_offset == end
    with pytest.raises(StoreFailedError):
        lg.flush()  # never retried: the page cache is not trusted any more
    assert lg.durable_offset == durable
    stop.set()
    lg.abandon()
    lg = open_unclean(directory, durable, SYNC)
    assert lg.write_offset >= durable
    bodies = [r.body for r in lg.iter_records()]
    assert bodies[:10] == [m.body for m in msgs("t", 10, 2, size=400)]
    lg.close()


def test_a_failed_log_still_closes_its_files(tmp_path: Path) -> None:
    lg = CommitLog.open(log_dir(tmp_path), CFG, clean=False, checkpoint_offset=None)
    assert lg.append(msgs("t", 3, 1)).ok
    with inject(Fault("fdatasync", errno.EIO, path="commitlog")), pytest.raises(StoreFailedError):
        lg.flush()
    with pytest.raises(StoreFailedError):
        lg.close()
    assert all(seg.fd == -1 for seg in lg._state.snapshot.segments)


# ----------------------------------------------------- verification at open
def test_a_clean_open_finds_a_shortened_newest_segment(tmp_path: Path) -> None:
    directory = log_dir(tmp_path)
    end, segs = filled(directory)
    _base, size, path = segs[-1]
    set_size(path, size - 100)
    with pytest.raises(LogDamageError) as info:
        open_clean(directory, end)
    assert (info.value.file, info.value.start, info.value.end) == (str(path), end - 100, end)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_clean_open_refuses_any_damage_to_the_newest_segment(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Shortened, extended, or a flipped byte in the last record: never a clean open."""
    directory = tmp_path_factory.mktemp("log") / "commitlog"
    end, segs = filled(directory, 2)
    base, size, path = segs[-1]
    lg = open_clean(directory, end)
    last = list(lg.iter_records(base))[-1]
    lg.close()
    damage = data.draw(st.sampled_from(["shorten", "extend", "flip"]))
    if damage == "shorten":
        set_size(path, data.draw(st.integers(0, size - 1)))
    elif damage == "extend":
        set_size(path, size + data.draw(st.integers(1, 5000)))
    else:
        flip(path, data.draw(st.integers(last.commitlog_offset - base, size - 1)))
    with pytest.raises(LogDamageError) as info:
        open_clean(directory, end)
    assert info.value.file == str(path) and info.value.start < info.value.end


@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("damage", ["shorten", "extend", "delete"])
def test_a_damaged_middle_segment_is_never_cut_silently(tmp_path: Path, clean: bool, damage: str) -> None:
    directory = log_dir(tmp_path)
    end, segs = filled(directory, 4)
    base, size, path = segs[1]
    next_base = segs[2][0]
    if damage == "shorten":
        set_size(path, size - 5000)
        expected = (str(path), next_base - 5000, next_base)
    elif damage == "extend":
        set_size(path, size + 5000)
        expected = (str(path), next_base, next_base + 5000)
    else:
        path.unlink()
        expected = (str(path), base, next_base)
    with pytest.raises(LogDamageError) as info:
        if clean:
            open_clean(directory, end)
        else:
            open_unclean(directory, segs[-1][0])
    assert (info.value.file, info.value.start, info.value.end) == expected
    assert sorted(p.name for p in directory.glob("*.log")) == sorted(p.name for _, _, p in segs if p.exists())


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_middle_segment_cut_anywhere_is_refused(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    directory = tmp_path_factory.mktemp("log") / "commitlog"
    end, segs = filled(directory, 3)
    i = data.draw(st.integers(0, len(segs) - 2))
    base, size, path = segs[i]
    cut = data.draw(st.integers(0, size - 1))
    set_size(path, cut)
    clean = data.draw(st.booleans())
    with pytest.raises(LogDamageError) as info:
        if clean:
            open_clean(directory, end)
        else:
            open_unclean(directory, data.draw(st.sampled_from([None, base, end])))
    assert (info.value.file, info.value.start, info.value.end) == (str(path), base + cut, segs[i + 1][0])


@pytest.mark.parametrize("clean", [True, False])
def test_a_missing_newest_segment_is_refused(tmp_path: Path, clean: bool) -> None:
    directory = log_dir(tmp_path)
    end, segs = filled(directory, 3)
    segs[-1][2].unlink()
    with pytest.raises(LogDamageError) as info:
        if clean:
            open_clean(directory, end)
        else:
            open_unclean(directory, end)
    assert (info.value.file, info.value.start, info.value.end) == (str(segs[-1][2]), segs[-1][0], end)


def test_an_unclean_open_cuts_a_torn_tail_after_the_checkpoint(tmp_path: Path) -> None:
    directory = log_dir(tmp_path)
    lg = CommitLog.open(directory, CFG, clean=False, checkpoint_offset=None)
    assert lg.append(msgs("t", 20, 1, size=300)).ok
    durable = lg.flush()
    res = lg.append(msgs("t", 5, 1, size=300, start=20))
    lg.abandon()
    path = seg_path(directory, 0)
    set_size(path, res.commitlog_offsets[3] + 100)  # the 4th record of the second batch torn
    lg = open_unclean(directory, durable)
    assert lg.write_offset == res.commitlog_offsets[3]
    assert len(list(lg.iter_records())) == 23
    lg.close()


@pytest.mark.parametrize("damage", ["flip", "shorten"])
def test_an_unclean_open_refuses_damage_below_the_checkpoint(tmp_path: Path, damage: str) -> None:
    directory = log_dir(tmp_path)
    lg = CommitLog.open(directory, CFG, clean=False, checkpoint_offset=None)
    res = lg.append(msgs("t", 20, 1, size=300))
    durable = lg.flush()
    lg.abandon()
    path = seg_path(directory, 0)
    victim = res.commitlog_offsets[12]
    if damage == "flip":
        flip(path, victim + 100)
    else:
        set_size(path, victim + 100)
    size = path.stat().st_size
    with pytest.raises(LogDamageError) as info:
        open_unclean(directory, durable)
    assert (info.value.file, info.value.start) == (str(path), victim)
    assert info.value.end >= durable if damage == "flip" else info.value.end == durable
    assert path.stat().st_size == size  # nothing cut


# ------------------------------------------------------------ boundary indexes
def corrupt_bidx(path: Path, damage: str, other: Path) -> None:
    raw = path.read_bytes()
    if damage == "flip":
        flip(path, len(raw) - 3)
    elif damage == "truncate":
        set_size(path, len(raw) - 3)
    elif damage == "delete":
        path.unlink()
    elif damage == "foreign":
        shutil.copy(other, path)
    elif damage == "old-format":  # sorted u32 positions, as written before checksums
        path.write_bytes(struct.pack("<3I", 8, 4200, 9000))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "foreign", "old-format"])
def test_a_damaged_boundary_index_is_rebuilt_and_said_once(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    directory = log_dir(tmp_path)
    end, segs = filled(directory, 4)
    lg = open_clean(directory, end)
    expected = {b: lg.boundaries(b) for b, _, _ in segs}
    lg.close()
    victims = [segs[1][2].with_suffix(".bidx"), segs[-1][2].with_suffix(".bidx")]
    for v in victims:
        corrupt_bidx(v, damage, segs[0][2].with_suffix(".bidx"))
    caplog.set_level(logging.INFO, "clmq.commitlog")
    lg = open_clean(directory, end)
    assert {b: lg.boundaries(b) for b, _, _ in segs} == expected
    lines = [r.getMessage() for r in caplog.records if "boundary ind" in r.getMessage()]
    assert len(lines) == 1 and "2 " in lines[0], lines
    lg.close()
    caplog.clear()
    open_clean(directory, end).close()  # rebuilt files pass their checks: nothing to say
    assert not [r for r in caplog.records if "boundary ind" in r.getMessage()]


def test_an_old_format_boundary_index_is_converted_when_its_positions_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = log_dir(tmp_path)
    end, segs = filled(directory, 3)
    lg = open_clean(directory, end)
    expected = {b: lg.boundaries(b) for b, _, _ in segs}
    lg.close()
    for base, _, path in segs:  # what the old code wrote: the same positions, plain u32s
        path.with_suffix(".bidx").write_bytes(
            struct.pack(f"<{len(expected[base])}I", *(p - base for p in expected[base]))
        )
    caplog.set_level(logging.INFO, "clmq.commitlog")
    lg = open_clean(directory, end)
    assert {b: lg.boundaries(b) for b, _, _ in segs} == expected
    lines = [r.getMessage() for r in caplog.records if "boundary ind" in r.getMessage()]
    assert len(lines) == 1 and f"old format, converted: {len(segs)}" in lines[0], lines
    lg.close()
    caplog.clear()
    open_clean(directory, end).close()  # converted for good
    assert not [r for r in caplog.records if "boundary ind" in r.getMessage()]


def test_outside_readers_get_the_checked_positions_of_a_boundary_index(tmp_path: Path) -> None:
    """read_boundary_index (for a Spark planner): checked entries, up to a torn one."""
    directory = log_dir(tmp_path)
    end, segs = filled(directory, 2)
    lg = open_clean(directory, end)
    base, _, path = segs[1]
    expected = [p - base for p in lg.boundaries(base)]
    lg.close()
    index = path.with_suffix(".bidx")
    assert expected and read_boundary_index(index, base) == expected
    with open(index, "ab") as f:
        f.write(b"\x01\x02\x03")  # an entry being appended
    assert read_boundary_index(index, base) == expected
    assert read_boundary_index(index, segs[0][0]) == []  # another segment's
    assert read_boundary_index(tmp_path / "nothing.bidx", base) == []


# ------------------------------------------------------------------- reads
def test_reads_outside_the_log_are_none_inside_it_an_error(tmp_path: Path) -> None:
    directory = log_dir(tmp_path)
    cfg = CommitLogConfig(segment_bytes=32 * 1024, max_message_bytes=4096, retention_bytes=64 * 1024, retention_ms=None)
    lg = CommitLog.open(directory, cfg, clean=False, checkpoint_offset=None)
    for i in range(10):
        assert lg.append(msgs("t", 20, 1, size=900, start=i * 20)).ok
    assert lg.delete_expired() > 0
    assert lg.read_bytes(0, 10) is None  # deleted by retention
    assert lg.read_bytes(lg.write_offset - 5, 10) is None  # past the end
    at = lg.min_offset + 100
    with inject(Fault("pread", errno.EIO, path="commitlog")), pytest.raises(CorruptRecordError) as info:
        lg.read_bytes(at, 50)
    assert (info.value.offset, info.value.check, info.value.expected) == (at, "read", "50 bytes")
    with inject(Fault("pread", SHORT, path="commitlog")), pytest.raises(CorruptRecordError) as info:
        lg.read_bytes(at, 50)
    assert info.value.actual == "25 bytes"
    lg.close()


def test_a_segment_shortened_under_an_open_log_is_an_error_not_a_gap(tmp_path: Path) -> None:
    directory = log_dir(tmp_path)
    lg = CommitLog.open(directory, CFG, clean=False, checkpoint_offset=None)
    res = lg.append(msgs("t", 10, 1, size=300))
    set_size(seg_path(directory, 0), res.commitlog_offsets[5])
    victim = res.commitlog_offsets[7]
    with pytest.raises(CorruptRecordError) as info:
        lg.read_bytes(victim, 300)
    assert info.value.file == str(seg_path(directory, 0)) and info.value.offset == victim
    lg.close()


def test_map_chunk_of_a_closed_segment_never_maps_zeros(tmp_path: Path) -> None:
    """A reader that stalled for a whole retention pass finds the descriptor closed."""
    directory = log_dir(tmp_path)
    lg = CommitLog.open(directory, CFG, clean=False, checkpoint_offset=None)
    assert lg.append(msgs("t", 10, 1, size=300)).ok
    first = lg._state.snapshot.segments[0]
    first.close()  # what the graveyard does a retention pass after deleting it
    _at, view = lg.map_chunk(0, 4096)
    assert len(view) == 0 or bytes(view) != bytes(len(view))
    lg.abandon()
