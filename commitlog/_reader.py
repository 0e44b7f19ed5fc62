"""Reading the log: positional reads, maps and record iteration, all without the lock.

Invariants:
- Readers never take ``LogState.lock``. Each call loads ``LogState.snapshot`` once
  and works on that immutable :class:`SegmentSet` (see :mod:`clmq.commitlog._state` for why
  an old snapshot stays readable).
- Nothing at or past ``end`` (the last completed append) is returned, nor past
  ``confirmed_offset`` by :meth:`Reader.iter_records`; a caller's ``limit`` is
  trusted to be at or below ``end``.
- Reads stay inside one segment; crossing into the next segment is the caller's step
  (:meth:`Reader.next_segment_base`).
- Reads never invent or drop data: ``None`` (or an empty chunk) means the range is not
  in the log (below ``min_offset``, past ``end``) or not in one segment. A read inside
  the log that fails or comes back short (I/O error, a file shortened underneath)
  raises :class:`CorruptRecordError` (check ``read``) unless retention deleted the
  range meanwhile. A segment whose descriptor was closed maps to an empty view, never
  to anonymous zeros.
- Every read goes through :data:`clmq.commitlog.fileops.OPS` (``pread``).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Iterator

from clmq.common import BLANK_MAGIC, BLANK_SIZE, HEADER_SIZE, RECORD_MAGIC, CorruptRecordError, Record, decode_record

from ._scan import SIZE_MAGIC
from ._segment import Segment
from ._state import LogState

_U32 = struct.Struct("<I")


class Reader:
    """Lock-free reads of one log."""

    __slots__ = ("_state",)

    def __init__(self, state: LogState) -> None:
        self._state = state

    def segment_path(self, offset: int) -> str:
        """The file holding ``offset`` (for error messages)."""
        seg = self._state.snapshot.find(offset)
        return str(seg.path) if seg is not None else f"{self._state.directory}/<offset {offset}>"

    def file_span(self, offset: int, size: int) -> tuple[Path, int] | None:
        """``(segment path, file position)`` of written bytes lying in one segment."""
        st = self._state
        snapshot = st.snapshot
        seg = snapshot.find(offset)
        if seg is None or offset + size > min(seg.end, st.end) or offset < snapshot.segments[0].base:
            return None
        return seg.path, offset - seg.base

    def segments(self) -> list[tuple[int, int, Path]]:
        """``(base, length, path)`` of every segment, oldest first."""
        return [(s.base, s.size, s.path) for s in self._state.snapshot.segments]

    def boundaries(self, base: int) -> list[int]:
        """Log offsets of sparse record starts of the segment based at ``base``."""
        seg = self._state.snapshot.find(base)
        if seg is None or seg.base != base:
            return []
        return [base + p for p in seg.boundaries.positions]

    def next_segment_base(self, offset: int) -> int:
        """The base of the segment after the one holding ``offset``."""
        seg = self._state.snapshot.find(offset)
        return seg.end if seg is not None else offset

    def read_bytes(self, offset: int, size: int) -> bytes | None:
        """Raw bytes of ``[offset, offset + size)`` if they lie in one segment; None when
        they are outside the log (or not in one segment); CorruptRecordError when the
        read fails or comes back short."""
        # The same bounds as file_span, inlined: both are per-message paths of the store.
        st = self._state
        snapshot = st.snapshot
        seg = snapshot.find(offset)
        if seg is None or offset + size > min(seg.end, st.end) or offset < snapshot.segments[0].base:
            return None
        try:
            data = seg.read(offset - seg.base, size)
        except OSError as e:
            self._bad_read(seg, offset, size, f"{type(e).__name__}: {e}")
            return None
        if len(data) == size:
            return data
        self._bad_read(seg, offset, size, f"{len(data)} bytes")
        return None

    def _bad_read(self, seg: Segment, offset: int, size: int, actual: str) -> None:
        """A read inside the log that failed: returns (the caller answers "not in the
        log") if retention deleted the range meanwhile (the descriptor closed under a
        stalled reader), else raises CorruptRecordError."""
        if offset < self._state.snapshot.min_offset:
            return None
        raise CorruptRecordError(str(seg.path), offset, "read", f"{size} bytes", actual)

    def read_record(self, offset: int, size: int | None = None) -> Record | None:
        """The CRC-checked record at ``offset`` (see :meth:`CommitLog.read_record`)."""
        snapshot = self._state.snapshot
        seg = snapshot.find(offset)
        if seg is None or offset >= self._state.end or offset < snapshot.min_offset:
            return None
        if size is None:
            head = self.read_bytes(offset, 4)
            if head is None:
                return None
            size = _U32.unpack(head)[0]
            limit = min(self._state.config.max_message_bytes, seg.end - offset)
            if size > limit:
                raise CorruptRecordError(str(seg.path), offset, "total size", f"<= {limit}", str(size))
        data = self.read_bytes(offset, size)
        if data is None:
            raise CorruptRecordError(str(seg.path), offset, "record extent", f"{size} bytes", "past the segment end")
        rec = decode_record(data, 0, str(seg.path), offset)
        if rec.commitlog_offset != offset:
            raise CorruptRecordError(str(seg.path), offset, "commitlog offset", str(offset), str(rec.commitlog_offset))
        return rec

    def read_chunk(self, offset: int, max_bytes: int, limit: int | None = None) -> tuple[int, bytes]:
        """Up to ``max_bytes`` from ``offset`` within one segment, not past ``limit``."""
        limit = self._state.end if limit is None else limit
        seg = self._state.snapshot.find(offset)
        if seg is None or offset >= limit:
            return offset, b""
        n = min(max_bytes, seg.end - offset, limit - offset)
        if n <= 0:
            return offset, b""
        try:
            data = seg.read(offset - seg.base, n)
        except OSError as e:
            self._bad_read(seg, offset, n, f"{type(e).__name__}: {e}")
            return offset, b""
        if len(data) != n:
            self._bad_read(seg, offset, n, f"{len(data)} bytes")
            return offset, b""
        return offset, data

    def map_chunk(self, offset: int, max_bytes: int, limit: int | None = None) -> tuple[int, memoryview]:
        """Like :meth:`read_chunk`, but a read-only memory map instead of a copy.

        An empty view when the segment's descriptor was closed (retention deleted it
        a pass ago): never a map of anything else.
        """
        limit = self._state.end if limit is None else limit
        seg = self._state.snapshot.find(offset)
        if seg is None or offset >= limit:
            return offset, memoryview(b"")
        n = min(max_bytes, seg.end - offset, limit - offset)
        pos = offset - seg.base
        aligned = pos - pos % mmap.ALLOCATIONGRANULARITY
        fd = seg.fd  # read once: mmap(-1, ...) would map anonymous zeros
        if fd < 0 or n <= 0:
            return offset, memoryview(b"")
        try:
            mapped = mmap.mmap(fd, pos + n - aligned, mmap.MAP_SHARED, mmap.PROT_READ, offset=aligned)
        except (OSError, ValueError) as e:  # closed under us (retention), or the file is shorter
            self._bad_read(seg, offset, n, f"{type(e).__name__}: {e}")
            return offset, memoryview(b"")
        return offset, memoryview(mapped)[pos - aligned : pos - aligned + n]

    def iter_records(self, start: int | None = None, end: int | None = None) -> Iterator[Record]:
        """Every record in ``[start, end)``, CRC-checked, in log order."""
        st = self._state
        min_offset = st.snapshot.segments[0].base
        pos = min_offset if start is None else max(start, min_offset)
        end = st.confirmed_offset if end is None else end
        chunk = max(1 << 20, st.config.max_message_bytes + HEADER_SIZE)
        while pos < end:
            at, data = self.read_chunk(pos, chunk, end)
            if not data:
                return
            seg = st.snapshot.find(at)
            where = str(seg.path) if seg else "?"
            p = 0
            while len(data) - p >= BLANK_SIZE:
                size, magic = SIZE_MAGIC.unpack_from(data, p)
                if magic == BLANK_MAGIC:
                    p = -1  # the segment's end: go on at the next segment's base
                    break
                if magic == RECORD_MAGIC and size > len(data) - p and at + p + size <= end:
                    break  # cut by the chunk size: the next chunk starts at this record
                yield decode_record(data, p, where, at + p)
                p += size
            if p == -1:
                pos = self.next_segment_base(at)
            elif p == 0:
                raise CorruptRecordError(where, at, "record", "a whole record", f"{len(data)} bytes")
            else:
                pos = at + p
