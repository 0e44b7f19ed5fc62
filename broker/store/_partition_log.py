"""One partition's log in the partition-per-file mode (Kafka's layout), for comparison.

Invariants:
- A partition is a directory ``<topic>-<queue id>`` of segments named by the queue offset
  of their first record: ``<20 digits>.log``, with a sparse offset index ``.index``
  (u32 offset relative to the base, u32 file position; one entry per
  ``index_interval_bytes`` appended) and a time index ``.timeindex`` (u64 store
  timestamp, u32 relative offset; written with index entries when the time grew).
- Records use the CommitLog's format; their ``commitlog_offset`` field holds the
  record's position in its segment file. A batch never spans segments: the segment is
  rolled first when the batch does not fit (no blank markers).
- Segments form a chain: a segment's base is its predecessor's base plus its record
  count. Both index files end with a footer naming the segment (base), the bytes and
  records they cover, and a CRC32C of the whole file, so that an index file is trusted
  only for exactly the segment, and the length, it was written for.
- Indexes are derived: rebuilt by a scan of the segment whenever they do not check.
- Every read of a record checks that it is the one asked for (topic, queue id, queue
  offset, position, CRC): :class:`~commitlog.CorruptRecordError` otherwise.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import crc32c as _crc32c
import numpy as np

from clmq.commitlog import fileops, fsync_dir
from clmq.common import (
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    CorruptRecordError,
    LogDamageError,
    Record,
    Walk,
    check_record,
    decode_record,
    gather_fields,
    walk_records,
)
from clmq.consumequeue import FileCache

log = logging.getLogger("clmq.partition")

_INDEX = struct.Struct("<II")
_TIME = struct.Struct("<QI")
# Footer of both index files: segment base, bytes and records covered, magic, then the
# CRC32C of everything before it (entries and the footer's first 28 bytes).
_FOOTER = struct.Struct("<QQQ4sI")
INDEX_MAGIC, TIME_MAGIC = b"PIX2", b"PTX2"
INDEX_SUFFIXES = (".index", ".timeindex")
_IDENTITY = struct.Struct("<QQI")  # commitlog_offset (= file position), queue_offset, queue_id
assert (
    OFF_QUEUE_OFFSET == OFF_COMMITLOG_OFFSET + 8 and OFF_QUEUE_ID == OFF_QUEUE_OFFSET + 8
)  # one unpack reads all three


def _name(base: int, suffix: str) -> str:
    return f"{base:020d}{suffix}"


@dataclass
class PartSegment:
    """A segment file's bookkeeping (the descriptor lives in the store's LRU)."""

    base: int  # queue offset of the first record
    path: Path
    size: int  # bytes written == file length
    count: int  # records
    index: array[int] = field(default_factory=lambda: array("I"))  # rel offset, position pairs, flat
    times: list[tuple[int, int]] = field(default_factory=list)  # (timestamp, rel offset)
    since_index: int = 0  # bytes appended since the last index entry

    @property
    def next_offset(self) -> int:
        return self.base + self.count


# ------------------------------------------------------------------ index files
def seal_index(entries: bytes, magic: bytes, seg: PartSegment) -> bytes:
    """An index file's bytes: ``entries`` and the footer binding them to ``seg`` as it is."""
    head = entries + _FOOTER.pack(seg.base, seg.size, seg.count, magic, 0)[:-4]
    return head + struct.pack("<I", _crc32c.crc32c(head))


def open_index(raw: bytes | None, magic: bytes, entry_bytes: int) -> tuple[bytes, int, int, int] | str:
    """``(entries, base, bytes covered, records covered)`` of an index file's content,
    or why it does not check."""
    if raw is None:
        return "missing"
    if len(raw) < _FOOTER.size or (len(raw) - _FOOTER.size) % entry_bytes:
        return f"{len(raw)} bytes is not entries and a footer"
    base, covered, count, got_magic, crc = _FOOTER.unpack_from(raw, len(raw) - _FOOTER.size)
    if got_magic != magic:
        return f"footer magic {got_magic!r}, expected {magic!r}"
    if _crc32c.crc32c(memoryview(raw)[:-4]) != crc:
        return "checksum does not match"
    return raw[: -_FOOTER.size], base, covered, count


def read_whole(path: Path) -> bytes | None:
    """A small file's content through the file-operation seam; None if it is missing
    or unreadable (an index: rebuilt from its segment)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        return fileops.OPS.pread(fd, size, 0) if size else b""
    except OSError as e:
        log.warning("partition: cannot read %s (%s)", path, e)
        return None
    finally:
        os.close(fd)


def write_whole(path: Path, data: bytes) -> None:
    """Replace a small file's content in place, not fsynced (an index: a torn or lost
    one fails its checksum and is rebuilt)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fileops.write_all(fd, data, 0)
        fileops.OPS.ftruncate(fd, len(data))
    finally:
        os.close(fd)


# --------------------------------------------------------------- record identity
Identity = tuple[str | bytes, int, int, int]  # topic, queue id, queue offset, position


def expect_identity(path: Path, position: int, expected: Identity, actual: Identity) -> None:
    """Raise :class:`CorruptRecordError` naming the first field of ``(topic, queue_id,
    queue_offset, position)`` that is not what the reader asked for."""
    if expected != actual:
        for name, want, got in zip(("topic", "queue_id", "queue_offset", "commitlog_offset"), expected, actual):
            if want != got:
                raise CorruptRecordError(str(path), position, name, str(want), str(got))


def header_identity(data: bytes, start: int, topic_len: int) -> tuple[bytes, int, int, int]:
    """``(topic bytes, queue id, queue offset, position field)`` from a record's header,
    without decoding it (the topic read with the expected length)."""
    position, offset, qid = _IDENTITY.unpack_from(data, start + OFF_COMMITLOG_OFFSET)
    return data[start + HEADER_SIZE : start + HEADER_SIZE + topic_len], qid, offset, position


def _first_stranger(data: bytes, walk: Walk, base: int, topic: bytes, queue_id: int) -> int:
    """Index of the first record of ``walk`` that is not (topic, queue id, ``base`` +
    its index) at its own position; the record count if all are (one vectorised pass)."""
    n = walk.count
    if not n:
        return 0
    buf = np.frombuffer(data, dtype=np.uint8)
    starts = walk.starts
    h = gather_fields(buf, walk, ["commitlog_offset", "queue_offset", "queue_id", "topic_len"])
    ok = (h["queue_offset"] == np.arange(base, base + n)) & (h["commitlog_offset"] == starts)
    ok &= (h["queue_id"] == queue_id) & (h["topic_len"] == len(topic))
    if topic:  # the topic's bytes, read at the expected length (clipped to the buffer)
        where = np.minimum(starts[:, None] + HEADER_SIZE + np.arange(len(topic)), len(buf) - 1)
        ok &= (buf[where] == np.frombuffer(topic, dtype=np.uint8)).all(axis=1)
    return n if ok.all() else int(np.argmin(ok))


class PartitionLog:
    """Segments of one (topic, queue); appends and reads go through ``files`` (an LRU)."""

    def __init__(
        self,
        directory: Path,
        topic: str,
        queue_id: int,
        segment_bytes: int,
        index_interval: int,
        max_message_bytes: int,
    ) -> None:
        self.directory = directory
        self.max_message_bytes = max_message_bytes
        self.topic = topic
        self.queue_id = queue_id
        self.segment_bytes = segment_bytes
        self.index_interval = index_interval
        self.segments: list[PartSegment] = []
        self.claimed_size = -1  # see load_indexes

    # ---------------------------------------------------------------- loading
    def list_segments(self) -> list[PartSegment]:
        """The segment files on disk, in offset order, with their lengths."""
        self.directory.mkdir(parents=True, exist_ok=True)
        bases = sorted(int(n[:20]) for n in os.listdir(self.directory) if n.endswith(".log") and n[:20].isdigit())
        segs = [PartSegment(b, self.directory / _name(b, ".log"), 0, 0) for b in bases]
        for seg in segs:
            seg.size = os.path.getsize(seg.path)
        return segs

    def index_records(self, seg: PartSegment, data: bytes, starts: list[int]) -> None:
        """Rebuild ``seg``'s in-memory indexes from its records at ``starts``."""
        seg.count, seg.index, seg.times, seg.since_index = 0, array("I"), [], 0
        for i, start in enumerate(starts):
            size = int.from_bytes(data[start : start + 4], "little")
            ts = int.from_bytes(data[start + 44 : start + 52], "little")
            self._note(seg, seg.base + i, start, size, ts)
        seg.count = len(starts)

    def _note(self, seg: PartSegment, offset: int, position: int, size: int, ts: int) -> None:
        """Index bookkeeping for one appended record (Kafka: an entry per interval bytes)."""
        if seg.since_index >= self.index_interval or not seg.index:
            seg.index.extend((offset - seg.base, position))
            if not seg.times or ts > seg.times[-1][0]:
                seg.times.append((ts, offset - seg.base))
            seg.since_index = 0
        seg.since_index += size

    def write_indexes(self, seg: PartSegment) -> None:
        """Persist a segment's indexes; derived data, so on failure (disk full) the files
        are removed and the next open rebuilds them by a scan. Not fsynced by default:
        one lost or torn by a crash fails its checksum and is rebuilt (an fsync per file
        would make closing 10,000 partitions take minutes)."""
        idx, times = seg.path.with_suffix(".index"), seg.path.with_suffix(".timeindex")
        try:
            write_whole(idx, seal_index(seg.index.tobytes(), INDEX_MAGIC, seg))
            write_whole(times, seal_index(b"".join(_TIME.pack(t, r) for t, r in seg.times), TIME_MAGIC, seg))
        except OSError as e:
            log.warning(
                "partition %s: indexes of %s not written (%s); rebuilt at next open", self.directory, seg.path, e
            )
            idx.unlink(missing_ok=True)
            times.unlink(missing_ok=True)

    def load_indexes(self, seg: PartSegment, count: int | None) -> str | None:
        """Take ``seg``'s indexes from its files if they check and cover exactly the
        segment as it is (``count`` records, when known); else say why not. Sets
        :attr:`claimed_size`: the segment's length by its index, if that one checks."""
        entries: list[bytes] = []
        n = 0
        self.claimed_size = -1
        for suffix, magic, size in ((".index", INDEX_MAGIC, _INDEX.size), (".timeindex", TIME_MAGIC, _TIME.size)):
            path = seg.path.with_suffix(suffix)
            opened = open_index(read_whole(path), magic, size)
            if isinstance(opened, str):
                return f"{path.name}: {opened}"
            raw, base, covered, n = opened
            if suffix == ".index" and base == seg.base:
                self.claimed_size = covered
            if (base, covered) != (seg.base, seg.size) or (count is not None and n != count):
                return (
                    f"{path.name}: written for base {base}, {covered} bytes, {n} records;"
                    f" the segment has base {seg.base}, {seg.size} bytes"
                )
            entries.append(raw)
        seg.index = array("I", entries[0])
        seg.times = [_TIME.unpack_from(entries[1], p) for p in range(0, len(entries[1]), _TIME.size)]
        seg.count = n
        seg.since_index = seg.size - seg.index[-1] if seg.index else 0
        return None

    def new_segment(self, base: int) -> PartSegment:
        seg = PartSegment(base, self.directory / _name(base, ".log"), 0, 0)
        seg.path.touch()
        self.segments.append(seg)
        return seg

    def drop_segments(self, files: FileCache, doomed: list[PartSegment]) -> None:
        """Delete segment files and their indexes (retention, a cut torn tail)."""
        for seg in doomed:
            files.forget(seg.path)
            for suffix in (".log", *INDEX_SUFFIXES):
                seg.path.with_suffix(suffix).unlink(missing_ok=True)

    # -------------------------------------------------------------- appending
    @property
    def next_offset(self) -> int:
        return self.segments[-1].next_offset

    @property
    def min_offset(self) -> int:
        return self.segments[0].base

    def active_for(self, batch_bytes: int) -> tuple[PartSegment, bool]:
        """The segment the next batch goes to, rolling when it would not fit."""
        seg = self.segments[-1]
        if seg.size and seg.size + batch_bytes > self.segment_bytes:
            self.write_indexes(seg)
            return self.new_segment(seg.next_offset), True
        return seg, False

    def appended(self, seg: PartSegment, starts: list[int], sizes: list[int], ts: int) -> None:
        for i, (start, size) in enumerate(zip(starts, sizes)):
            self._note(seg, seg.next_offset + i, start, size, ts)
        seg.count += len(starts)
        seg.size = starts[-1] + sizes[-1] if starts else seg.size

    # ---------------------------------------------------------------- reading
    def _segment_of(self, offset: int) -> PartSegment | None:
        i = bisect_right([s.base for s in self.segments], offset) - 1
        return self.segments[i] if i >= 0 else None

    def position_of(self, seg: PartSegment, offset: int) -> tuple[int, int]:
        """The index entry at or before ``offset``: (queue offset, file position)."""
        rel = offset - seg.base
        idx = seg.index
        lo, hi = 0, len(idx) // 2
        while lo < hi:
            mid = (lo + hi) // 2
            if idx[2 * mid] <= rel:
                lo = mid + 1
            else:
                hi = mid
        return (seg.base + idx[2 * (lo - 1)], idx[2 * (lo - 1) + 1]) if lo else (seg.base, 0)

    def read_records(self, files: FileCache, offset: int, max_messages: int, max_bytes: int) -> list[Record]:
        """Records from queue offset ``offset``: index look-up, then a forward scan."""
        return [rec for rec, _raw in self.read_with_bytes(files, offset, max_messages, max_bytes)]

    def read_with_bytes(
        self, files: FileCache, offset: int, max_messages: int, max_bytes: int
    ) -> list[tuple[Record, bytes]]:
        """Records from queue offset ``offset``, each with its bytes as stored, each
        checked to be the record asked for (:class:`CorruptRecordError` if the first is
        not; a later bad one ends the list early, and the next read raises)."""
        seg = self._segment_of(offset)
        if seg is None or offset >= seg.next_offset:
            return []
        at, pos = self.position_of(seg, offset)
        # From the index entry: at most one interval to skip, then what was asked for;
        # at least one whole record however large.
        window = self.index_interval + max(max_bytes, self.max_message_bytes)
        data = files.pread(seg.path, min(window, seg.size - pos), pos)
        walk = walk_records(data)
        out: list[tuple[Record, bytes]] = []
        try:
            for start in walk.starts.tolist():
                if at >= offset:
                    rec = decode_record(data, start, str(seg.path), start + pos)
                    actual = (rec.topic, rec.queue_id, rec.queue_offset, rec.commitlog_offset)
                    expect_identity(seg.path, start + pos, (self.topic, self.queue_id, at, start + pos), actual)
                    out.append((rec, data[start : start + rec.size]))
                    if len(out) >= max_messages:
                        return out
                at += 1
            if not out and at < seg.next_offset:  # the walk stopped short of the record asked for
                raise CorruptRecordError(
                    str(seg.path),
                    pos + walk.stop,
                    f"record of queue offset {offset}",
                    "a whole record",
                    f"{walk.reason} after {walk.stop} of {len(data)} bytes read",
                )
        except CorruptRecordError:
            if not out:
                raise
        return out

    def records_from(self, files: FileCache, offset: int, limit: int) -> Iterator[tuple[Record, bytes]]:
        """Up to ``limit`` checked records from ``offset`` on, read in chunks. A damaged
        record ends the run: raised if it is the first, else the next run starts there."""
        seen = 0
        while seen < limit and offset < self.next_offset:
            try:
                got = self.read_with_bytes(files, offset, min(256, limit - seen), 1 << 20)
            except CorruptRecordError:
                if seen:
                    return
                raise
            if not got:
                return
            yield from got
            seen, offset = seen + len(got), got[-1][0].queue_offset + 1

    def offset_for_timestamp(self, files: FileCache, ts: int) -> int:
        for seg in self.segments:
            if (seg.times and seg.times[-1][0] >= ts) or seg is self.segments[-1]:
                start = max((r for t, r in seg.times if t < ts), default=0)
                offset = seg.base + start
                while offset < seg.next_offset:
                    recs = self.read_records(files, offset, 256, 1 << 20)
                    for r in recs:
                        if r.store_timestamp_ms >= ts:
                            return r.queue_offset
                    if not recs:
                        break
                    offset = recs[-1].queue_offset + 1
        return self.next_offset

    def delete_before(self, files: FileCache, keep_after_ms: float | None, keep_bytes: int | None, now: float) -> int:
        """Retention: delete whole old segments, never the active one."""
        total = sum(s.size for s in self.segments)
        doomed = 0
        for seg in self.segments[:-1]:
            too_old = keep_after_ms is not None and (now - os.path.getmtime(seg.path)) * 1000 > keep_after_ms
            too_big = keep_bytes is not None and total > keep_bytes
            if not (too_old or too_big):
                break
            total -= seg.size
            doomed += 1
        self.drop_segments(files, self.segments[:doomed])
        del self.segments[:doomed]
        return doomed


# ------------------------------------------------------------------------ opening
@dataclass
class LoadReport:
    """What opening one partition found, for the store's one log line."""

    rebuilt: list[str] = field(default_factory=list)  # index files that did not check: why
    cut: list[str] = field(default_factory=list)  # torn tails cut (never promised durable)
    scanned: int = 0  # segments read whole (damaged index, or validated after a crash)


@dataclass
class _Scan:
    starts: list[int]  # positions of the records of the valid prefix
    end: int  # where the valid prefix ends
    problem: str | None  # why the prefix ends before the file does


class PartitionLoader:
    """Opening one partition, clean or not, against its *recovery point* (every record
    below it was fsynced and promised durable):

    - a segment whose index files check and cover exactly its length and the records up
      to its successor's base is trusted without reading it; the newest segment's last
      index interval is walked and its last record CRC-checked;
    - any other segment is read whole: walked, each record's queue offset, queue id and
      position checked, and the last record's CRC (after an unclean stop every record at
      or above the recovery point too); its indexes are rebuilt;
    - records that are gone or damaged *below* the recovery point (or anywhere, after a
      clean stop) refuse the open with :class:`~commitlog.LogDamageError`; only after an
      unclean stop is a torn tail above the recovery point cut, as a crash leaves one.
    """

    def __init__(self, part: PartitionLog, files: FileCache, promised: int, unclean: bool) -> None:
        self.part = part
        self.files = files
        self.promised = promised
        self.unclean = unclean
        self.report = LoadReport()
        self._topic = part.topic.encode()
        self._claimed: dict[int, int] = {}  # segment base -> the length its index files say

    def load(self) -> LoadReport:
        part = self.part
        segs = part.segments = part.list_segments()
        if not segs:
            if self.promised > 0:
                raise self._damage(str(part.directory), 0, 0, "no segment files", 0)
            part.new_segment(0)
            return self.report
        validate_from = max(0, bisect_right([s.base for s in segs], self.promised) - 1) if self.unclean else len(segs)
        i = 0
        while i < len(part.segments):
            seg = part.segments[i]
            nxt = part.segments[i + 1] if i + 1 < len(part.segments) else None
            why = self._trust(seg, nxt)
            if why is not None or i >= validate_from:
                self._rescan(seg, nxt)
            i += 1
        if part.next_offset < self.promised:
            last = part.segments[-1]
            reason = f"the partition ends at queue offset {part.next_offset}, below its recovery point {self.promised}"
            raise self._damage(
                str(last.path), last.size, max(last.size, self._claimed.get(last.base, 0)), reason, part.next_offset
            )
        return self.report

    def _trust(self, seg: PartSegment, nxt: PartSegment | None) -> str | None:
        """None if ``seg``'s index files can be used as they are, else why not."""
        why = self.part.load_indexes(seg, None if nxt is None else nxt.base - seg.base)
        if self.part.claimed_size >= 0:
            self._claimed[seg.base] = self.part.claimed_size
        if why is None and nxt is None and not self.unclean:  # after a crash it is read whole anyway
            why = self._check_tail(seg)
        if why is not None and (nxt is not None or not self.unclean):
            self.report.rebuilt.append(f"{seg.path}: {why}")  # after a crash the newest one is stale: normal
        return why

    def _check_tail(self, seg: PartSegment) -> str | None:
        """The newest segment: its records after the last index entry are whole and the
        last one is the partition's last record, with a good CRC."""
        if not seg.count:
            return None if seg.size == 0 else f"no records indexed in {seg.size} bytes"
        rel, pos = seg.index[-2], seg.index[-1]
        data = self.files.pread(seg.path, seg.size - pos, pos)
        walk = walk_records(data)
        if walk.reason != "end" or walk.stop != len(data) or walk.count != seg.count - rel:
            return f"tail from position {pos}: {walk.count} records to {pos + walk.stop} ({walk.reason})"
        start = int(walk.starts[-1])
        try:
            rec = decode_record(data, start, str(seg.path), pos + start)
            actual = (rec.topic, rec.queue_id, rec.queue_offset, rec.commitlog_offset)
            expect_identity(
                seg.path, pos + start, (self.part.topic, self.part.queue_id, seg.next_offset - 1, pos + start), actual
            )
        except CorruptRecordError as e:
            return str(e)
        return None

    def _rescan(self, seg: PartSegment, nxt: PartSegment | None) -> None:
        """Read ``seg`` whole, rebuild its indexes, and settle what the scan found."""
        data = self.files.pread(seg.path, seg.size, 0) if seg.size else b""
        scan = self._scan(data, seg)
        self.report.scanned += 1
        self.part.index_records(seg, data, scan.starts)
        expected = None if nxt is None else nxt.base - seg.base
        if scan.end == seg.size and expected in (None, seg.count):
            self.part.write_indexes(seg)
            return
        first_lost = seg.base + seg.count
        if self.unclean and first_lost >= self.promised:
            self._cut(seg, scan)
            return
        raise self._chain_damage(seg, nxt, scan)

    def _scan(self, data: bytes, seg: PartSegment) -> _Scan:
        """The valid prefix of a segment: whole records, each one's identity checked
        (vectorised); CRCs of the last record and, after an unclean stop, of every record
        at or above the recovery point (below it, a damaged record fails its read)."""
        walk = walk_records(data)
        starts = walk.starts
        end, problem = walk.stop, None
        if walk.reason != "end" or walk.stop != len(data):
            problem = f"{walk.reason} record at position {walk.stop}"
        good = _first_stranger(data, walk, seg.base, self._topic, self.part.queue_id)
        if good < len(starts):
            start = int(starts[good])
            end, problem = start, f"record at position {start} is not queue offset {seg.base + good} of this partition"
            try:
                expected = (self._topic, self.part.queue_id, seg.base + good, start)
                expect_identity(seg.path, start, expected, header_identity(data, start, len(self._topic)))
            except CorruptRecordError as e:
                problem = str(e)
        crc_from = max(0, self.promised - seg.base) if self.unclean else good
        for i in [*range(crc_from, good - 1), good - 1] if good else []:
            start = int(starts[i])
            try:
                check_record(data, start, str(seg.path), start)
            except CorruptRecordError as e:
                return _Scan(starts[:i].tolist(), start, str(e))
        return _Scan(starts[:good].tolist(), end, problem)

    def _cut(self, seg: PartSegment, scan: _Scan) -> None:
        """A torn tail after an unclean stop, above the recovery point: cut it (durably)
        and delete the segments after it."""
        part = self.part
        later = part.segments[part.segments.index(seg) + 1 :]
        if scan.end < seg.size:
            self.files.truncate(seg.path, scan.end)
        dropped = seg.size - scan.end
        seg.size = scan.end
        part.write_indexes(seg)
        part.drop_segments(self.files, later)
        del part.segments[len(part.segments) - len(later) :]
        fsync_dir(part.directory)
        what = scan.problem or "records missing after it"
        self.report.cut.append(
            f"{seg.path} at position {scan.end} ({what}; {dropped} bytes, {len(later)} later segments)"
        )

    def _chain_damage(self, seg: PartSegment, nxt: PartSegment | None, scan: _Scan) -> LogDamageError:
        first_lost = seg.base + seg.count
        claimed = self._claimed.get(seg.base, 0)
        if scan.end < seg.size:
            return self._damage(str(seg.path), scan.end, seg.size, scan.problem or "damaged records", first_lost)
        assert nxt is not None
        if claimed > seg.size:  # its own index says it was longer: cut short
            reason = f"{claimed - seg.size} bytes gone from its end; the next segment begins at {nxt.base}"
            return self._damage(str(seg.path), seg.size, claimed, reason, first_lost)
        if seg.count < nxt.base - seg.base:
            missing = seg.path.with_name(_name(first_lost, ".log"))
            reason = (
                f"segment missing: records {first_lost}..{nxt.base - 1} are in no file"
                f" ({seg.path.name} ends at {first_lost}, {nxt.path.name} begins at {nxt.base})"
            )
            return self._damage(str(missing), 0, 0, reason, first_lost)
        reason = f"{seg.path.name} holds records up to {first_lost - 1}, but {nxt.path.name} begins at {nxt.base}"
        return self._damage(str(nxt.path), 0, 0, reason, nxt.base)

    def _damage(self, file: str, start: int, end: int, reason: str, first_lost: int) -> LogDamageError:
        last = max(self.promised - 1, max((s.base for s in self.part.segments), default=0) - 1)
        queues = [(self.part.topic, self.part.queue_id, first_lost, last)] if last >= first_lost else []
        return LogDamageError(file, start, end, reason, queues)
