"""The CommitLog: one sequential log holding every message of every queue.

Invariants:
- Offsets are byte positions in the log. Segments are contiguous: each one's base is
  the previous one's ``base + length``; only the last segment (the *active* one) grows.
- A single writer (under ``_lock``) appends; queue offsets are assigned there from the
  ``(topic, queue) -> next offset`` table, so that they are dense and never reused.
- ``durable_offset <= write_offset``; ``confirmed_offset <= write_offset`` and nothing
  past ``confirmed_offset`` is handed to consumers (replication lowers it).
- Nothing waits for fsync while holding ``_lock``.
"""

from __future__ import annotations

import enum
import logging
import mmap
import os
import struct
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import crc32c as _crc32c
import numpy as np

from ._columns import Walk, gather_fields, walk_records
from ._config import CommitLogConfig, FlushMode
from ._durability import DurableOffset
from ._encoder import BatchEncoder, EncodedBatch, EncodeError, Group, restore_offsets
from ._errors import CorruptRecordError
from ._packed import PackedMessages
from ._record import (
    BLANK_MAGIC,
    BLANK_SIZE,
    CRC_START,
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    OFF_TOPIC_LEN,
    RECORD_MAGIC,
    Message,
    Record,
    check_record,
    decode_record,
)  # fmt: skip
from ._segment import Segment, fsync_dir, parse_segment_name

log = logging.getLogger("clmq.commitlog")

QueueKey = tuple[str, int]
_U32 = struct.Struct("<I")
_CHECKED = ["total_size", "crc", "commitlog_offset", "topic_len", "tags_len", "keys_len", "props_len", "body_len"]
_SIZE_MAGIC = struct.Struct("<II")


class AppendStatus(enum.Enum):
    OK = "ok"
    MESSAGE_TOO_LARGE = "message too large"
    INVALID_MESSAGE = "invalid message"
    DISK_FULL = "disk full"
    IO_ERROR = "i/o error"
    OFFSET_MISMATCH = "offset mismatch"  # raw appends that do not continue the log
    INVALID_QUEUE_ID = "invalid queue id"  # packed appends: a queue id the topic lacks
    MALFORMED_BATCH = "malformed batch"  # packed appends: bytes that do not decode


_ENCODE_STATUS = {"too_large": AppendStatus.MESSAGE_TOO_LARGE, "invalid": AppendStatus.INVALID_MESSAGE,
                  "queue": AppendStatus.INVALID_QUEUE_ID, "malformed": AppendStatus.MALFORMED_BATCH}  # fmt: skip


@dataclass(slots=True)
class AppendResult:
    """The outcome of one append. ``status`` other than OK means nothing was written."""

    status: AppendStatus
    error: str = ""
    start_offset: int = 0
    end_offset: int = 0
    store_timestamp_ms: int = 0
    queue_offsets: list[int] = field(default_factory=list)
    commitlog_offsets: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # messages per input batch

    @property
    def ok(self) -> bool:
        return self.status is AppendStatus.OK


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What a validating walk of one segment found."""

    end: int  # file position after the last valid record (or blank marker)
    starts: list[int]  # file positions of valid records
    sealed: bool  # ended with a blank marker
    problem: str | None  # why the walk stopped before the file's end, if it did


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class CommitLog:
    """Segmented, append-only log. Use :meth:`open`; close with :meth:`close`."""

    def __init__(self, directory: Path, config: CommitLogConfig) -> None:
        self.directory = directory
        self.config = config
        self._lock = threading.Lock()
        self._segments: tuple[Segment, ...] = ()
        self._bases: tuple[int, ...] = ()
        self._graveyard: list[Segment] = []  # deleted, closed one retention pass later
        self._queue_offsets: dict[QueueKey, int] = {}
        self._dirty: set[Segment] = set()
        self._dir_dirty = False
        self._confirmed: int | None = None
        self._durable = DurableOffset()
        self._append_listeners: list[Callable[[], None]] = []
        self._encoder = BatchEncoder(config.segment_bytes, config.max_message_bytes, config.store_host)
        self._raw_undo: dict[QueueKey, int] = {}
        # The end of the last *completed* append. Readers and the dispatcher never look
        # past it, so a batch rolled back (disk full) was never visible to anyone.
        self._end = 0

    # ----------------------------------------------------------------- opening
    @classmethod
    def open(cls, directory: Path | str, config: CommitLogConfig, *, clean: bool,
             checkpoint_offset: int | None) -> CommitLog:  # fmt: skip
        """Open (creating if needed) the log in ``directory``.

        After an unclean shutdown (``clean=False``) the log is validated from the start
        of the segment holding ``checkpoint_offset`` (from the first segment when there
        is no checkpoint) and a torn or corrupt tail is durably truncated.
        """
        self = cls(Path(directory), config)
        self.directory.mkdir(parents=True, exist_ok=True)
        bases = sorted(b for n in os.listdir(self.directory) if (b := parse_segment_name(n)) is not None)
        segments = [Segment(self.directory, b, config.boundary_interval_bytes) for b in bases]
        if not segments:
            segments = [Segment(self.directory, 0, config.boundary_interval_bytes, create=True)]
            fsync_dir(self.directory)
        self._set_segments(segments)
        if clean:
            self._open_clean()
        else:
            self._recover(checkpoint_offset)
        self._end = self._segments[-1].end
        self._durable.publish(self._end)
        return self

    def _set_segments(self, segments: Sequence[Segment]) -> None:
        # Readers look these two up without the lock: replace both in one assignment.
        self._segments, self._bases = tuple(segments), tuple(s.base for s in segments)

    def _open_clean(self) -> None:
        for seg in self._segments[:-1]:
            seg.sealed = True
        for seg in self._segments:
            if not seg.boundaries.load():
                seg.boundaries.rewrite(self._scan(seg, verify=False).starts)

    def _recover(self, checkpoint_offset: int | None) -> None:
        segments = list(self._segments)
        first = 0
        if checkpoint_offset is not None:
            first = max(0, bisect_right(self._bases, checkpoint_offset) - 1)
        for seg in segments[:first]:
            seg.sealed = True
            if not seg.boundaries.load():
                seg.boundaries.rewrite(self._scan(seg, verify=False).starts)
        for i in range(first, len(segments)):
            seg = segments[i]
            result = self._scan(seg, verify=True)
            seg.boundaries.rewrite(result.starts)
            expected_next = seg.base + (seg.size if result.sealed else result.end)
            nxt = segments[i + 1] if i + 1 < len(segments) else None
            if result.problem is None and result.sealed and (nxt is None or nxt.base == expected_next):
                seg.sealed = True
                continue
            if result.problem is None and not result.sealed and nxt is None:
                break  # the active segment, intact to its end
            reason = result.problem or (
                "segment not sealed but followed by another" if not result.sealed
                else f"next segment starts at {nxt.base if nxt else '-'}, expected {expected_next}"
            )  # fmt: skip
            self._truncate_tail(segments, i, result, reason)
            break
        if self._segments[-1].sealed:
            self._roll_locked()

    def _truncate_tail(self, segments: list[Segment], i: int, result: ScanResult, reason: str) -> None:
        seg = segments[i]
        dropped = seg.size - result.end + sum(s.size for s in segments[i + 1 :])
        log.warning(
            "commitlog recovery: truncated %s at offset %d (file position %d): %s; dropped %d bytes",
            seg.path, seg.base + result.end, result.end, reason, dropped,
        )  # fmt: skip
        for later in segments[i + 1 :]:
            later.close()
            later.delete()
        seg.truncate(result.end)
        seg.sealed = False
        self._set_segments(segments[: i + 1])
        fsync_dir(self.directory)

    # ------------------------------------------------------------- validation
    def _scan(self, seg: Segment, verify: bool) -> ScanResult:
        """Walk a segment's records from its start (with CRC checks when ``verify``)."""
        chunk = max(8 << 20, self.config.max_message_bytes + HEADER_SIZE)
        starts: list[int] = []
        pos, length = 0, seg.size
        while pos < length:
            data = seg.read(pos, min(chunk, length - pos))
            walk = walk_records(data, 0, self.config.max_message_bytes)
            rel = walk.starts
            bad = self._first_invalid(seg, data, pos, walk) if verify else None
            if bad is not None:
                starts.extend((rel[rel < bad[0] - pos] + pos).tolist())
                return ScanResult(bad[0], starts, False, bad[1])
            starts.extend((rel + pos).tolist())
            end = pos + walk.stop
            if walk.reason == "blank":
                remaining = _SIZE_MAGIC.unpack_from(data, walk.stop)[0]
                if remaining != length - end:
                    return ScanResult(end, starts, False, f"blank marker claims {remaining} bytes, {length - end} remain")
                return ScanResult(length, starts, True, None)
            if walk.reason == "corrupt":
                return ScanResult(end, starts, False, self._describe(seg, data, walk.stop, end))
            if walk.stop == 0:  # not even one whole record: torn at the end of the file
                size = _U32.unpack_from(data, 0)[0] if len(data) >= 4 else 0
                return ScanResult(pos, starts, False, f"torn record: {size} bytes at position {pos}, file ends at {length}")
            pos = end
        return ScanResult(pos, starts, False, None)

    def _first_invalid(self, seg: Segment, data: bytes, pos: int, walk: Walk) -> tuple[int, str] | None:
        """The first walked record that fails its checks, vectorised but for the CRC itself."""
        if not walk.runs:
            return None
        buf = np.frombuffer(data, dtype=np.uint8)
        rel = walk.starts
        h = gather_fields(buf, walk, _CHECKED)
        lengths = sum(h[f].astype(np.int64) for f in ("topic_len", "tags_len", "keys_len", "props_len", "body_len"))
        ok = (lengths + HEADER_SIZE == h["total_size"]) & (h["commitlog_offset"] == rel + (seg.base + pos))
        limit = int(np.argmin(ok)) if not ok.all() else len(rel)
        view, crc, crcs = memoryview(data), _crc32c.crc32c, h["crc"].tolist()
        for i, (start, size) in enumerate(zip(rel[:limit].tolist(), h["total_size"][:limit].tolist())):
            if crc(view[start + CRC_START : start + size]) != crcs[i]:
                limit = i
                break
        if limit == len(rel):
            return None
        at = int(rel[limit])
        return pos + at, self._describe(seg, data, at, pos + at)

    def _describe(self, seg: Segment, data: bytes, at: int, file_pos: int) -> str:
        """The precise error for the bad record at ``data[at:]``."""
        try:
            check_record(data, at, str(seg.path), seg.base + file_pos)
            found = _U64_AT(data, at + OFF_COMMITLOG_OFFSET)
            return str(
                CorruptRecordError(str(seg.path), seg.base + file_pos, "commitlog offset", str(seg.base + file_pos), str(found))
            )
        except CorruptRecordError as e:
            return str(e)

    # --------------------------------------------------------------- appending
    @property
    def write_offset(self) -> int:
        """The end of the last completed append."""
        return self._end

    @property
    def min_offset(self) -> int:
        return self._segments[0].base

    @property
    def durable_offset(self) -> int:
        return self._durable.value

    @property
    def durability(self) -> DurableOffset:
        """The durable offset and its waiters (shared with the store built on this log)."""
        return self._durable

    @property
    def confirmed_offset(self) -> int:
        end = self.write_offset
        return end if self._confirmed is None else min(self._confirmed, end)

    def set_confirmed_offset(self, offset: int | None) -> None:
        """Limit what is dispatched to consumers (replication); None follows the write end."""
        self._confirmed = offset
        self._notify_append()

    def add_append_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (from the appending thread, outside the lock) after every append."""
        self._append_listeners.append(fn)

    def _notify_append(self) -> None:
        for fn in self._append_listeners:
            fn()

    def queue_offset_table(self) -> dict[QueueKey, int]:
        with self._lock:
            return dict(self._queue_offsets)

    def set_queue_offset_table(self, table: dict[QueueKey, int]) -> None:
        """Install the next offset per queue (recomputed from the consume queues)."""
        with self._lock:
            self._queue_offsets = dict(table)

    def append(self, messages: Sequence[Message]) -> AppendResult:
        """Append messages as one batch, in order; one system call per segment touched.

        Nothing is written unless every message can be: a message over
        ``max_message_bytes`` or a full disk fails the whole batch.
        """
        return self._append(lambda base, pos, undo, ts: self._encoder.encode(messages, base, pos, self._queue_offsets, undo, ts))

    def append_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int]) -> AppendResult:
        """Append packed messages (as producers send them) as one batch, in order.

        Each batch's queue ids must be below its entry in ``queue_counts``. All or
        nothing, as :meth:`append`; malformed bytes give MALFORMED_BATCH and a queue id
        out of range INVALID_QUEUE_ID. ``batch_sizes`` of the result counts the
        messages of each batch.
        """
        return self._append(lambda base, pos, undo, ts: self._encoder.encode_packed(
            batches, queue_counts, base, pos, self._queue_offsets, undo, ts))  # fmt: skip

    def _append(self, encode: Callable[[int, int, dict[QueueKey, int], int], EncodedBatch]) -> AppendResult:
        with self._lock:
            result = self._append_locked(encode)
        if result.ok:
            self._after_write(result.end_offset)
        return result

    def _append_locked(self, encode: Callable[[int, int, dict[QueueKey, int], int], EncodedBatch]) -> AppendResult:
        store_ts = now_ms()
        orig = self._segments[-1]
        orig_size = orig.size
        undo: dict[QueueKey, int] = {}
        try:
            batch = encode(orig.base, orig.size, undo, store_ts)
        except (EncodeError, UnicodeError, ValueError) as e:
            restore_offsets(self._queue_offsets, undo)
            kind = e.kind if isinstance(e, EncodeError) else "invalid"
            return AppendResult(_ENCODE_STATUS[kind], str(e))
        try:
            for group in batch.groups:
                self._write_group(group)
        except OSError as e:
            self._rollback(orig, orig_size, undo)
            status = AppendStatus.DISK_FULL if e.errno in (28, 122) else AppendStatus.IO_ERROR
            return AppendResult(status, f"{e.strerror} while appending to {self.directory}: nothing written")
        self._end = self._segments[-1].end
        return AppendResult(AppendStatus.OK, "", batch.commitlog_offsets[0] if batch.commitlog_offsets else self._end,
                            self._end, store_ts, batch.queue_offsets, batch.commitlog_offsets, batch.batch_sizes)  # fmt: skip

    def _write_group(self, group: Group) -> None:
        seg = self._segments[-1]
        seg.write(group.start, group.data)
        seg.size = group.start + len(group.data)
        self._dirty.add(seg)
        seg.boundaries.append_to_file(seg.boundaries.note(group.starts))
        if group.sealed:
            self._roll_locked()

    def _rollback(self, orig: Segment, orig_size: int, undo: dict[QueueKey, int]) -> None:
        """Undo a partly written batch so that a failed append leaves no trace."""
        restore_offsets(self._queue_offsets, undo)
        keep = [s for s in self._segments if s.base <= orig.base]
        for seg in self._segments[len(keep) :]:
            seg.close()
            seg.delete()
        self._dirty.difference_update(self._segments[len(keep) :])
        self._set_segments(keep)
        try:
            os.ftruncate(orig.fd, orig_size)
        except OSError:
            log.exception("commitlog: could not cut %s back to %d after a failed append", orig.path, orig_size)
        orig.size, orig.sealed = orig_size, False
        orig.boundaries.truncate(orig_size)

    def _roll_locked(self) -> None:
        """Seal the active segment (it ends in a blank marker) and start the next."""
        old = self._segments[-1]
        new = Segment(self.directory, old.base + self.config.segment_bytes, self.config.boundary_interval_bytes, create=True)
        old.seal(self.config.segment_bytes)
        self._set_segments((*self._segments, new))
        self._dir_dirty = True

    def append_raw(self, offset: int, data: bytes) -> AppendResult:
        """Append already-formatted bytes at ``offset`` (a follower copying its leader).

        ``offset`` must equal the write offset and ``data`` must be whole records and
        blank markers whose embedded offsets match where they land; every record's CRC
        is checked before anything is written. Queue offsets are taken from the records.
        """
        with self._lock:
            if offset != self._end:
                return AppendResult(AppendStatus.OFFSET_MISMATCH, f"raw append at {offset}, log ends at {self._end}")
            self._raw_undo = {}
            try:
                pieces = self._split_raw(offset, data)
            except CorruptRecordError as e:
                restore_offsets(self._queue_offsets, self._raw_undo)
                return AppendResult(AppendStatus.INVALID_MESSAGE, str(e))
            orig = self._segments[-1]
            orig_size, undo = orig.size, self._raw_undo
            try:
                for piece, starts, sealed in pieces:
                    seg = self._segments[-1]
                    seg.write(seg.size, piece)
                    seg.size += len(piece)
                    self._dirty.add(seg)
                    seg.boundaries.append_to_file(seg.boundaries.note(starts))
                    if sealed:
                        self._roll_locked()
            except OSError as e:
                self._rollback(orig, orig_size, undo)
                return AppendResult(AppendStatus.DISK_FULL if e.errno == 28 else AppendStatus.IO_ERROR, str(e))
            self._end = self._segments[-1].end
            result = AppendResult(AppendStatus.OK, start_offset=offset, end_offset=self._end)
        self._after_write(result.end_offset)
        return result

    def _split_raw(self, offset: int, data: bytes) -> list[tuple[bytes, list[int], bool]]:
        """Validate raw bytes and cut them at blank markers (each ends a segment)."""
        pieces: list[tuple[bytes, list[int], bool]] = []
        seg = self._segments[-1]
        base, pos, p, piece_start = seg.base, seg.size, 0, 0
        starts: list[int] = []
        where = f"raw append at {offset}"
        while p < len(data):
            if len(data) - p < BLANK_SIZE:
                raise CorruptRecordError(where, offset + p, "record", "whole records", f"{len(data) - p} stray bytes")
            size, magic = _SIZE_MAGIC.unpack_from(data, p)
            if magic == BLANK_MAGIC:
                if size != self.config.segment_bytes - pos:
                    raise CorruptRecordError(where, offset + p, "blank size", str(self.config.segment_bytes - pos), str(size))
                pieces.append((data[piece_start : p + BLANK_SIZE], starts, True))
                p += BLANK_SIZE
                base, pos, piece_start, starts = base + self.config.segment_bytes, 0, p, []
                continue
            check_record(data, p, where, offset + p)
            if _U64_AT(data, p + OFF_COMMITLOG_OFFSET) != base + pos:
                raise CorruptRecordError(
                    where, offset + p, "commitlog offset", str(base + pos), str(_U64_AT(data, p + OFF_COMMITLOG_OFFSET))
                )
            if pos + size + BLANK_SIZE > self.config.segment_bytes:
                raise CorruptRecordError(
                    where, offset + p, "segment room", f"<= {self.config.segment_bytes - pos - BLANK_SIZE}", str(size)
                )
            key = (_topic_at(data, p), _U32.unpack_from(data, p + OFF_QUEUE_ID)[0])
            old = self._queue_offsets.get(key, 0)
            self._raw_undo.setdefault(key, old if key in self._queue_offsets else -1)
            self._queue_offsets[key] = max(old, _U64_AT(data, p + OFF_QUEUE_OFFSET) + 1)
            starts.append(pos)
            p, pos = p + size, pos + size
        if piece_start < len(data):
            pieces.append((data[piece_start:], starts, False))
        return pieces

    def _after_write(self, end: int) -> None:
        # Sync flush: start the group commit now, while the writer is still on its way
        # to wait for it (a broker's reply path hops threads before it registers).
        if self.config.flush_mode is FlushMode.SYNC or end - self._durable.value >= self.config.flush_dirty_bytes:
            self._durable.flush_requested.set()
        self._notify_append()

    def truncate(self, offset: int) -> None:
        """Durably cut the log to ``offset`` (a record boundary), e.g. for a follower.

        The caller recomputes queue offsets afterwards (the store does).
        """
        with self._lock:
            if offset >= self._end:
                return
            i = max(0, bisect_right(self._bases, offset) - 1)
            segments = list(self._segments)
            for later in segments[i + 1 :]:
                later.delete()
                self._graveyard.append(later)
                self._dirty.discard(later)
            seg = segments[i]
            seg.truncate(offset - seg.base)
            seg.sealed = False
            self._set_segments(segments[: i + 1])
            fsync_dir(self.directory)
            self._end = offset
            self._durable.lower(offset)
            if self._confirmed is not None:
                self._confirmed = min(self._confirmed, offset)

    # ------------------------------------------------------------------ reading
    def _segment_for(self, offset: int) -> Segment | None:
        segments, bases = self._segments, self._bases
        i = bisect_right(bases, offset) - 1
        if i < 0 or i >= len(segments):
            return None
        return segments[i]

    def segment_path(self, offset: int) -> str:
        """The file holding ``offset`` (for error messages)."""
        seg = self._segment_for(offset)
        return str(seg.path) if seg is not None else f"{self.directory}/<offset {offset}>"

    def file_span(self, offset: int, size: int) -> tuple[Path, int] | None:
        """``(segment path, file position)`` of ``[offset, offset + size)`` if those bytes
        are written and lie in one segment (for zero-copy sends), else None."""
        seg = self._segment_for(offset)
        if seg is None or offset + size > min(seg.end, self._end) or offset < self.min_offset:
            return None
        return seg.path, offset - seg.base

    def segments(self) -> list[tuple[int, int, Path]]:
        """``(base, length, path)`` of every segment, oldest first."""
        return [(s.base, s.size, s.path) for s in self._segments]

    def boundaries(self, base: int) -> list[int]:
        """Log offsets of record starts spaced about ``boundary_interval_bytes`` apart."""
        seg = self._segment_for(base)
        if seg is None or seg.base != base:
            return []
        return [base + p for p in seg.boundaries.positions]

    def read_bytes(self, offset: int, size: int) -> bytes | None:
        """Raw bytes of ``[offset, offset + size)`` if they lie in one segment, else None."""
        seg = self._segment_for(offset)
        if seg is None or offset + size > min(seg.end, self._end) or offset < self.min_offset:
            return None
        try:
            data = seg.read(offset - seg.base, size)
        except OSError:
            return None
        return data if len(data) == size else None

    def read_record(self, offset: int, size: int | None = None) -> Record | None:
        """The record at ``offset``, CRC-checked; None if the offset fell out of the log.

        Raises :class:`CorruptRecordError` when the bytes there are not a valid record.
        """
        seg = self._segment_for(offset)
        if seg is None or offset >= self.write_offset or offset < self.min_offset:
            return None
        if size is None:
            head = self.read_bytes(offset, 4)
            if head is None:
                return None
            size = _U32.unpack(head)[0]
            if size > self.config.max_message_bytes or size > seg.end - offset:
                raise CorruptRecordError(
                    str(seg.path), offset, "total size", f"<= {min(self.config.max_message_bytes, seg.end - offset)}", str(size)
                )
        data = self.read_bytes(offset, size)
        if data is None:
            raise CorruptRecordError(str(seg.path), offset, "record extent", f"{size} bytes", "past the segment end")
        rec = decode_record(data, 0, str(seg.path), offset)
        if rec.commitlog_offset != offset:
            raise CorruptRecordError(str(seg.path), offset, "commitlog offset", str(offset), str(rec.commitlog_offset))
        return rec

    def read_chunk(self, offset: int, max_bytes: int, limit: int | None = None) -> tuple[int, bytes]:
        """Up to ``max_bytes`` raw bytes from ``offset`` within one segment, not past ``limit``.

        Returns ``(offset, data)``; if ``offset`` is at a segment's blank marker the
        caller sees the marker and moves to the next segment's base itself.
        """
        limit = self.write_offset if limit is None else limit
        seg = self._segment_for(offset)
        if seg is None or offset >= limit:
            return offset, b""
        n = min(max_bytes, seg.end - offset, limit - offset)
        return offset, seg.read(offset - seg.base, n) if n > 0 else b""

    def map_chunk(self, offset: int, max_bytes: int, limit: int | None = None) -> tuple[int, memoryview]:
        """Like :meth:`read_chunk`, but a read-only memory map instead of a copy.

        For readers that look at a fraction of each record (headers): only the pages
        touched are faulted in and nothing is copied. The view keeps the map alive.
        """
        limit = self._end if limit is None else limit
        seg = self._segment_for(offset)
        if seg is None or offset >= limit:
            return offset, memoryview(b"")
        n = min(max_bytes, seg.end - offset, limit - offset)
        pos = offset - seg.base
        aligned = pos - pos % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(seg.fd, pos + n - aligned, mmap.MAP_SHARED, mmap.PROT_READ, offset=aligned)
        except (OSError, ValueError):  # the segment went away under us (retention)
            return offset, memoryview(b"")
        return offset, memoryview(mapped)[pos - aligned : pos - aligned + n]

    def next_segment_base(self, offset: int) -> int:
        """The base of the segment after the one holding ``offset``."""
        seg = self._segment_for(offset)
        return seg.end if seg is not None else offset

    def iter_records(self, start: int | None = None, end: int | None = None) -> Iterator[Record]:
        """Every record in ``[start, end)``, CRC-checked, in log order."""
        pos = self.min_offset if start is None else max(start, self.min_offset)
        end = self.confirmed_offset if end is None else end
        chunk = max(1 << 20, self.config.max_message_bytes + HEADER_SIZE)
        while pos < end:
            at, data = self.read_chunk(pos, chunk, end)
            if not data:
                return
            seg = self._segment_for(at)
            where = str(seg.path) if seg else "?"
            p = 0
            while len(data) - p >= BLANK_SIZE:
                size, magic = _SIZE_MAGIC.unpack_from(data, p)
                if magic == BLANK_MAGIC:
                    p = -1
                    break
                if magic == RECORD_MAGIC and size > len(data) - p and at + p + size <= end:
                    break
                yield decode_record(data, p, where, at + p)
                p += size
            if p == -1:
                pos = self.next_segment_base(at)
            elif p == 0:
                raise CorruptRecordError(where, at, "record", "a whole record", f"{len(data)} bytes")
            else:
                pos = at + p

    # ----------------------------------------------------------------- flushing
    def flush(self) -> int:
        """fsync everything written so far; returns (and publishes) the durable offset."""
        with self._lock:
            target = self._end
            dirty, self._dirty = self._dirty, set()
            dir_dirty, self._dir_dirty = self._dir_dirty, False
        for seg in sorted(dirty, key=lambda s: s.base):
            if seg.fd >= 0:
                seg.sync()
        if dir_dirty:
            fsync_dir(self.directory)
        self._durable.publish(target)
        return target

    def wait_durable(self, offset: int, timeout_s: float) -> bool:
        """Block until ``offset`` is durable (group commit); False on timeout."""
        return self._durable.wait(offset, timeout_s)

    def on_durable(self, offset: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the flushing thread) once ``offset`` is durable."""
        self._durable.on_durable(offset, callback)

    def wake_flusher(self) -> None:
        """Make the flush loop run now (for example to notice that it should stop)."""
        self._durable.flush_requested.set()

    def run_flusher(self, stop: threading.Event) -> None:
        """The flush loop: group commit in sync mode, interval/dirty bytes in async mode.

        Run it in a thread; it returns after ``stop`` is set (with a final flush).
        """
        self._durable.run_flusher(self.flush, lambda: self._end > self._durable.value or self._dir_dirty, stop,
                                  self.config.flush_interval_ms / 1000)  # fmt: skip

    # ---------------------------------------------------------------- retention
    def delete_expired(self, now: float | None = None) -> int:
        """Delete whole segments past ``retention_ms`` or ``retention_bytes``; never the active one.

        Returns the number of segments deleted; the log's minimum offset advances.
        """
        now = time.time() if now is None else now
        with self._lock:
            for seg in self._graveyard:  # deleted a pass ago: no reader can still hold them
                seg.close()
            self._graveyard = []
            segments = list(self._segments)
            total = sum(s.size for s in segments)
            doomed = 0
            for seg in segments[:-1]:
                too_old = (
                    self.config.retention_ms is not None and (now - os.fstat(seg.fd).st_mtime) * 1000 > self.config.retention_ms
                )
                too_big = self.config.retention_bytes is not None and total > self.config.retention_bytes
                if not (too_old or too_big):
                    break
                total -= seg.size
                doomed += 1
            for seg in segments[:doomed]:
                log.info("commitlog retention: deleting %s", seg.path)
                seg.delete()
                self._graveyard.append(seg)
                self._dirty.discard(seg)
            if doomed:
                self._set_segments(segments[doomed:])
                self._dir_dirty = True
            return doomed

    def close(self) -> None:
        """Flush and close every file."""
        self.flush()
        with self._lock:
            for seg in (*self._segments, *self._graveyard):
                seg.close()

    def abandon(self) -> None:
        """Close descriptors without flushing: what a crash leaves behind (tests, fencing)."""
        with self._lock:
            for seg in (*self._segments, *self._graveyard):
                seg.close()


def _U64_AT(data: bytes | memoryview, pos: int) -> int:
    return int.from_bytes(data[pos : pos + 8], "little")


def _topic_at(data: bytes | memoryview, pos: int) -> str:
    tlen = int.from_bytes(data[pos + OFF_TOPIC_LEN : pos + OFF_TOPIC_LEN + 2], "little")
    return bytes(data[pos + HEADER_SIZE : pos + HEADER_SIZE + tlen]).decode()
