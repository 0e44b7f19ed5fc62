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
  (size 0, tag :data:`~._entries.HOLE_TAG`), never left as zeros. So an all-zero entry inside the
  extent is never legitimate: it is damage (a lost page, a zeroed file), and
  :meth:`ConsumeQueue.read_entries` raises :class:`CorruptRecordError` instead of
  skipping it. Readers skip hole markers, and a queue's minimum (:meth:`ConsumeQueue.bounds`)
  is never one. Within a queue, commit-log offsets increase with queue offsets.
- A queue that begins inside its first file (its first record came after retention)
  marks that in the file's slot 0 (size 0, tag :data:`~._entries.START_TAG`, offset: the first
  queue offset), so that the never-written entries before it are not taken for
  zeroed ones when the queue is loaded again.
- A read never returns entries past the files' extent as zeros: a file that reads
  short or is missing inside the extent is damage too (:class:`CorruptRecordError`).

:class:`ConsumeQueue` holds the in-memory tail and the lock; its file set is a
:class:`~._queue_files.QueueFiles`, its searches are :mod:`._lookups`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from ._entries import ENTRY, ENTRY_SIZE, HOLE_ENTRY, Entry
from ._files import FileCache
from ._lookups import entry_at, real_entry_at_or_after, search
from ._queue_files import QueueFiles

log = logging.getLogger("clmq.consumequeue")


class ConsumeQueue:
    """Entries of one queue; loaded lazily on first use. Thread-safe."""

    def __init__(
        self,
        directory: Path | tuple[Path, str],
        topic: str,
        queue_id: int,
        entries_per_file: int,
        files: FileCache,
        no_files: bool = False,
        on_change: Callable[[ConsumeQueue], None] | None = None,
    ) -> None:
        """``no_files``: the caller knows the queue has no files yet (nothing to load).
        ``on_change``: called (under the queue's lock) whenever :meth:`disk_extent` may
        have changed or the queue became loaded, so that a checkpoint can visit only
        the queues that changed."""
        self.topic = topic
        self.queue_id = queue_id
        self.per_file = entries_per_file
        self._files = QueueFiles(directory, f"{topic}/{queue_id}", entries_per_file, files)
        self._lock = threading.RLock()
        self._loaded = no_files
        self._pending = bytearray()
        # The first offset the checkpoint promised (set by recovery before a lazy load):
        # tells a sparse head (entries never written) from a zeroed one (damage).
        self.expected_first: int | None = None
        # The first entry, remembered: a consumer of 10,000 queues asks every queue's
        # minimum at start, and reading each from its file costs an open() apiece.
        self._head: tuple[int, Entry] | None = None
        self._on_change = on_change
        if no_files:
            self._changed()

    @property
    def directory(self) -> Path:
        """The queue's folder (its files are named by their first offset)."""
        return self._files.directory

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

    # ---------------------------------------------------------------- loading
    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self._files.load(self.expected_first)
            self._loaded = True
            self._changed()

    @property
    def loaded(self) -> bool:
        return self._loaded

    @property
    def damage(self) -> str | None:
        """What loading or a read found wrong in the files, if anything."""
        return self._files.damage

    def looks_intact(self, first: int, nxt: int) -> bool:
        """Without loading: do the files that must hold offsets ``first .. nxt-1`` all
        exist, every one but the last full and the last holding at least its share?"""
        return self._files.looks_intact(first, nxt)

    # ------------------------------------------------------------------ state
    @property
    def next_offset(self) -> int:
        """One past the last entry: the next queue offset this queue will get."""
        with self._lock:
            self._ensure_loaded()
            return self._files.flushed_next + len(self._pending) // ENTRY_SIZE

    @property
    def first_offset(self) -> int:
        """The lowest queue offset still held (possibly a hole)."""
        with self._lock:
            self._ensure_loaded()
            return self._files.first

    def append(self, first: int, data: bytes | bytearray) -> int:
        """Add entries for offsets ``first, first+1, ...``; returns how many were new.

        Entries already present are skipped (re-dispatch is idempotent). A jump past
        the end leaves a hole, logged, because it means records were never seen.
        """
        with self._lock:
            if not self._loaded:
                self._ensure_loaded()
            files = self._files
            nxt = files.flushed_next + len(self._pending) // ENTRY_SIZE
            if first == nxt:  # the steady state
                if first == files.first and data:  # the queue's first entry: remember it while it is at hand
                    self._head = (first, ENTRY.unpack_from(data))
                self._pending += data
                return len(data) // ENTRY_SIZE
            if first < nxt:
                skip = (nxt - first) * ENTRY_SIZE
                if skip >= len(data):
                    return 0
                data, first = data[skip:], nxt
            if first > nxt:
                if not files.starts and not self._pending:  # an empty queue starts where its first record is
                    files.first = files.flushed_next = first
                    self._changed()
                else:  # explicit markers: zeros would be indistinguishable from a lost page
                    log.warning(
                        "consume queue %s/%d: hole at offsets %d..%d", self.topic, self.queue_id, nxt, first - 1
                    )
                    self._pending += HOLE_ENTRY * (first - nxt)
            self._pending += data
            return len(data) // ENTRY_SIZE

    def start_at(self, offset: int) -> bool:
        """Continue this queue at ``offset``, durably (a replica that never had the
        queue's last records, which retention removed from its leader's log, numbers the
        queue on where its leader does). An empty queue begins there (a file with a
        start marker); one whose entries end below ``offset`` gets hole markers up to
        it, written and fsynced. A queue already at or past ``offset`` is left alone.
        Returns whether the queue changed. Callers must not dispatch to it meanwhile."""
        with self._lock:
            self._ensure_loaded()
            files = self._files
            nxt = files.flushed_next + len(self._pending) // ENTRY_SIZE
            if offset <= nxt:
                return False
            if not files.starts and not self._pending:
                files.begin_at(offset)
                self._changed()
                return True
            unsynced = files.flushed_next
            self.append(offset, b"")  # hole markers up to it
            self._flush_locked()
            files.sync(since=unsynced)
            return True

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
            return self._files.first, self._files.flushed_next

    def flush(self) -> None:
        """Write in-memory entries to their files (page cache; fsync is :meth:`sync`)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        try:
            self._files.write(memoryview(self._pending))
        except BaseException:
            # The error's traceback holds views of the buffer (here and in the write),
            # and a buffer with views cannot grow: go on with a copy (nothing is lost,
            # the entries are written again by the next flush).
            self._pending = bytearray(self._pending)
            raise
        if self._pending:
            self._pending = bytearray()
            self._changed()

    def sync(self) -> None:
        with self._lock:
            self._files.sync()

    # ---------------------------------------------------------------- reading
    def read_entries(self, offset: int, count: int) -> tuple[int, bytes]:
        """Raw entries from ``offset`` (raised to the first held), at most ``count``."""
        with self._lock:
            self._ensure_loaded()
            files = self._files
            offset = max(offset, files.first)
            end = min(offset + count, files.flushed_next + len(self._pending) // ENTRY_SIZE)
            out = bytearray()
            pos = files.read_into(out, offset, end)
            if pos < end:
                rel = (pos - files.flushed_next) * ENTRY_SIZE
                out += self._pending[rel : rel + (end - pos) * ENTRY_SIZE]
            return offset, bytes(out)

    def first_zeroed(self) -> int | None:
        """The first all-zero entry in the last two files (what a crash of the machine
        can leave: sizes written, pages not), or None. Reads those files whole."""
        with self._lock:
            self._ensure_loaded()
            return self._files.first_zeroed()

    def entry(self, offset: int) -> Entry | None:
        return entry_at(self.read_entries, offset)

    def search(self, predicate: Callable[[Entry], bool]) -> int:
        """The first offset whose entry satisfies ``predicate`` (monotone over the queue).

        Holes are looked past to the next real entry. Returns ``next_offset`` if none.
        """
        with self._lock:
            return search(self.read_entries, self.first_offset, self.next_offset, predicate)

    # ------------------------------------------------------ truncation, retention
    def truncate(self, offset: int) -> None:
        """Durably drop entries at or after ``offset``."""
        with self._lock:
            self._ensure_loaded()
            if self._head is not None and self._head[0] >= offset:
                self._head = None
            if offset >= self._files.flushed_next:
                keep = (offset - self._files.flushed_next) * ENTRY_SIZE
                del self._pending[keep:]
                return
            self._pending = bytearray()
            self._files.cut(offset)
            self._changed()

    def reset(self) -> None:
        """Drop every entry and file: the queue will be rebuilt from the log."""
        with self._lock:
            self._ensure_loaded()
            self._head = None
            self._files.reset()
            self._pending = bytearray()
            self._changed()

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
            while len(self._files.starts) > 1:
                last_entry = self.entry(self._files.starts[1] - 1)
                if last_entry is None or last_entry[0] >= log_min:
                    break
                self._files.drop_first_file()
                deleted += 1
                self._changed()
            return deleted

    def bounds(self, log_min: int) -> tuple[int, int]:
        """``(min_offset(log_min), next_offset)`` under one lock (every read asks both)."""
        with self._lock:
            self._ensure_loaded()
            first, nxt = self._files.first, self._files.flushed_next + len(self._pending) // ENTRY_SIZE
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
        found = self.search(lambda e: e[0] >= log_min)
        # The search may stop on hole markers before the first record in the log: records
        # retention removed before the dispatcher reached them (its confirmed offset lagged).
        # Their records are gone too, and a replica that dispatched them in time (or never
        # had them: a new follower) starts at the record after them: so does this queue.
        real = real_entry_at_or_after(self.read_entries, found, self.next_offset)
        return self.next_offset if real is None else real[0]

    def close(self) -> None:
        with self._lock:
            if self._loaded:
                self._flush_locked()
