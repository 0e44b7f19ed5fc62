"""A bounded set of open file descriptors shared by every consume queue.

With 100,000 queues we cannot keep a descriptor per file open, so descriptors live in
an LRU and are closed when evicted.

Reads, writes, opens and syncs run *outside* the cache's lock, on a leased descriptor:
a lease keeps its descriptor open (an eviction meanwhile only marks it, and the last
lease closes it), so the kernel cannot reuse the number for another file while a
thread still uses it. Why not under the lock: on a busy disk creating a file or a
write can block for milliseconds (journal, dirty-page throttling); measured after a
produce burst to 10,000 queues, the housekeeping thread creating queue files held the
lock so long that the broker's reads, which need it too, halved consume throughput.

A descriptor opened while some file was forgotten (deleted) is used for its one
operation and not cached, so that a deleted file's descriptor never lingers in the
cache under its name.

Every read, write, truncation and sync goes through ``clmq.commitlog.fileops.OPS`` (the
seam tests inject faults into); errors propagate to the caller, never swallowed.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from clmq.commitlog import fileops


class _Open:
    """A descriptor and the number of operations using it right now."""

    __slots__ = ("evicted", "fd", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.evicted = False


class FileCache:
    """LRU of open descriptors, at most ``max_open_files`` at a time (plus those still
    leased when evicted)."""

    def __init__(self, max_open_files: int) -> None:
        if max_open_files < 1:
            raise ValueError("max_open_files must be at least 1")
        self.max_open_files = max_open_files
        self._fds: OrderedDict[Path, _Open] = OrderedDict()
        self._lock = threading.Lock()
        self._forgets = 0  # how many forget() calls so far

    @property
    def open_count(self) -> int:
        return len(self._fds)

    def _lease(self, path: Path, create: bool) -> _Open:
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:
                self._fds.move_to_end(path)
                entry.users += 1
                return entry
            forgets = self._forgets
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        with self._lock:
            entry = self._fds.get(path)
            if entry is None and forgets != self._forgets:  # maybe this very file: not cached
                entry = _Open(fd)
                entry.evicted = True
            elif entry is None:
                entry = self._fds[path] = _Open(fd)
                while len(self._fds) > self.max_open_files:
                    self._retire(self._fds.popitem(last=False)[1])
            else:  # another thread opened it meanwhile: use theirs
                os.close(fd)
                self._fds.move_to_end(path)
            entry.users += 1
            return entry

    def _release(self, entry: _Open) -> None:
        with self._lock:
            entry.users -= 1
            if entry.evicted and entry.users == 0:
                os.close(entry.fd)

    @staticmethod
    def _retire(entry: _Open) -> None:
        """Out of the cache (lock held): closed now, or by its last lease."""
        entry.evicted = True
        if entry.users == 0:
            os.close(entry.fd)

    def pread(self, path: Path, n: int, pos: int) -> bytes:
        entry = self._lease(path, False)
        try:
            return fileops.OPS.pread(entry.fd, n, pos)
        finally:
            self._release(entry)

    def pwrite(self, path: Path, data: bytes | bytearray | memoryview, pos: int) -> None:
        entry = self._lease(path, True)
        try:
            fileops.write_all(entry.fd, data, pos)  # a short write is rare: finished there
        finally:
            self._release(entry)

    def truncate(self, path: Path, size: int) -> None:
        entry = self._lease(path, False)
        try:
            fileops.OPS.ftruncate(entry.fd, size)
            fileops.OPS.fsync(entry.fd)
        finally:
            self._release(entry)

    def sync(self, path: Path, reopen: bool = False) -> None:
        """fdatasync ``path`` if it is open; with ``reopen``, also if it was evicted
        (its writes are in the page cache but not yet known durable)."""
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:
                entry.users += 1
        if entry is not None:
            try:
                fileops.OPS.fdatasync(entry.fd)
            finally:
                self._release(entry)
        elif reopen and path.exists():
            fd = os.open(path, os.O_RDONLY)
            try:
                fileops.OPS.fdatasync(fd)
            finally:
                os.close(fd)

    def forget(self, path: Path) -> None:
        """Close the descriptor of a file about to be deleted."""
        with self._lock:
            self._forgets += 1
            entry = self._fds.pop(path, None)
            if entry is not None:
                self._retire(entry)

    def close(self) -> None:
        with self._lock:
            for entry in self._fds.values():
                self._retire(entry)
            self._fds.clear()
