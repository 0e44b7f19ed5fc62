"""The partition-per-file mode keeps the store's promises under faults (issue 14).

- Every open, clean or not, checks each partition against what was promised durable
  (its recovery point) and the chain of its segments; damaged index files are rebuilt
  (one log line); log bytes that are gone refuse the open with ``LogDamageError``.
- A read returns only the record asked for (topic, queue, offset, CRC), else
  ``CorruptRecordError``.
- An fsync error is the store's failure, never retried; one flusher at a time owns the
  durable offset.
Real files in ``tmp_path``; faults through ``clmq.commitlog.fileops`` (``tests/faults.py``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.store import PartitionStore, PutStatus, Store, StoreConfig
from clmq.broker.store._partition_store import _load_points as _load_points_and_source
from clmq.commitlog import fileops
from clmq.common import CorruptRecordError, LogDamageError, Message, StoreFailedError
from tests.faults import Fault, inject
from tests.waiting import wait_until

from .conftest import small_config


def _load_points(path: Path) -> dict[tuple[str, int], int] | None:
    return _load_points_and_source(path)[0]


QUEUES = 3
Acked = dict[tuple[int, int], bytes]  # (queue, offset) -> body
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def config(d: Path, **kw: object) -> StoreConfig:
    log_cfg = kw.pop("log", None)
    return small_config(
        d,
        mode="partition-per-file",
        segment_bytes=8 * 1024,
        max_message_bytes=2048,
        index_interval_bytes=1024,
        log=log_cfg,
        **kw,
    )  # type: ignore[arg-type]


def body(i: int) -> bytes:
    return (b"%06d:" % i) + bytes([i % 251]) * (150 + (i * 37) % 400)


def put_some(s: Store, acked: Acked, start: int, n: int) -> None:
    for i in range(start, start + n, 4):
        batch = [Message("t", j % QUEUES, body(j), tags=f"T{j % 2}") for j in range(i, min(i + 4, start + n))]
        res = s.put_batch(batch, wait_durable=False)
        assert res.ok, res
        for m, off in zip(batch, res.queue_offsets):
            acked[(m.queue_id, off)] = m.body


def write(d: Path, clean: bool, extra: int = 0) -> tuple[Acked, dict[int, int]]:
    """~60 KB over three queues (several segments each): checkpointed, then ``extra``
    more messages written and fsynced but not checkpointed; a clean close or a crash.
    Returns the messages and each queue's promised end (its recovery point)."""
    acked: Acked = {}
    s = Store.open(config(d))
    s.create_topic("t", QUEUES)
    put_some(s, acked, 0, 150)
    s.checkpoint()
    promised = {q: s.max_offset("t", q) for q in range(QUEUES)}
    put_some(s, acked, 150, extra)
    s.flush()
    if clean:
        s.close()
        promised = {q: sum(1 for qq, _ in acked if qq == q) for q in range(QUEUES)}
    else:
        s.abandon()
    return acked, promised


def read_all(s: Store, q: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    offset = s.min_offset("t", q)
    while offset < s.max_offset("t", q):
        res = s.get("t", q, offset, 50)
        for r in res.messages:
            assert (r.topic, r.queue_id, r.queue_offset) == ("t", q, offset), "a record other than the one asked for"
            out[offset] = r.body
            offset += 1
        assert res.messages, res
    return out


def assert_reads(d: Path, acked: Acked, keep: dict[int, int] | None = None) -> None:
    """Every message (or, with ``keep``, each queue's first ``keep[q]``) reads back exactly."""
    with Store.open(config(d)) as s:
        for q in range(QUEUES):
            want = {o: b for (qq, o), b in acked.items() if qq == q and (keep is None or o < keep[q])}
            assert read_all(s, q) == want, q
            assert s.max_offset("t", q) == len(want)


def segments(d: Path, q: int) -> list[Path]:
    return sorted((d / "partitions" / f"t-{q}").glob("*.log"))


# ------------------------------------------------------------------ open: log damage
@FEW
@given(data=st.data())
@pytest.mark.parametrize("clean", [True, False])
def test_a_segment_cut_below_its_recovery_point_refuses_the_open(
    tmp_path_factory: pytest.TempPathFactory, clean: bool, data: st.DataObject
) -> None:
    d = tmp_path_factory.mktemp("cut") / "s"
    acked, promised = write(d, clean, extra=0 if clean else 40)
    q = data.draw(st.integers(0, QUEUES - 1))
    segs = segments(d, q)
    victim = data.draw(st.sampled_from(segs))
    cut = data.draw(st.integers(0, victim.stat().st_size - 1))
    os.truncate(victim, cut)
    first_lost = min(o for qq, o, seg, pos, size in _layout(acked, d, q) if seg == victim and pos + size > cut)
    if first_lost < promised[q] or clean:
        with pytest.raises(LogDamageError) as e:
            Store.open(config(d))
        assert victim.name in e.value.file or e.value.file == str(victim), e.value
        assert e.value.queues and e.value.queues[0][:3] == ("t", q, first_lost), e.value
        with pytest.raises(LogDamageError):  # the lock was released: refused again, not "in use"
            Store.open(config(d))
    else:  # above the recovery point after a crash: never promised, cut as a torn tail
        keep = {qq: sum(1 for k, _ in acked if k == qq) for qq in range(QUEUES)}
        keep[q] = first_lost
        assert_reads(d, acked, keep)


_LAYOUTS: dict[Path, list[tuple[int, int, Path, int, int]]] = {}


def _layout(acked: Acked, d: Path, q: int) -> list[tuple[int, int, Path, int, int]]:
    """Where each record of queue ``q`` is, from the file names and record sizes (the
    store is not opened: the damage is already done)."""
    out = []
    segs = segments(d, q)
    offsets = sorted(o for qq, o in acked if qq == q)
    bases = [int(p.stem) for p in segs]
    sizes = {o: _record_size(acked[(q, o)]) for o in offsets}
    for i, seg in enumerate(segs):
        end = bases[i + 1] if i + 1 < len(segs) else (offsets[-1] + 1 if offsets else 0)
        pos = 0
        for o in range(bases[i], end):
            out.append((q, o, seg, pos, sizes[o]))
            pos += sizes[o]
    return out


def _record_size(b: bytes) -> int:
    return 106 + len("t") + 2 + len(b)  # header, topic, tags "T0"/"T1", body


def test_a_missing_middle_segment_refuses_the_open(tmp_path: Path) -> None:
    d = tmp_path / "s"
    write(d, clean=True)
    segs = segments(d, 1)
    assert len(segs) >= 3
    gone = segs[1]
    first, nxt = int(gone.stem), int(segs[2].stem)
    gone.unlink()
    with pytest.raises(LogDamageError) as e:
        Store.open(config(d))
    assert gone.name in e.value.file and "missing" in e.value.reason
    assert e.value.queues == [("t", 1, first, nxt - 1)] or e.value.queues[0][:3] == ("t", 1, first)


@pytest.mark.parametrize("clean", [True, False])
def test_a_missing_last_segment_or_partition_refuses_the_open(tmp_path: Path, clean: bool) -> None:
    d = tmp_path / "s"
    _, promised = write(d, clean)
    segments(d, 0)[-1].unlink()
    with pytest.raises(LogDamageError) as e:
        Store.open(config(d))
    assert e.value.queues[0][0:2] == ("t", 0) and e.value.queues[0][3] == promised[0] - 1
    shutil.rmtree(d / "partitions" / "t-2")
    with pytest.raises(LogDamageError):
        Store.open(config(d))


@pytest.mark.parametrize("clean", [True, False])
def test_zeros_after_the_last_segment_refuse_a_clean_open_and_are_cut_after_a_crash(
    tmp_path: Path, clean: bool
) -> None:
    d = tmp_path / "s"
    acked, _ = write(d, clean)
    with open(segments(d, 2)[-1], "ab") as f:
        f.write(bytes(3000))
    if clean:
        with pytest.raises(LogDamageError) as e:
            Store.open(config(d))
        assert e.value.file.endswith(segments(d, 2)[-1].name)
    else:
        assert_reads(d, acked)


def test_a_segment_of_another_queue_is_never_served(tmp_path: Path) -> None:
    """Same sizes, good CRCs, wrong queue: the read refuses, naming the field."""
    d = tmp_path / "s"
    with Store.open(config(d)) as s:
        s.create_topic("t", 2)
        for _ in range(200):
            assert s.put_batch([Message("t", 0, b"a" * 300), Message("t", 1, b"b" * 300)]).ok
    a, b = segments(d, 0)[0], segments(d, 1)[0]
    shutil.copyfile(b, a)
    with Store.open(config(d)) as s:
        with pytest.raises(CorruptRecordError) as e:
            s.get("t", 0, 0, 10)
        assert e.value.check == "queue_id" and (e.value.expected, e.value.actual) == ("0", "1")
        assert a.name in e.value.file
        assert s.get("t", 1, 0, 10).messages[0].body == b"b" * 300


@FEW
@given(data=st.data())
def test_a_flipped_byte_in_a_record_fails_that_read_never_serves_wrong_data(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    d = tmp_path_factory.mktemp("flip") / "s"
    acked, _ = write(d, clean=data.draw(st.booleans()))
    q = data.draw(st.integers(0, QUEUES - 1))
    layout = _layout(acked, d, q)
    _q, hit, seg, pos, size = data.draw(st.sampled_from(layout))
    at = pos + data.draw(st.integers(0, size - 1))
    with open(seg, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x5A]))
    try:
        s = Store.open(config(d))
    except LogDamageError as e:  # the open saw it (the newest record is checked): named
        assert e.file.endswith(seg.name), e
        return
    with s:
        with pytest.raises(CorruptRecordError) as err:
            s.get("t", q, hit, 1)
        assert seg.name in err.value.file
        for o in range(hit):  # everything before it reads back exactly
            assert s.get("t", q, o, 1).messages[0].body == acked[(q, o)]


# ------------------------------------------------------------------ open: index damage
INDEX_DAMAGES = ["truncate", "flip", "zero-extend", "delete", "replace"]


@FEW
@given(data=st.data())
def test_damaged_index_files_are_rebuilt_in_one_log_line(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path_factory.mktemp("idx") / "s"
    acked, _ = write(d, clean=data.draw(st.booleans()))
    files = sorted(p for p in (d / "partitions").rglob("*") if p.suffix in (".index", ".timeindex"))
    victim = data.draw(st.sampled_from(files))
    damage = data.draw(st.sampled_from(INDEX_DAMAGES))
    # A position as a fraction of the file: the file's size varies between runs (time
    # index entries follow the clock), and Hypothesis must replay the same draws.
    size = victim.stat().st_size
    at = min(max(0, size - 1), int(data.draw(st.floats(0, 1, exclude_max=True)) * size))
    if damage == "truncate":
        os.truncate(victim, at)
    elif damage == "flip":
        with open(victim, "r+b") as f:
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ 0x01]))
    elif damage == "zero-extend":
        with open(victim, "ab") as f:
            f.write(bytes(12))
    elif damage == "delete":
        victim.unlink()
    else:
        other = [p for p in files if p.suffix == victim.suffix and p != victim]
        shutil.copyfile(data.draw(st.sampled_from(other)), victim)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="clmq.partition"):
        assert_reads(d, acked)
    rebuilt = [r for r in caplog.records if "rebuilt" in r.getMessage()]
    assert len(rebuilt) == 1 and "rebuilt the indexes of 1 segment" in rebuilt[0].getMessage(), [
        r.getMessage() for r in caplog.records
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="clmq.partition"):
        assert_reads(d, acked)
    assert not [r for r in caplog.records if "rebuilt" in r.getMessage()]


class _CountReads(fileops.FileOps):
    def __init__(self) -> None:
        self.log_bytes = 0

    def pread(self, fd: int, n: int, pos: int) -> bytes:
        out = super().pread(fd, n, pos)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".log"):
            self.log_bytes += len(out)
        return out


def test_a_clean_open_reads_only_the_newest_records(tmp_path: Path) -> None:
    d = tmp_path / "s"
    write(d, clean=True)
    total = sum(p.stat().st_size for p in (d / "partitions").rglob("*.log"))
    counter = _CountReads()
    previous = fileops.install(counter)
    try:
        Store.open(config(d)).close()
    finally:
        fileops.install(previous)
    assert 0 < counter.log_bytes <= QUEUES * (1024 + 2048), (counter.log_bytes, total)


# ------------------------------------------------------------------ faults while running
def sync_config(d: Path, **kw: object) -> StoreConfig:
    return config(d, log={"flush_mode": "sync", "sync_flush_timeout_ms": 30_000}, **kw)


def test_an_fsync_error_in_the_flusher_fails_the_store_and_releases_sync_puts(tmp_path: Path) -> None:
    d = tmp_path / "s"
    s = Store.open(sync_config(d)).start()
    s.create_topic("t", QUEUES)
    assert s.put(Message("t", 0, b"before")).ok
    durable = s.durable_offset
    points = _load_points(d / "recovery-points")
    with inject(Fault("fdatasync", errno.EIO, path="partitions/", times=None)) as faults:
        res = s.put(Message("t", 1, b"during"))
        assert res.status is PutStatus.STORE_FAILED and "Input/output error" in res.error, res
        assert faults.fired == 1  # never retried
        assert s.durable_offset == durable and not s.healthy
        assert s.put(Message("t", 0, b"after")).status is PutStatus.STORE_FAILED
        with pytest.raises(StoreFailedError):
            s.flush()
        assert _load_points(d / "recovery-points") == points  # not advanced past the failure
    s.close()
    with Store.open(sync_config(d)).start() as s2:  # a restart recovers
        assert s2.get("t", 0, 0, 10).messages[0].body == b"before"
        assert s2.put(Message("t", 0, b"again")).ok


def test_an_fsync_error_in_housekeeping_fails_the_store(tmp_path: Path) -> None:
    d = tmp_path / "s"
    cfg = config(d, log={"flush_interval_ms": 3_600_000, "flush_dirty_bytes": 1 << 30}, cq_flush_interval_ms=20)
    s = Store.open(cfg).start()
    s.create_topic("t", QUEUES)
    with inject(Fault("fdatasync", errno.EIO, path="partitions/", times=None)) as faults:
        assert s.put(Message("t", 0, b"x")).ok
        wait_until(lambda: not s.healthy, 10, "the store to fail")
        assert s.failure is not None and "Input/output error" in str(s.failure)
        assert faults.fired == 1
    assert s.put(Message("t", 0, b"y")).status is PutStatus.STORE_FAILED
    s.close()


def test_disk_full_in_housekeeping_is_retried(tmp_path: Path) -> None:
    d = tmp_path / "s"
    cfg = config(d, cq_flush_interval_ms=20)
    s = Store.open(cfg).start()
    s.create_topic("t", QUEUES)
    with inject(
        Fault("write", errno.ENOSPC, path="recovery-points", times=3),
        Fault("pwrite", errno.ENOSPC, path="recovery-points", times=3),
    ) as faults:
        assert s.put(Message("t", 0, b"x")).ok
        wait_until(lambda: faults.fired >= 3, 10, "three failed checkpoints")
        # The put's partition at 1 in the recovery points: a checkpoint after the disk had room.
        wait_until(lambda: (_load_points(d / "recovery-points") or {}).get(("t", 0)) == 1, 10, "a checkpoint")
    assert s.healthy
    s.close()


class _BlockingSync(fileops.FileOps):
    """fdatasync of one file blocks until released; notes what it saw."""

    def __init__(self, path_part: str) -> None:
        self.path_part = path_part
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def fdatasync(self, fd: int) -> None:
        if self.path_part in os.readlink(f"/proc/self/fd/{fd}") and not self.returned.is_set():
            self.entered.set()
            self.release.wait(30)
            super().fdatasync(fd)
            self.returned.set()
            return
        super().fdatasync(fd)


@pytest.mark.parametrize("second", ["flush", "checkpoint"])
def test_one_flusher_owns_the_durable_offset(tmp_path: Path, second: str) -> None:
    """A second flush while the first one's fsync has not returned must not publish a
    durable offset that fsync covers."""
    d = tmp_path / "s"
    s = Store.open(config(d))
    assert isinstance(s, PartitionStore)
    s.create_topic("t", 2)
    first = s.put(Message("t", 0, b"zero"), wait_durable=False).end_offset
    seen: list[bool] = []
    ops = _BlockingSync("t-0/")
    previous = fileops.install(ops)
    try:
        s.on_durable(first, lambda: seen.append(ops.returned.is_set()))
        one = threading.Thread(target=s.flush)
        one.start()
        assert ops.entered.wait(10)
        s.put(Message("t", 1, b"one"), wait_durable=False)
        two = threading.Thread(target=getattr(s, second))
        two.start()
        two.join(1.0)  # with the bug it has published by now; fixed, it waits for the first
        ops.release.set()
        one.join(10)
        two.join(10)
    finally:
        fileops.install(previous)
    assert seen == [True], "durable offset published before the fsync covering it returned"
    assert s.durable_offset == s.end_offset
    s.close()


# ------------------------------------------------------------------ appends
class _Raising(fileops.FileOps):
    def __init__(self, path_part: str) -> None:
        self.path_part = path_part

    def pwrite(self, fd: int, data: fileops.Buffer, pos: int) -> int:
        if self.path_part in os.readlink(f"/proc/self/fd/{fd}"):
            raise RuntimeError("a bug below the store")
        return super().pwrite(fd, data, pos)


@contextlib.contextmanager
def _raising_on(path_part: str) -> Iterator[None]:
    previous = fileops.install(_Raising(path_part))
    try:
        yield
    finally:
        fileops.install(previous)


def test_a_batch_that_fails_midway_leaves_no_offset_behind(tmp_path: Path) -> None:
    d = tmp_path / "s"
    with Store.open(config(d)) as s:
        assert isinstance(s, PartitionStore)
        s.create_topic("t", 2)
        assert s.put_batch([Message("t", 0, b"a"), Message("t", 1, b"b")]).ok
        sizes = [segments(d, q)[-1].stat().st_size for q in range(2)]
        with inject(Fault("pwrite", errno.EIO, path="t-1/")):
            res = s.put_batch([Message("t", 0, b"c"), Message("t", 1, b"d")])
        assert res.status is PutStatus.IO_ERROR
        with _raising_on("t-1/"), pytest.raises(RuntimeError):  # not an OSError: raised, after the cut
            s.put_batch([Message("t", 0, b"e"), Message("t", 1, b"f")])
        assert [segments(d, q)[-1].stat().st_size for q in range(2)] == sizes
        assert [s.max_offset("t", q) for q in range(2)] == [1, 1]
        assert s.put_batch([Message("t", 0, b"f"), Message("t", 1, b"g")]).queue_offsets == [1, 1]


@pytest.mark.parametrize("op", ["ftruncate", "fsync"])
def test_a_rollback_that_cannot_cut_fails_the_store(tmp_path: Path, op: str) -> None:
    """The failed batch's bytes may stay in the file, owned by no offset: no more writes."""
    with Store.open(config(tmp_path / "s")) as s:
        s.create_topic("t", 2)
        with inject(Fault("pwrite", errno.EIO, path="t-1/"), Fault(op, errno.EIO, path="t-1/")) as faults:
            res = s.put_batch([Message("t", 0, b"a"), Message("t", 1, b"b")])
        assert res.status is PutStatus.IO_ERROR and faults.fired == 2
        assert not s.healthy and s.failure is not None and "rollback" in str(s.failure)
        assert s.put(Message("t", 0, b"c")).status is PutStatus.STORE_FAILED
        assert s.max_offset("t", 0) == 0


def test_an_fsync_error_while_closing_leaves_an_unclean_stop_and_a_free_directory(tmp_path: Path) -> None:
    d = tmp_path / "s"
    s = Store.open(config(d))
    s.create_topic("t", QUEUES)
    acked: Acked = {}
    put_some(s, acked, 0, 30)
    with inject(Fault("fdatasync", errno.EIO, path="partitions/")):
        s.close()
    assert not s.healthy and (d / "abort").exists()
    assert_reads(d, acked)  # reopened (the lock is free), recovered after the unclean stop


def test_recovery_points_from_the_previous_generation_mean_an_unclean_open(tmp_path: Path) -> None:
    """The current recovery points are damaged and the previous ones are used: older
    than what the files hold, so the open validates as after a crash."""
    cfg = small_config(tmp_path / "s", mode="partition-per-file")
    with Store.open(cfg) as s:
        s.create_topic("t", 1)
        assert s.put(Message("t", 0, b"first")).ok
    with Store.open(cfg) as s:  # the close writes a second generation
        assert s.put(Message("t", 0, b"second")).ok
    with open(tmp_path / "s" / "recovery-points", "r+b") as f:
        f.seek(12)
        f.write(b"#")
    with Store.open(cfg) as s:
        assert s.open_stats["unclean"]
        s.catch_up()
        assert [r.body for r in s.get("t", 0, 0, 10).messages] == [b"first", b"second"]
