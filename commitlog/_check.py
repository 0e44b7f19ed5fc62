"""Checking a segmented log end to end (``clmq store check``) and cutting it to its
longest valid prefix (``clmq store repair``).

Two layouts share the record format and this code:

- :attr:`LogLayout.COMMITLOG`: the CommitLog. Segments are named by the log offset of
  their first byte, a record carries ``base + position`` as its commit-log offset, a
  full segment ends in a blank marker and is extended to its full size, so every
  segment but the last ends exactly where its successor's base says. Problem ranges
  are log offsets.
- :attr:`LogLayout.PARTITION`: one partition of the partition-per-file mode. Segments
  are named by the queue offset of their first record, a record carries its file
  position as its commit-log offset and ``base + index`` as its queue offset, and a
  segment holds exactly ``successor's base - base`` records. Problem ranges are file
  positions.

Invariants:
- :func:`check_log` only reads (through ``fileops.OPS.pread``): it never writes, locks
  or changes a file, so it can run on a copy, a read-only mount or a store that is
  closed. It reads every byte of every segment (CRCs included), so it is I/O bound.
- After a damaged range the walk resynchronises on the next position that holds a
  valid record carrying its own offset, so that the records past the damage (lost if
  the log is cut) can be named.
- :func:`repair_log` cuts exactly at :attr:`LogReport.cut`, the end of the longest
  valid prefix: the file is truncated and fsynced, every later segment is deleted,
  the derived index files of the cut and deleted segments are removed (the next open
  rebuilds them), and the directory is fsynced.
"""

from __future__ import annotations

import enum
import inspect
import itertools
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np

from clmq.common import (
    BLANK_MAGIC,
    BLANK_SIZE,
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    OFF_TOPIC_LEN,
    RECORD_MAGIC,
    CorruptRecordError,
    check_record,
    gather_strings,
)

from . import fileops
from ._config import CommitLogConfig
from ._scan import scan
from ._segment import BOUNDARY_SUFFIX, BoundaryIndex, Segment, fsync_dir, parse_segment_name

Progress = Callable[[int], None]  # called with the number of bytes just read
_MAGIC_BYTES = RECORD_MAGIC.to_bytes(4, "little")
_DERIVED_SUFFIXES = (BOUNDARY_SUFFIX, ".index", ".timeindex")  # rebuilt by the next open


class LogLayout(str, enum.Enum):
    """How a segmented log names its segments and what its records carry."""

    COMMITLOG = "commitlog"
    PARTITION = "partition"


@dataclass(frozen=True, slots=True)
class LogProblem:
    """A damaged range: log offsets (CommitLog) or file positions (partition) ``[start, end)``."""

    file: str
    start: int
    end: int
    reason: str


@dataclass(frozen=True, slots=True)
class QueueRange:
    """Messages of one queue: queue offsets ``first..last`` (inclusive), ``count`` of them."""

    topic: str
    queue_id: int
    first: int
    last: int
    count: int


@dataclass(slots=True)
class LogReport:
    """What :func:`check_log` found in one segmented log (and what :func:`repair_log` did)."""

    directory: str
    layout: LogLayout
    segments: int = 0
    records: int = 0  # valid records, the damaged prefix's and past the damage
    bytes: int = 0  # file bytes read
    start: int = 0  # the first segment's base
    end: int = 0  # where the last segment's records end (log offset; partition: next queue offset)
    valid_end: int = 0  # end of the longest valid prefix, in the same unit as ``end``
    cut: tuple[str, int] | None = None  # (file, position) where that prefix ends, if damaged
    trims: list[tuple[str, int]] = field(default_factory=list)  # (file, length): only padding is off
    problems: list[LogProblem] = field(default_factory=list)
    index_problems: list[LogProblem] = field(default_factory=list)  # derived files, rebuilt at open
    beyond: list[QueueRange] = field(default_factory=list)  # valid records past the cut: lost by it
    repaired: bool = False

    @property
    def damaged(self) -> bool:
        """True when log bytes are damaged or missing (index problems alone are not damage)."""
        return bool(self.problems)


@dataclass(slots=True)
class _SegmentScan:
    """One segment walked: its valid prefix, its problems and the records past them."""

    path: Path
    base: int
    size: int
    prefix_end: int = 0  # file position where the valid prefix ends
    prefix_starts: list[int] = field(default_factory=list)
    sealed: bool = False  # the valid prefix ends in a blank marker that covers the file
    problems: list[LogProblem] = field(default_factory=list)
    later_starts: list[int] = field(default_factory=list)  # valid records after a problem
    claimed: int | None = None  # the length its blank marker claims, when not the file's


class _Window:
    """A read-only view of a segment file from ``shift`` on, shaped like the
    :class:`Segment` that :func:`scan` walks (``base``, ``size``, ``path``, ``read``)."""

    def __init__(self, fd: int, path: Path, origin: int, shift: int, size: int, meter: _Meter) -> None:
        self.fd = fd
        self.path = path
        self.shift = shift
        self.base = origin + shift  # what a record at window position p carries: base + p
        self.size = size - shift
        self.meter = meter

    def read(self, pos: int, n: int) -> bytes:
        data = fileops.OPS.pread(self.fd, n, self.shift + pos)
        self.meter.add(len(data))
        return data


class _Meter:
    """Reports progress per chunk read, and never more than a segment's size in all."""

    def __init__(self, progress: Progress | None, size: int) -> None:
        self.progress = progress
        self.left = size

    def add(self, n: int) -> None:
        n = min(n, self.left)
        if self.progress is not None and n > 0:
            self.progress(n)
        self.left -= n

    def finish(self) -> None:
        self.add(self.left)  # the sparse tail of a sealed segment, bytes past damage


# ------------------------------------------------------------------ walking
def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """The segment files of a log directory, by base."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    bases = sorted((b, n) for n in names if (b := parse_segment_name(n)) is not None)
    return [(b, directory / n) for b, n in bases]


def _origin(layout: LogLayout, base: int) -> int:
    """What a record at file position 0 carries as its commit-log offset."""
    return base if layout is LogLayout.COMMITLOG else 0


def _walk_segment(
    path: Path, base: int, layout: LogLayout, config: CommitLogConfig, progress: Progress | None = None
) -> _SegmentScan:
    """Walk every byte of one segment: the valid prefix, then damage and resyncs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        out = _SegmentScan(path, base, size)
        meter = _Meter(progress, size)
        shift, in_prefix = 0, True
        while shift < size or (shift == 0 and size == 0):
            window = _Window(fd, path, _origin(layout, base), shift, size, meter)
            result = scan(cast(Segment, window), config.max_message_bytes, verify=True)
            starts = [shift + s for s in result.starts]
            stop = shift + result.end
            if in_prefix:
                out.prefix_starts, out.prefix_end, out.sealed = starts, stop, result.sealed
            else:
                out.later_starts.extend(starts)
            if result.problem is None:
                break
            if in_prefix and layout is LogLayout.COMMITLOG and (claimed := _claimed_length(fd, stop, size)):
                out.claimed, out.prefix_end, out.sealed = claimed, claimed, True  # only its padding is off
                break
            in_prefix = False
            resume = _resync(fd, size, stop, _origin(layout, base), config.max_message_bytes)
            where = base + stop if layout is LogLayout.COMMITLOG else stop
            span = (resume if resume is not None else size) - stop
            out.problems.append(LogProblem(str(path), where, where + max(span, 0), result.problem))
            if resume is None:
                break
            shift = resume
        meter.finish()
        return out
    finally:
        os.close(fd)


def _claimed_length(fd: int, at: int, size: int) -> int | None:
    """The file length the blank marker at ``at`` claims, if there is one and it is not
    the file's (padding lost or added after it: the records are all there)."""
    head = fileops.OPS.pread(fd, BLANK_SIZE, at)
    if len(head) < BLANK_SIZE:
        return None
    remaining, magic = struct.unpack("<II", head)
    claimed = at + remaining
    return claimed if magic == BLANK_MAGIC and remaining >= BLANK_SIZE and claimed != size else None


def _resync(fd: int, size: int, after: int, origin: int, max_message_bytes: int) -> int | None:
    """The first position past ``after`` holding a valid record that carries its own
    offset (``origin + position``), or None."""
    if size - after < HEADER_SIZE:
        return None
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
        at = data.find(_MAGIC_BYTES, after + 1 + 4)
        while at >= 0:
            pos = at - 4
            if (
                int.from_bytes(data[pos + OFF_COMMITLOG_OFFSET : pos + OFF_COMMITLOG_OFFSET + 8], "little")
                == origin + pos
            ):
                try:
                    check_record(data[pos : pos + max_message_bytes], 0, "", origin + pos)
                    return pos
                except CorruptRecordError:
                    pass
            at = data.find(_MAGIC_BYTES, at + 1)
    return None


# ------------------------------------------------------------ record columns
def _columns(path: Path, starts: list[int]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Topics (distinct names and an index per record), queue ids and queue offsets of
    the (already validated) records at ``starts`` of one file."""
    pos = np.asarray(starts, dtype=np.int64)
    if not len(pos):
        return [], pos, pos, pos
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as data:
        buf = np.frombuffer(data, dtype=np.uint8)
        qoffs = _field(buf, pos, OFF_QUEUE_OFFSET, "<u8")
        qids = _field(buf, pos, OFF_QUEUE_ID, "<u4")
        lengths = _field(buf, pos, OFF_TOPIC_LEN, "<u2")
        names, inverse = gather_strings(buf, pos + HEADER_SIZE, lengths)
        del buf  # release the map before it closes
    return [n.decode() for n in names], inverse, qids, qoffs


def _field(buf: np.ndarray, pos: np.ndarray, offset: int, dtype: str) -> np.ndarray:
    """One little-endian header field of every record at ``pos``, as int64."""
    width = np.dtype(dtype).itemsize
    cells = buf[pos[:, None] + np.arange(offset, offset + width)]
    return np.ascontiguousarray(cells).view(dtype).reshape(len(pos)).astype(np.int64)


def queue_ranges(path: Path, starts: list[int]) -> list[QueueRange]:
    """The messages of the records at ``starts`` of one file, as one range per queue."""
    names, topic_idx, qids, qoffs = _columns(path, starts)
    out: list[QueueRange] = []
    if not names:
        return out
    codes = topic_idx << 32 | qids
    for code in np.unique(codes).tolist():
        sel = qoffs[codes == code]
        out.append(QueueRange(names[code >> 32], code & 0xFFFFFFFF, int(sel.min()), int(sel.max()), len(sel)))
    return out


def merge_ranges(ranges: list[QueueRange]) -> list[QueueRange]:
    """One range per queue (lowest first, highest last, counts added), sorted."""
    merged: dict[tuple[str, int], QueueRange] = {}
    for r in ranges:
        had = merged.get((r.topic, r.queue_id))
        if had is not None:
            r = QueueRange(r.topic, r.queue_id, min(had.first, r.first), max(had.last, r.last), had.count + r.count)
        merged[(r.topic, r.queue_id)] = r
    return [merged[k] for k in sorted(merged)]


def _check_queue_offsets(seg: _SegmentScan) -> None:
    """Partition layout: the prefix's records must carry queue offsets base, base+1, ..."""
    _names, _t, _q, qoffs = _columns(seg.path, seg.prefix_starts)
    ok = qoffs == np.arange(seg.base, seg.base + len(qoffs))
    if ok.all():
        return
    bad = int(np.argmin(ok))
    at = seg.prefix_starts[bad]
    reason = f"record at position {at} carries queue offset {int(qoffs[bad])}, expected {seg.base + bad}"
    seg.problems.insert(0, LogProblem(str(seg.path), at, seg.size, reason))
    seg.later_starts = seg.prefix_starts[bad:] + seg.later_starts
    seg.prefix_starts, seg.prefix_end, seg.sealed = seg.prefix_starts[:bad], at, False


# -------------------------------------------------------------- continuity
def _continuity(cur: _SegmentScan, nxt: _SegmentScan, layout: LogLayout, config: CommitLogConfig) -> None:
    """Add to ``cur`` the problem of not ending where its successor begins."""
    if layout is LogLayout.PARTITION:
        _partition_continuity(cur, nxt)
        return
    file_end, path = cur.base + (cur.size if cur.claimed is None else cur.claimed), str(cur.path)
    if nxt.base > file_end:
        complete = cur.sealed and not cur.problems  # its blank marker covers the file: whole
        reason = (
            f"missing segment: log offsets {file_end}..{nxt.base} are in no file"
            if complete
            else f"segment is {nxt.base - file_end} bytes shorter than its successor's base {nxt.base} says"
        )
        cur.problems.append(LogProblem(path, file_end, nxt.base, reason))
    elif nxt.base < file_end:
        reason = f"segment is {file_end - nxt.base} bytes longer than its successor's base {nxt.base} says"
        cur.problems.append(LogProblem(path, nxt.base, file_end, reason))
    elif not cur.sealed and not cur.problems:
        reason = f"segment does not end in a blank marker but is followed by the segment at {nxt.base}"
        cur.problems.append(LogProblem(path, cur.base + cur.prefix_end, file_end, reason))


def _partition_continuity(cur: _SegmentScan, nxt: _SegmentScan) -> None:
    if cur.problems:
        return  # the count is already wrong; the damage says why
    count, path = len(cur.prefix_starts), str(cur.path)
    if nxt.base > cur.base + count:
        reason = (
            f"segment holds {count} records but its successor starts at queue offset {nxt.base}: "
            f"queue offsets {cur.base + count}..{nxt.base - 1} are in no file"
        )
        cur.problems.append(LogProblem(path, cur.size, cur.size, reason))
    elif nxt.base < cur.base + count:
        at = cur.prefix_starts[nxt.base - cur.base]
        extra = cur.base + count - nxt.base
        reason = f"segment holds {count} records, {extra} more than its successor's base {nxt.base} allows"
        cur.problems.append(LogProblem(path, at, cur.size, reason))


# ------------------------------------------------------------ boundary index
def _check_boundaries(seg: _SegmentScan) -> LogProblem | None:
    """A damaged boundary index: one that does not check, or names a position where no
    record starts (the interval it was built with need not be known). A missing one,
    or one of an older format, is not damage: the next open rebuilds it."""
    path = seg.path.with_suffix(BOUNDARY_SUFFIX)
    if not path.exists():
        return None
    positions, why = _load_boundaries(path, seg.base, seg.size)
    if positions is None:
        return (
            None
            if why in ("missing", "unrecognised", "old format")
            else LogProblem(str(path), seg.base, seg.base + seg.size, f"boundary index does not check ({why})")
        )
    have = np.asarray(positions, dtype=np.int64)
    starts = np.asarray(seg.prefix_starts, dtype=np.int64)  # increasing: a binary search per position
    at = np.minimum(np.searchsorted(starts, have), max(len(starts) - 1, 0))
    stray = have[starts[at] != have] if len(starts) else have
    if not len(stray):
        return None
    return LogProblem(
        str(path),
        seg.base,
        seg.base + seg.size,
        f"boundary index names {len(stray)} positions where no record starts (first: {int(stray[0])})",
    )


def _load_boundaries(path: Path, base: int, size: int) -> tuple[list[int] | None, str]:
    """The positions of a boundary index through :class:`BoundaryIndex` (whichever of
    its two forms this tree has: ``(path, interval)`` with ``load() -> bool``, or
    ``(path, interval, base)`` with ``load(size) -> reason | None``)."""
    make: Any = BoundaryIndex
    if len(inspect.signature(BoundaryIndex).parameters) >= 3:
        index = make(path, 1, base)
        why = index.load(size)
        return (list(index.positions), "") if why is None else (None, str(why))
    index = make(path, 1)
    return (list(index.positions), "") if index.load() else (None, "bad size or order")


# -------------------------------------------------------------- the check
def check_log(
    directory: Path, config: CommitLogConfig, layout: LogLayout = LogLayout.COMMITLOG, progress: Progress | None = None
) -> LogReport:
    """Read every segment of the log in ``directory`` and report what is damaged.

    Read-only. Every record's size bounds, magic, embedded offset and CRC are checked
    (partition layout: its queue offset too), then each segment's end against its
    successor's base; damaged boundary indexes are listed apart (they are derived).
    """
    directory = Path(directory)
    report = LogReport(str(directory), layout)
    scans = []
    for base, path in list_segments(directory):
        seg = _walk_segment(path, base, layout, config, progress)
        if layout is LogLayout.PARTITION:
            _check_queue_offsets(seg)
        scans.append(seg)
        report.bytes += seg.size
    for cur, nxt in itertools.pairwise(scans):
        _continuity(cur, nxt, layout, config)
    _summarise(report, scans, layout, config)
    return report


def _summarise(report: LogReport, scans: list[_SegmentScan], layout: LogLayout, config: CommitLogConfig) -> None:
    """Fill the report from the walked segments: counts, problems, the cut and what it costs."""
    report.segments = len(scans)
    report.records = sum(len(s.prefix_starts) + len(s.later_starts) for s in scans)
    if not scans:
        return
    report.start = scans[0].base
    last = scans[-1]
    report.end = last.base + (last.size if layout is LogLayout.COMMITLOG else len(last.prefix_starts))
    report.valid_end = report.end
    for i, seg in enumerate(scans):
        report.problems.extend(seg.problems)
        if seg.claimed is not None and not seg.problems:
            report.problems.append(_trim_problem(seg))
            report.trims.append((str(seg.path), seg.claimed))
        if layout is LogLayout.COMMITLOG and not seg.problems:  # a damaged one is rebuilt anyway
            problem = _check_boundaries(seg)
            if problem is not None:
                report.index_problems.append(problem)
        if seg.problems and report.cut is None:
            report.cut = (str(seg.path), seg.prefix_end)
            unit = seg.prefix_end if layout is LogLayout.COMMITLOG else len(seg.prefix_starts)
            report.valid_end = seg.base + unit
            lost = [queue_ranges(seg.path, seg.later_starts)]
            lost += [queue_ranges(s.path, s.prefix_starts + s.later_starts) for s in scans[i + 1 :]]
            report.beyond = merge_ranges([r for rs in lost for r in rs])


def _trim_problem(seg: _SegmentScan) -> LogProblem:
    claimed = cast(int, seg.claimed)
    lo, hi = sorted((seg.size, claimed))
    what = "missing" if seg.size < claimed else "added"
    reason = (
        f"segment file holds {seg.size} bytes, its blank marker says {claimed}: {hi - lo} bytes of "
        f"padding {what} after its last record (no record lost; repair restores the length)"
    )
    return LogProblem(str(seg.path), seg.base + lo, seg.base + hi, reason)


# ------------------------------------------------------------- the repair
def repair_log(
    directory: Path, config: CommitLogConfig, layout: LogLayout = LogLayout.COMMITLOG, progress: Progress | None = None
) -> LogReport:
    """Cut the log to its longest valid prefix, durably; returns the check's report
    with ``repaired`` set when something changed (``beyond`` is what was lost).

    Segments whose only fault is their padding get the length their blank marker
    claims. The cut segment is truncated, every later segment is deleted, the derived
    index files of both are removed; every change is fsynced, then the directory.
    """
    report = check_log(directory, config, layout, progress)
    if report.cut is None and not report.trims:
        return report
    cut_base = parse_segment_name(Path(report.cut[0]).name) if report.cut else None
    for file, length in report.trims:
        base = parse_segment_name(Path(file).name)
        if cut_base is None or (base is not None and base < cut_base):
            _set_length(Path(file), length)
    if report.cut is not None and cut_base is not None:
        _set_length(Path(report.cut[0]), report.cut[1])
        for base, path in list_segments(Path(directory)):
            if base > cut_base:
                path.unlink()
            if base >= cut_base:
                for suffix in _DERIVED_SUFFIXES:
                    path.with_suffix(suffix).unlink(missing_ok=True)
    fsync_dir(Path(directory))
    report.repaired = True
    return report


def _set_length(path: Path, length: int) -> None:
    """Truncate (or extend with zeros, sparsely) ``path`` to ``length``, durably."""
    fd = os.open(path, os.O_RDWR)
    try:
        fileops.OPS.ftruncate(fd, length)
        fileops.OPS.fsync(fd)
    finally:
        os.close(fd)


def queue_extents(
    directory: Path, config: CommitLogConfig, layout: LogLayout = LogLayout.COMMITLOG
) -> list[QueueRange]:
    """Per queue, the lowest and highest queue offsets (and the count) of the records in
    the valid prefix of the log in ``directory``: what a repaired log still holds, and
    the topics it can rebuild ``topics.json`` from. Reads (and CRC-checks) every segment."""
    found: list[QueueRange] = []
    for base, path in list_segments(Path(directory)):
        seg = _walk_segment(path, base, layout, config)
        found = merge_ranges(found + queue_ranges(path, seg.prefix_starts))
        if seg.problems:
            break
    return found
