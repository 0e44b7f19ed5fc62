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
- Indexes are derived: rebuilt by a scan of the segment whenever it is recovered.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from commitlog import Record, ScanResult, decode_record, fsync_dir, gather_fields, walk_records
from consumequeue import FileCache

log = logging.getLogger("clmq.partition")

_INDEX = struct.Struct("<II")
_TIME = struct.Struct("<QI")


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


class PartitionLog:
    """Segments of one (topic, queue); appends and reads go through ``files`` (an LRU)."""

    def __init__(self, directory: Path, topic: str, queue_id: int, segment_bytes: int, index_interval: int,
                 max_message_bytes: int) -> None:  # fmt: skip
        self.directory = directory
        self.max_message_bytes = max_message_bytes
        self.topic = topic
        self.queue_id = queue_id
        self.segment_bytes = segment_bytes
        self.index_interval = index_interval
        self.segments: list[PartSegment] = []

    # ---------------------------------------------------------------- loading
    def load(self, files: FileCache, recover_from: int | None) -> list[str]:
        """Open the segments. Segments from the one holding queue offset ``recover_from``
        on are CRC-validated and their indexes rebuilt (``None``: trust them all).
        Returns what recovery repaired, for the caller's log line."""
        self.directory.mkdir(parents=True, exist_ok=True)
        bases = sorted(int(n[:20]) for n in os.listdir(self.directory) if n.endswith(".log") and n[:20].isdigit())
        self.segments = [PartSegment(b, self.directory / _name(b, ".log"), 0, 0) for b in bases]
        for seg in self.segments:
            seg.size = os.path.getsize(seg.path)
        if not self.segments:
            self._new_segment(0)
            return []
        first = 0 if recover_from is None else max(0, bisect_right([s.base for s in self.segments], recover_from) - 1)
        repaired: list[str] = []
        for i, seg in enumerate(self.segments):
            validate = recover_from is not None and i >= first
            if not validate and self._load_index(seg):
                continue
            problem = self._rebuild(seg, files, verify=validate)
            if problem:
                repaired.append(problem)
                for later in self.segments[i + 1 :]:
                    files.forget(later.path)
                    for suffix in (".log", ".index", ".timeindex"):
                        later.path.with_suffix(suffix).unlink(missing_ok=True)
                del self.segments[i + 1 :]
                fsync_dir(self.directory)
                break
        return repaired

    def _load_index(self, seg: PartSegment) -> bool:
        """Trust a sealed segment's index files; count its records from the next base."""
        idx_path, time_path = seg.path.with_suffix(".index"), seg.path.with_suffix(".timeindex")
        if seg is self.segments[-1] or not idx_path.exists() or not time_path.exists():
            return False
        seg.index = array("I", idx_path.read_bytes())
        raw = time_path.read_bytes()
        seg.times = [_TIME.unpack_from(raw, p) for p in range(0, len(raw) - len(raw) % 12, 12)]
        nxt = self.segments[self.segments.index(seg) + 1].base
        seg.count = nxt - seg.base
        return True

    def _rebuild(self, seg: PartSegment, files: FileCache, verify: bool) -> str | None:
        """Walk the segment: count records, rebuild indexes, cut a bad tail durably."""
        data = files.pread(seg.path, seg.size, 0) if seg.size else b""
        result = _validate(data, seg, verify)
        seg.count, seg.index, seg.times, seg.since_index = 0, array("I"), [], 0
        self._index_records(seg, data, result.starts)
        problem = None
        if result.end < seg.size:
            problem = f"{seg.path}: truncated at position {result.end}: {result.problem}"
            log.warning("partition recovery: %s; dropped %d bytes", problem, seg.size - result.end)
            files.truncate(seg.path, result.end)
            seg.size = result.end
        self._write_indexes(seg)
        return problem

    def _index_records(self, seg: PartSegment, data: bytes, starts: list[int]) -> None:
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

    def _write_indexes(self, seg: PartSegment) -> None:
        """Persist a segment's indexes; derived data, so on failure (disk full) the files
        are removed and the next open rebuilds them by a scan."""
        idx, times = seg.path.with_suffix(".index"), seg.path.with_suffix(".timeindex")
        try:
            idx.write_bytes(seg.index.tobytes())
            times.write_bytes(b"".join(_TIME.pack(t, r) for t, r in seg.times))
        except OSError as e:
            log.warning("partition %s: indexes of %s not written (%s); rebuilt at next open", self.directory, seg.path, e)
            idx.unlink(missing_ok=True)
            times.unlink(missing_ok=True)

    def _new_segment(self, base: int) -> PartSegment:
        seg = PartSegment(base, self.directory / _name(base, ".log"), 0, 0)
        seg.path.touch()
        self.segments.append(seg)
        return seg

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
            self._write_indexes(seg)
            return self._new_segment(seg.next_offset), True
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

    def read(self, files: FileCache, offset: int, max_messages: int, max_bytes: int) -> list[Record]:
        """Records from queue offset ``offset``: index look-up, then a forward scan."""
        return [rec for rec, _raw in self.read_with_bytes(files, offset, max_messages, max_bytes)]

    def read_with_bytes(self, files: FileCache, offset: int, max_messages: int,
                        max_bytes: int) -> list[tuple[Record, bytes]]:  # fmt: skip
        """Records from queue offset ``offset``, each with its bytes as stored."""
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
        for start in walk.starts.tolist():
            if at >= offset:
                rec = decode_record(data, start, str(seg.path), start + pos)
                out.append((rec, data[start : start + rec.size]))
                if len(out) >= max_messages:
                    break
            at += 1
        return out

    def offset_for_timestamp(self, files: FileCache, ts: int) -> int:
        for seg in self.segments:
            if (seg.times and seg.times[-1][0] >= ts) or seg is self.segments[-1]:
                start = max((r for t, r in seg.times if t < ts), default=0)
                offset = seg.base + start
                while offset < seg.next_offset:
                    recs = self.read(files, offset, 256, 1 << 20)
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
        for seg in self.segments[:doomed]:
            files.forget(seg.path)
            for suffix in (".log", ".index", ".timeindex"):
                seg.path.with_suffix(suffix).unlink(missing_ok=True)
        del self.segments[:doomed]
        return doomed


def _validate(data: bytes, seg: PartSegment, verify: bool) -> ScanResult:
    """Valid prefix of a partition segment: whole records, right offsets and CRCs."""
    walk = walk_records(data)
    starts = walk.starts
    end = walk.stop
    problem = None if walk.reason == "end" and end == len(data) else f"{walk.reason} record at {end}"
    if verify and len(starts):
        buf = np.frombuffer(data, dtype=np.uint8)
        h = gather_fields(buf, walk, ["queue_offset", "commitlog_offset"])
        ok = (h["queue_offset"] == np.arange(seg.base, seg.base + len(starts))) & (h["commitlog_offset"] == starts)
        good = int(np.argmin(ok)) if not ok.all() else len(starts)
        for i, start in enumerate(starts[:good].tolist()):
            try:
                decode_record(data, start, str(seg.path), start)
            except Exception as e:
                good, problem = i, str(e)
                break
        if good < len(starts):
            end = int(starts[good])
            problem = problem or f"record {seg.base + good} has the wrong offsets"
            starts = starts[:good]
    return ScanResult(end, starts.tolist(), False, problem)
