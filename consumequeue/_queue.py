"""One (topic, queue)'s consume queue: fixed 20-byte entries pointing into the CommitLog.

Invariants:
- The entry for queue offset ``q`` is at byte ``(q - start) * 20`` of the file named by
  ``start = q - q % entries_per_file`` (20 digits), so a look-up is arithmetic.
- Files are contiguous from the first one kept; every file but the last holds exactly
  ``entries_per_file`` entries (the store checks this from sizes at every open).
- Entries ``[flushed_next, next_offset)`` live in memory (``_pending``) until the next
  :meth:`flush`; the files are derived data, rebuilt from the log after a crash, so
  dispatch never waits for them.
- A *hole* (an offset whose record the dispatcher never saw: it skipped a damaged
  region of the log, or retention overtook it) is written as an explicit hole marker
  (size 0, tag :data:`HOLE_TAG`), never left as zeros. So an all-zero entry inside the
  extent is never legitimate: it is damage (a lost page, a zeroed file), and
  :meth:`ConsumeQueue.read_entries` raises :class:`CorruptRecordError` instead of skipping it.
  Readers skip hole markers. Within a queue, commit-log offsets increase with queue
  offsets.
- A queue that begins inside its first file (its first record came after retention)
  marks that in the file's slot 0 (size 0, tag :data:`START_TAG`, offset: the first
  queue offset), so that the never-written entries before it are not taken for
  zeroed ones when the queue is loaded again.
- A read never returns entries past the files' extent as zeros: a file that reads
  short or is missing inside the extent is damage too (:class:`CorruptRecordError`).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from clmq.common import CorruptRecordError

from ._files import FileCache

log = logging.getLogger("clmq.consumequeue")

ENTRY = struct.Struct("<QIQ")  # commit-log offset, size, tag hash
ENTRY_SIZE = ENTRY.size
ENTRY_DTYPE = np.dtype([("offset", "<u8"), ("size", "<u4"), ("tag", "<u8")])
assert ENTRY_SIZE == 20 and ENTRY_DTYPE.itemsize == 20

Entry = tuple[int, int, int]

HOLE_TAG = 0x454C4F48_514D4C43  # b"CLMQHOLE": the tag of a hole marker (size 0)
HOLE_ENTRY = ENTRY.pack(0, 0, HOLE_TAG)
START_TAG = 0x54524154_534D4C43  # b"CLMSTART": slot 0 of a first file whose queue begins later
ZERO_ENTRY = bytes(ENTRY_SIZE)


def file_name(start: int) -> str:
    return f"{start:020d}"


class ConsumeQueue:
    """Entries of one queue; loaded lazily on first use. Thread-safe."""

    def __init__(
        self,
        directory: Path,
        topic: str,
        queue_id: int,
        entries_per_file: int,
        files: FileCache,
        no_files: bool = False,
    ) -> None:
        """``no_files``: the caller knows the queue has no files yet (nothing to load)."""
        self.directory = directory
        self.topic = topic
        self.queue_id = queue_id
        self.per_file = entries_per_file
        self._files = files
        self._lock = threading.RLock()
        self._loaded = no_files
        self._starts: list[int] = []
        self._first = 0
        self._flushed_next = 0
        self._pending = bytearray()
        self.damage: str | None = None  # what loading found wrong, if anything
        # The first offset the checkpoint promised (set by recovery before a lazy load):
        # tells a sparse head (entries never written) from a zeroed one (damage).
        self.expected_first: int | None = None
        # The first entry, remembered: a consumer of 10,000 queues asks every queue's
        # minimum at start, and reading each from its file costs an open() apiece.
        self._head: tuple[int, Entry] | None = None
        # File paths, made once: every read and write names its file, and building a
        # Path (and hashing it in the descriptor cache) cost more than the pread.
        self._paths: dict[int, Path] = {}

    # ---------------------------------------------------------------- loading
    def _path(self, start: int) -> Path:
        path = self._paths.get(start)
        if path is None:
            path = self._paths[start] = self.directory / file_name(start)
        return path

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self.damage = self._load()
            self._loaded = True

    def _load(self) -> str | None:
        """Read the file layout, cutting anything inconsistent; returns what was wrong."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return None
        starts = sorted(int(n) for n in names if len(n) == 20 and n.isdigit())
        problem = None
        keep: list[int] = []
        for start in starts:
            size = os.stat(self._path(start)).st_size
            if start % self.per_file or (keep and start != keep[-1] + self.per_file):
                problem = (
                    problem or f"file {file_name(start)} does not continue {file_name(keep[-1]) if keep else 'nothing'}"
                )
                break
            keep.append(start)
            if size != self.per_file * ENTRY_SIZE:
                if size % ENTRY_SIZE:
                    problem = f"{self._path(start)} holds {size} bytes, not a multiple of {ENTRY_SIZE}"
                    self._files.truncate(self._path(start), size - size % ENTRY_SIZE)
                break
        for start in starts[len(keep) :]:
            problem = problem or f"{self._path(start)} follows a short file"
            self._delete_file(start)
        self._starts = keep
        self._first = self._head_first(keep[0]) if keep else 0
        self._flushed_next = self._disk_next()
        return problem

    def _head_first(self, start: int) -> int:
        """The first offset held by the first file ``start``: ``start`` itself, unless
        the queue began inside it (its slot 0 then holds a start marker)."""
        raw = self._files.pread(self._path(start), ENTRY_SIZE, 0)
        if len(raw) < ENTRY_SIZE:
            return start
        offset, size, tag = ENTRY.unpack(raw)
        if size == 0 and tag == START_TAG and start < offset < start + self.per_file:
            return int(offset)
        if raw != ZERO_ENTRY:
            return start
        if self.expected_first is not None:  # zeros from there on are damage, found when read
            return max(start, min(self.expected_first, start + self.per_file - 1))
        # Written before start markers existed (or damaged, and nothing says otherwise):
        # the first entry that is not zero.
        data = self._files.pread(self._path(start), self.per_file * ENTRY_SIZE, 0)
        rows = np.frombuffer(data[: len(data) - len(data) % ENTRY_SIZE], ENTRY_DTYPE)
        real = np.flatnonzero((rows["size"] != 0) | (rows["offset"] != 0) | (rows["tag"] != 0))
        return start + (int(real[0]) if len(real) else len(rows))

    def _disk_next(self) -> int:
        if not self._starts:
            return self._first
        last = self._starts[-1]
        return last + os.stat(self._path(last)).st_size // ENTRY_SIZE

    def _delete_file(self, start: int) -> None:
        path = self._path(start)
        self._files.forget(path)
        path.unlink(missing_ok=True)
        del self._paths[start]

    @property
    def loaded(self) -> bool:
        return self._loaded

    def looks_intact(self, first: int, nxt: int) -> bool:
        """Without loading: do the files that must hold offsets ``first .. nxt-1`` all
        exist, every one but the last full and the last holding at least its share?
        (One stat per file, no reads: used at every open, for every checkpointed queue.)"""
        if nxt <= first:
            return True
        last = nxt - 1
        head, tail = first - first % self.per_file, last - last % self.per_file
        full = self.per_file * ENTRY_SIZE
        try:
            for start in range(head, tail, self.per_file):
                if os.stat(self._path(start)).st_size != full:
                    return False
            return os.stat(self._path(tail)).st_size >= (last - tail + 1) * ENTRY_SIZE
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------------ state
    @property
    def next_offset(self) -> int:
        """One past the last entry: the next queue offset this queue will get."""
        with self._lock:
            self._ensure_loaded()
            return self._flushed_next + len(self._pending) // ENTRY_SIZE

    @property
    def first_offset(self) -> int:
        """The lowest queue offset still held (possibly a hole)."""
        with self._lock:
            self._ensure_loaded()
            return self._first

    def append(self, first: int, data: bytes | bytearray) -> int:
        """Add entries for offsets ``first, first+1, ...``; returns how many were new.

        Entries already present are skipped (re-dispatch is idempotent). A jump past
        the end leaves a hole, logged, because it means records were never seen.
        """
        with self._lock:
            if not self._loaded:
                self._ensure_loaded()
            nxt = self._flushed_next + len(self._pending) // ENTRY_SIZE
            if first == nxt:  # the steady state
                if first == self._first and data:  # the queue's first entry: remember it while it is at hand
                    self._head = (first, ENTRY.unpack_from(data))
                self._pending += data
                return len(data) // ENTRY_SIZE
            if first < nxt:
                skip = (nxt - first) * ENTRY_SIZE
                if skip >= len(data):
                    return 0
                data, first = data[skip:], nxt
            if first > nxt:
                if not self._starts and not self._pending:  # an empty queue starts where its first record is
                    self._first = self._flushed_next = first
                else:  # explicit markers: zeros would be indistinguishable from a lost page
                    log.warning(
                        "consume queue %s/%d: hole at offsets %d..%d", self.topic, self.queue_id, nxt, first - 1
                    )
                    self._pending += HOLE_ENTRY * (first - nxt)
            self._pending += data
            return len(data) // ENTRY_SIZE

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def oldest_pending(self) -> int | None:
        """Commit-log offset of the first entry not yet in a file (None: all written or holes)."""
        with self._lock:
            for p in range(0, len(self._pending), ENTRY_SIZE):  # skip holes
                phys, size, _ = ENTRY.unpack_from(self._pending, p)
                if size:
                    return int(phys)  # struct gives Any
            return None

    def disk_extent(self) -> tuple[int, int]:
        """``(first, next)`` of the entries that are in the files."""
        with self._lock:
            self._ensure_loaded()
            return self._first, self._flushed_next

    def flush(self) -> None:
        """Write in-memory entries to their files (page cache; fsync is :meth:`sync`)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        pos, view = self._flushed_next, memoryview(self._pending)
        try:
            while view:
                start = pos - pos % self.per_file
                room = (start + self.per_file - pos) * ENTRY_SIZE
                piece = view[:room]
                if not self._starts and self._first > start:  # the queue begins inside its first file
                    self._files.pwrite(self._path(start), ENTRY.pack(self._first, 0, START_TAG), 0)
                self._files.pwrite(self._path(start), piece, (pos - start) * ENTRY_SIZE)
                if not self._starts or start > self._starts[-1]:
                    self._starts.append(start)
                pos += len(piece) // ENTRY_SIZE
                view = view[room:]
        except BaseException:
            # The error's traceback holds views of the buffer (here and in the write),
            # and a buffer with views cannot grow: go on with a copy (nothing is lost,
            # the entries are written again by the next flush).
            self._pending = bytearray(self._pending)
            raise
        self._flushed_next = pos
        self._pending = bytearray()

    def sync(self) -> None:
        with self._lock:
            for start in self._starts[-2:]:
                self._files.sync(self._path(start))

    # ---------------------------------------------------------------- reading
    def read_entries(self, offset: int, count: int) -> tuple[int, bytes]:
        """Raw entries from ``offset`` (raised to the first held), at most ``count``."""
        with self._lock:
            self._ensure_loaded()
            offset = max(offset, self._first)
            end = min(offset + count, self._flushed_next + len(self._pending) // ENTRY_SIZE)
            out = bytearray()
            pos = offset
            while pos < min(end, self._flushed_next):
                start = pos - pos % self.per_file
                n = min(end, self._flushed_next, start + self.per_file) - pos
                out += self._read_file(start, pos, n)
                pos += n
            if pos < end:
                rel = (pos - self._flushed_next) * ENTRY_SIZE
                out += self._pending[rel : rel + (end - pos) * ENTRY_SIZE]
            return offset, bytes(out)

    def _read_file(self, start: int, pos: int, n: int) -> bytes:
        """``n`` entries from ``pos`` out of the file ``start``: all there, none zeroed."""
        path, at = self._path(start), (pos - start) * ENTRY_SIZE
        try:
            chunk = self._files.pread(path, n * ENTRY_SIZE, at)
        except FileNotFoundError:
            raise self._damaged(path, at, "consume queue file", "present", "missing") from None
        if len(chunk) < n * ENTRY_SIZE:
            raise self._damaged(
                path, at + len(chunk), "consume queue file", f"{n * ENTRY_SIZE} bytes", f"{len(chunk)} bytes"
            )
        if ZERO_ENTRY in chunk:  # fast test (unaligned: may be a false alarm), exact one below
            sizes = np.frombuffer(chunk, ENTRY_DTYPE)
            zero = np.flatnonzero((sizes["size"] == 0) & (sizes["offset"] == 0) & (sizes["tag"] == 0))
            if len(zero):
                where = at + int(zero[0]) * ENTRY_SIZE
                raise self._damaged(path, where, "consume queue entry", "an entry or a hole marker", "20 zero bytes")
        return chunk

    def _damaged(self, path: Path, at: int, check: str, expected: str, actual: str) -> CorruptRecordError:
        """The error for damage met in a file (and remembered: the store rebuilds the queue)."""
        self.damage = f"{check} at {path}:{at}: expected {expected}, got {actual}"
        log.error("consume queue %s/%d: %s", self.topic, self.queue_id, self.damage)
        return CorruptRecordError(str(path), at, check, expected, actual)

    def first_zeroed(self) -> int | None:
        """The first all-zero entry in the last two files (what a crash of the machine
        can leave: sizes written, pages not), or None. Reads those files whole."""
        with self._lock:
            self._ensure_loaded()
            for start in self._starts[-2:]:
                skip = max(0, self._first - start)  # below the first entry: never written (sparse)
                size = os.stat(self._path(start)).st_size - skip * ENTRY_SIZE
                if size <= 0:
                    continue
                rows = np.frombuffer(self._files.pread(self._path(start), size, skip * ENTRY_SIZE), ENTRY_DTYPE)
                zero = np.flatnonzero((rows["size"] == 0) & (rows["offset"] == 0) & (rows["tag"] == 0))
                if len(zero):
                    return start + skip + int(zero[0])
            return None

    def entry(self, offset: int) -> Entry | None:
        at, data = self.read_entries(offset, 1)
        if at != offset or len(data) < ENTRY_SIZE:
            return None
        return ENTRY.unpack(data)

    def search(self, predicate: Callable[[Entry], bool]) -> int:
        """The first offset whose entry satisfies ``predicate`` (monotone over the queue).

        Holes are looked past to the next real entry. Returns ``next_offset`` if none.
        """
        with self._lock:
            lo, hi = self.first_offset, self.next_offset
            while lo < hi:
                mid = (lo + hi) // 2
                probe = self._real_entry_at_or_after(mid, hi)
                if probe is None or predicate(probe[1]):
                    hi = mid
                else:
                    lo = probe[0] + 1
            return lo

    def _real_entry_at_or_after(self, offset: int, hi: int) -> tuple[int, Entry] | None:
        while offset < hi:
            at, data = self.read_entries(offset, min(256, hi - offset))
            for i in range(len(data) // ENTRY_SIZE):
                entry = ENTRY.unpack_from(data, i * ENTRY_SIZE)
                if entry[1]:
                    return at + i, entry
            offset = at + max(1, len(data) // ENTRY_SIZE)
        return None

    # ------------------------------------------------------ truncation, retention
    def truncate(self, offset: int) -> None:
        """Durably drop entries at or after ``offset``."""
        with self._lock:
            self._ensure_loaded()
            if self._head is not None and self._head[0] >= offset:
                self._head = None
            if offset >= self._flushed_next:
                keep = (offset - self._flushed_next) * ENTRY_SIZE
                del self._pending[keep:]
                return
            self._pending = bytearray()
            offset = max(offset, self._first)
            cut_file = offset - offset % self.per_file
            for start in [s for s in self._starts if s > cut_file]:
                self._delete_file(start)
            self._starts = [s for s in self._starts if s <= cut_file]
            if self._starts and self._starts[-1] == cut_file:
                self._files.truncate(self._path(cut_file), (offset - cut_file) * ENTRY_SIZE)
            self._flushed_next = offset

    def reset(self) -> None:
        """Drop every entry and file: the queue will be rebuilt from the log."""
        with self._lock:
            self._ensure_loaded()
            self._head = None
            for start in self._starts:
                self._delete_file(start)
            self._starts, self._pending = [], bytearray()
            self._first = self._flushed_next = 0

    def truncate_past(self, log_end: int) -> int:
        """Drop entries pointing at or past ``log_end`` (the log was cut); returns new next."""
        cut = self.search(lambda e: e[0] + e[1] > log_end)
        if cut < self.next_offset:
            self.truncate(cut)
        return self.next_offset

    def delete_before(self, log_min: int) -> int:
        """Delete whole files whose entries all point below ``log_min``, never the last."""
        with self._lock:
            self._ensure_loaded()
            deleted = 0
            while len(self._starts) > 1:
                last_entry = self.entry(self._starts[1] - 1)
                if last_entry is None or last_entry[0] >= log_min:
                    break
                self._delete_file(self._starts.pop(0))
                self._first = self._starts[0]
                deleted += 1
            return deleted

    def bounds(self, log_min: int) -> tuple[int, int]:
        """``(min_offset(log_min), next_offset)`` under one lock (every read asks both)."""
        with self._lock:
            self._ensure_loaded()
            first, nxt = self._first, self._flushed_next + len(self._pending) // ENTRY_SIZE
            if first >= nxt:  # empty: nothing to look at
                return first, nxt
            return self._min_of_held(first, log_min), nxt

    def min_offset(self, log_min: int) -> int:
        """The first offset whose record is still in the log."""
        return self.bounds(log_min)[0]

    def _min_of_held(self, first: int, log_min: int) -> int:
        if self._head is not None and self._head[0] == first:
            head: Entry | None = self._head[1]
        else:
            head = self.entry(first)
            self._head = (first, head) if head is not None else None
        if head is not None and head[1] and head[0] >= log_min:
            return first  # the usual case, without a search: nothing fell out of retention
        return self.search(lambda e: e[0] >= log_min)

    def close(self) -> None:
        with self._lock:
            if self._loaded:
                self._flush_locked()
