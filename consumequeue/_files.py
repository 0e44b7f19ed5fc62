"""A bounded set of open file descriptors shared by every consume queue.

With 100,000 queues we cannot keep a descriptor per file open, so descriptors live in
an LRU and are closed when evicted. Every read and write goes through the cache under
its lock: handing a raw descriptor out would let another thread evict (close) it and
the kernel reuse its number for a different file while the first thread still uses it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path


class FileCache:
    """LRU of open descriptors, at most ``max_open_files`` at a time."""

    def __init__(self, max_open_files: int) -> None:
        if max_open_files < 1:
            raise ValueError("max_open_files must be at least 1")
        self.max_open_files = max_open_files
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def open_count(self) -> int:
        return len(self._fds)

    def _fd(self, path: Path, create: bool) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        self._fds[path] = fd
        while len(self._fds) > self.max_open_files:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def pread(self, path: Path, n: int, pos: int) -> bytes:
        with self._lock:
            return os.pread(self._fd(path, False), n, pos)

    def pwrite(self, path: Path, data: bytes | bytearray | memoryview, pos: int) -> None:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fd(path, True)
            else:
                self._fds.move_to_end(path)
            written = os.pwrite(fd, data, pos)
            if written < len(data):  # short write: rare, finish it
                view = memoryview(data)[written:]
                pos += written
                while view:
                    written = os.pwrite(fd, view, pos)
                    view, pos = view[written:], pos + written

    def truncate(self, path: Path, size: int) -> None:
        with self._lock:
            fd = self._fd(path, False)
            os.ftruncate(fd, size)
            os.fsync(fd)

    def sync(self, path: Path, reopen: bool = False) -> None:
        """fdatasync ``path`` if it is open; with ``reopen``, also if it was evicted
        (its writes are in the page cache but not yet known durable).

        The fsync runs on a duplicate descriptor *outside* the lock: holding the lock
        through a disk flush would stall every write to every other file.
        """
        with self._lock:
            if path in self._fds:
                fd = os.dup(self._fds[path])
            elif reopen and path.exists():
                fd = os.open(path, os.O_RDONLY)
            else:
                return
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def forget(self, path: Path) -> None:
        """Close the descriptor of a file about to be deleted."""
        with self._lock:
            fd = self._fds.pop(path, None)
            if fd is not None:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
