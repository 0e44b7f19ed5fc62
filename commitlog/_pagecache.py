"""Is a file range in the page cache? (Reading bytes that are not waits for the disk.)

Used where a wait for the disk must not happen in the wrong thread: the broker's read
threads decide whether a pull is cold, and ``send_spans`` never ``sendfile``s an
uncached span on the event loop. Plain synchronous code (storage layer).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

from .fileops import OPS

PAGE = mmap.PAGESIZE
# cachestat(2) (Linux 6.5): the page-cache state of a file range, no data copied. Same
# number on every architecture with the generic syscall table (x86_64, arm64).
SYS_CACHESTAT = 451
# Where cachestat is missing: a non-blocking read of the range (preadv2 RWF_NOWAIT,
# Linux 4.14) tells the same at the cost of a copy, in pieces of at most this many bytes.
NOWAIT_PROBE_BYTES = 256 * 1024


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recent")]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_how = ["cachestat" if _libc is not None else "nowait"]  # the first way that works on this system


def pages_missing(fd: int, position: int, length: int) -> bool | None:
    """Whether some page of ``length`` bytes at ``position`` of open file ``fd`` is not
    in the page cache (a read there would wait for the disk); None if this system
    cannot tell (no cachestat, no RWF_NOWAIT: the caller decides by other means)."""
    if length <= 0:
        return False
    if _how[0] == "cachestat":
        got = _cachestat(fd, position, length)
        if got is not None:
            return got
        _how[0] = "nowait"
    if _how[0] == "nowait":
        got = _nowait(fd, position, length)
        if got is not None:
            return got
        _how[0] = "none"
    return None


def _cachestat(fd: int, position: int, length: int) -> bool | None:
    first = position // PAGE
    pages = (position + length + PAGE - 1) // PAGE - first
    cached = cached_pages(fd, first * PAGE, pages * PAGE)
    return None if cached is None else cached < pages


def cached_pages(fd: int, position: int, length: int) -> int | None:
    """How many pages of the range are in the page cache, by cachestat(2); None where
    this kernel (or a sandbox) has no cachestat."""
    if _libc is None:
        return None
    rng, st = _Range(position, length), _Stat()
    if _libc.syscall(SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
            return None
        raise OSError(ctypes.get_errno(), f"cachestat of fd {fd}")
    return int(st.nr_cache)


def _nowait(fd: int, position: int, length: int) -> bool | None:
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return None
    buf = bytearray(min(length, NOWAIT_PROBE_BYTES))
    done = 0
    while done < length:
        view = memoryview(buf)[: min(len(buf), length - done)]
        try:
            n = os.preadv(fd, [view], position + done, flag)
        except BlockingIOError:
            return True
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without non-blocking reads
                return None
            raise
        if n < len(view):  # cached only up to here, or the file ends: a read would wait or fall short
            return True
        done += n
    return False


def read_exactly(fd: int, position: int, length: int, path: str) -> bytes:
    """``length`` bytes at ``position``; OSError if the file ends before (truncated or
    replaced underneath)."""
    data = OPS.pread(fd, length, position)
    while len(data) < length:
        more = OPS.pread(fd, length - len(data), position + len(data))
        if not more:
            raise OSError(errno.EIO, f"{path} ended at {position + len(data)} while reading {length} bytes at {position}")
        data += more
    return data
