"""Fault injection under the store's file operations (the seam of ``clmq.commitlog.fileops``).

    with inject(Fault("fdatasync", errno.EIO, path="commitlog/")) as faults:
        ...                       # the first fdatasync of a commit-log file fails
    assert faults.fired

A :class:`Fault` names the operation (``pwrite``, ``write``, ``pread``, ``fsync``,
``fdatasync``, ``ftruncate``), the error (an errno, or ``SHORT`` for a write that
writes half its bytes), a substring of the file's path, how many matching calls to let
through first (``after``) and how many to fail (``times``, None: every one after).
Paths come from ``/proc/self/fd``, so a fault can target one file kind.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterator

from clmq.commitlog import fileops

SHORT = -1  # the error of a fault that makes a write short instead of failing it


@dataclass
class Fault:
    op: str
    error: int
    path: str = ""
    after: int = 0
    times: int | None = 1
    seen: int = 0
    fired: int = 0


class FaultyOps(fileops.FileOps):
    """File operations that fail as the installed faults say."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self._lock = threading.Lock()

    @property
    def fired(self) -> int:
        return sum(f.fired for f in self.faults)

    def _match(self, op: str, fd: int) -> Fault | None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        with self._lock:
            for fault in self.faults:
                if fault.op != op or fault.path not in path:
                    continue
                fault.seen += 1
                if fault.seen <= fault.after or (fault.times is not None and fault.fired >= fault.times):
                    continue
                fault.fired += 1
                return fault
        return None

    def _maybe_fail(self, op: str, fd: int) -> Fault | None:
        fault = self._match(op, fd)
        if fault is not None and fault.error != SHORT:
            raise OSError(fault.error, f"{os.strerror(fault.error)} (injected into {op})")
        return fault

    def pwrite(self, fd: int, data: fileops.Buffer, pos: int) -> int:
        if self._maybe_fail("pwrite", fd) is not None:  # SHORT: half of it
            view = memoryview(data).cast("B")
            return os.pwrite(fd, view[: max(1, len(view) // 2)], pos)
        return os.pwrite(fd, data, pos)

    def write(self, fd: int, data: fileops.Buffer) -> int:
        if self._maybe_fail("write", fd) is not None:
            view = memoryview(data).cast("B")
            return os.write(fd, view[: max(1, len(view) // 2)])
        return os.write(fd, data)

    def pread(self, fd: int, n: int, pos: int) -> bytes:
        if self._maybe_fail("pread", fd) is not None:
            return os.pread(fd, n // 2, pos)
        return os.pread(fd, n, pos)

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync", fd)
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self._maybe_fail("fdatasync", fd)
        os.fdatasync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        self._maybe_fail("ftruncate", fd)
        os.ftruncate(fd, size)


@contextlib.contextmanager
def inject(*faults: Fault) -> Iterator[FaultyOps]:
    """Install the faults for the duration of the block (then the plain operations)."""
    ops = FaultyOps(list(faults))
    previous = fileops.install(ops)
    try:
        yield ops
    finally:
        fileops.install(previous)
