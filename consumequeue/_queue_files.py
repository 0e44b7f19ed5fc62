"""One queue's entry files: their layout, loading, writing, reading and cutting.

The file named by ``start`` (20 digits, a multiple of ``entries_per_file``) holds the
entries of queue offsets ``start ..`` at byte ``(q - start) * 20``; files are contiguous
from the first one kept, and every file but the last is full. A read never returns
entries it cannot vouch for: a file missing or short inside the extent, or an all-zero
entry (a lost page), is damage (:class:`CorruptRecordError`), remembered in
:attr:`QueueFiles.damage` so that the store rebuilds the queue.

Not thread-safe on its own: the owning :class:`~._queue.ConsumeQueue` calls it under
its lock.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from clmq.commitlog import fsync_dir
from clmq.common import CorruptRecordError

from ._entries import ENTRY, ENTRY_DTYPE, ENTRY_SIZE, START_TAG, ZERO_ENTRY, file_name
from ._files import FileCache

log = logging.getLogger("clmq.consumequeue")


class QueueFiles:
    """The files of one queue and where its entries start and end in them."""

    def __init__(self, directory: Path | tuple[Path, str], name: str, entries_per_file: int, cache: FileCache) -> None:
        """``directory``: the queue's folder, or ``(its parent, its name)``, joined when first
        needed: a topic of 65,536 queues makes them all at once, and a Path join costs
        more than the rest of a queue's set-up."""
        self._directory = directory
        self.name = name  # "topic/queue id", for the log
        self.per_file = entries_per_file
        self._cache = cache
        self.starts: list[int] = []  # the files' first offsets, ascending
        self.first = 0  # the lowest queue offset held (possibly a hole)
        self.flushed_next = 0  # one past the last entry in the files
        self.damage: str | None = None  # what loading or a read found wrong, if anything
        # File paths, made once: every read and write names its file, and building a
        # Path (and hashing it in the descriptor cache) cost more than the pread.
        self._paths: dict[int, Path] = {}

    @property
    def directory(self) -> Path:
        d = self._directory
        if isinstance(d, tuple):
            d = self._directory = d[0] / d[1]
        return d

    def path(self, start: int) -> Path:
        path = self._paths.get(start)
        if path is None:
            path = self._paths[start] = self.directory / file_name(start)
        return path

    # ---------------------------------------------------------------- loading
    def load(self, expected_first: int | None) -> None:
        """Read the file layout, cutting anything inconsistent; :attr:`damage` says what
        was wrong. ``expected_first``: the first offset the checkpoint promised (or None)."""
        self.damage = self._load(expected_first)

    def _load(self, expected_first: int | None) -> str | None:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return None
        starts = sorted(int(n) for n in names if len(n) == 20 and n.isdigit())
        problem = None
        keep: list[int] = []
        for start in starts:
            size = os.stat(self.path(start)).st_size
            if start % self.per_file or (keep and start != keep[-1] + self.per_file):
                problem = (
                    problem or f"file {file_name(start)} does not continue {file_name(keep[-1]) if keep else 'nothing'}"
                )
                break
            keep.append(start)
            if size != self.per_file * ENTRY_SIZE:
                if size % ENTRY_SIZE:
                    problem = f"{self.path(start)} holds {size} bytes, not a multiple of {ENTRY_SIZE}"
                    self._cache.truncate(self.path(start), size - size % ENTRY_SIZE)
                break
        for start in starts[len(keep) :]:
            problem = problem or f"{self.path(start)} follows a short file"
            self.delete(start)
        self.starts = keep
        self.first = self._head_first(keep[0], expected_first) if keep else 0
        self.flushed_next = self._disk_next()
        return problem

    def _head_first(self, start: int, expected_first: int | None) -> int:
        """The first offset held by the first file ``start``: ``start`` itself, unless
        the queue began inside it (its slot 0 then holds a start marker)."""
        raw = self._cache.pread(self.path(start), ENTRY_SIZE, 0)
        if len(raw) < ENTRY_SIZE:
            return start
        offset, size, tag = ENTRY.unpack(raw)
        if size == 0 and tag == START_TAG and start < offset < start + self.per_file:
            return int(offset)
        if raw != ZERO_ENTRY:
            return start
        if expected_first is not None:  # zeros from there on are damage, found when read
            return max(start, min(expected_first, start + self.per_file - 1))
        # Written before start markers existed (or damaged, and nothing says otherwise):
        # the first entry that is not zero.
        data = self._cache.pread(self.path(start), self.per_file * ENTRY_SIZE, 0)
        rows = np.frombuffer(data[: len(data) - len(data) % ENTRY_SIZE], ENTRY_DTYPE)
        real = np.flatnonzero((rows["size"] != 0) | (rows["offset"] != 0) | (rows["tag"] != 0))
        return start + (int(real[0]) if len(real) else len(rows))

    def _disk_next(self) -> int:
        if not self.starts:
            return self.first
        last = self.starts[-1]
        return last + os.stat(self.path(last)).st_size // ENTRY_SIZE

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
                if os.stat(self.path(start)).st_size != full:
                    return False
            return os.stat(self.path(tail)).st_size >= (last - tail + 1) * ENTRY_SIZE
        except FileNotFoundError:
            return False

    # ---------------------------------------------------------------- writing
    def write(self, pending: memoryview) -> None:
        """Write the entries that follow ``flushed_next`` (page cache; fsync is
        :meth:`sync`); on an error the files may hold part of them, written again next time."""
        pos, view = self.flushed_next, pending
        while view:
            start = pos - pos % self.per_file
            room = (start + self.per_file - pos) * ENTRY_SIZE
            piece = view[:room]
            if not self.starts and self.first > start:  # the queue begins inside its first file
                self._cache.pwrite(self.path(start), ENTRY.pack(self.first, 0, START_TAG), 0)
            self._cache.pwrite(self.path(start), piece, (pos - start) * ENTRY_SIZE)
            if not self.starts or start > self.starts[-1]:
                self.starts.append(start)
            pos += len(piece) // ENTRY_SIZE
            view = view[room:]
        self.flushed_next = pos

    def sync(self, since: int | None = None) -> None:
        """fsync the last two files (what a flush since the last sync can touch), or
        every file holding offsets from ``since`` on, and then the folder."""
        if since is None:
            for start in self.starts[-2:]:
                self._cache.sync(self.path(start))
            return
        for start in self.starts:
            if start + self.per_file > since:
                self._cache.sync(self.path(start))
        fsync_dir(self.directory)

    def begin_at(self, offset: int) -> None:
        """Durably make a queue without files empty and continuing at ``offset``: its
        first file, with a start marker in slot 0 unless ``offset`` is the file's own
        start, sized up to ``offset`` (sparse). Unlike entries, this is not derived
        from the log (see :meth:`ConsumeQueue.start_at`): file and folders are fsynced."""
        start = offset - offset % self.per_file
        path = self.path(start)
        self._cache.pwrite(path, ENTRY.pack(offset, 0, START_TAG) if offset > start else b"", 0)
        self._cache.truncate(path, (offset - start) * ENTRY_SIZE)  # fsyncs the file
        for folder in (self.directory, self.directory.parent, self.directory.parent.parent):
            fsync_dir(folder)  # created just now, maybe: the queue's, its topic's, the root's
        self.starts, self.first, self.flushed_next = [start], offset, offset

    # ---------------------------------------------------------------- reading
    def read_into(self, out: bytearray, pos: int, end: int) -> int:
        """Append the entries from ``pos`` up to ``end`` that are in the files to ``out``;
        returns the offset after them."""
        while pos < min(end, self.flushed_next):
            start = pos - pos % self.per_file
            n = min(end, self.flushed_next, start + self.per_file) - pos
            out += self._read_file(start, pos, n)
            pos += n
        return pos

    def _read_file(self, start: int, pos: int, n: int) -> bytes:
        """``n`` entries from ``pos`` out of the file ``start``: all there, none zeroed."""
        path, at = self.path(start), (pos - start) * ENTRY_SIZE
        try:
            chunk = self._cache.pread(path, n * ENTRY_SIZE, at)
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
        log.error("consume queue %s: %s", self.name, self.damage)
        return CorruptRecordError(str(path), at, check, expected, actual)

    def first_zeroed(self) -> int | None:
        """The first all-zero entry in the last two files (what a crash of the machine
        can leave: sizes written, pages not), or None. Reads those files whole."""
        for start in self.starts[-2:]:
            skip = max(0, self.first - start)  # below the first entry: never written (sparse)
            size = os.stat(self.path(start)).st_size - skip * ENTRY_SIZE
            if size <= 0:
                continue
            rows = np.frombuffer(self._cache.pread(self.path(start), size, skip * ENTRY_SIZE), ENTRY_DTYPE)
            zero = np.flatnonzero((rows["size"] == 0) & (rows["offset"] == 0) & (rows["tag"] == 0))
            if len(zero):
                return start + skip + int(zero[0])
        return None

    # ------------------------------------------------------- cutting, deleting
    def cut(self, offset: int) -> None:
        """Durably drop the entries in the files at or after ``offset`` (< ``flushed_next``)."""
        offset = max(offset, self.first)
        cut_file = offset - offset % self.per_file
        for start in [s for s in self.starts if s > cut_file]:
            self.delete(start)
        self.starts = [s for s in self.starts if s <= cut_file]
        if self.starts and self.starts[-1] == cut_file:
            self._cache.truncate(self.path(cut_file), (offset - cut_file) * ENTRY_SIZE)
        self.flushed_next = offset

    def drop_first_file(self) -> None:
        """Delete the first of two or more files (retention took all its records)."""
        self.delete(self.starts.pop(0))
        self.first = self.starts[0]

    def reset(self) -> None:
        """Delete every file: the queue starts again empty at offset 0."""
        for start in self.starts:
            self.delete(start)
        self.starts = []
        self.first = self.flushed_next = 0

    def delete(self, start: int) -> None:
        path = self.path(start)
        self._cache.forget(path)
        path.unlink(missing_ok=True)
        del self._paths[start]
