"""The file operations of the storage layer, behind one seam.

Every write, positional read, fsync and truncation of a store file (CommitLog segments,
their indexes, consume queues, partition logs, metadata files), and the close of a
CommitLog segment, goes through :data:`OPS` (looked up at each call, as ``fileops.OPS.pwrite(...)``), never straight
to :mod:`os`. In production :data:`OPS` is a :class:`FileOps`: the plain ``os``
functions. Tests :func:`install` a subclass that fails chosen calls (EIO, ENOSPC, a
short write) to prove that every fault is reported and nothing is lost silently; see
``tests/faults.py``. Nothing in the shipped code installs anything else.
"""

from __future__ import annotations

import os

# What os.pwrite accepts (collections.abc.Buffer arrives with Python 3.12).
Buffer = bytes | bytearray | memoryview


class FileOps:
    """The operations, as the ``os`` module does them. Subclass to inject faults."""

    def pwrite(self, fd: int, data: Buffer, pos: int) -> int:
        return os.pwrite(fd, data, pos)

    def write(self, fd: int, data: Buffer) -> int:
        return os.write(fd, data)

    def pread(self, fd: int, n: int, pos: int) -> bytes:
        return os.pread(fd, n, pos)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        os.close(fd)


OPS: FileOps = FileOps()


def install(ops: FileOps) -> FileOps:
    """Make ``ops`` the file operations of every store in this process; returns the
    previous ones (to put back). For tests only."""
    global OPS
    previous, OPS = OPS, ops
    return previous


def write_all(fd: int, data: Buffer, pos: int) -> None:
    """Write all of ``data`` at ``pos``, finishing short writes (rare, but legal)."""
    view = memoryview(data).cast("B")
    while view:
        n = OPS.pwrite(fd, view, pos)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at position {pos}")
        view, pos = view[n:], pos + n
