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
# Where cachestat is missing (older kernels, container seccomp filters): mincore(2) on a
# shared read-only mapping of the range. It starts no read and copies no data (a
# non-blocking read, RWF_NOWAIT, would do both: it starts reading what it misses, on
# the event loop, and may then find it read). It counts only pages already read, which
# is what matters here: a page still being read would make a read wait. Linux reports
# the pages of a file mapping only to the file's owner, root or a process that may
# write the file, and to any other as all present: for such a file, this cannot tell.
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore sets bit 0; the others are reserved


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recent")]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
if _libc is not None:
    # mmap64: a 64-bit offset on 32-bit systems too (on 64-bit ones, the same function)
    _mmap, _munmap, _mincore_call = getattr(_libc, "mmap64", _libc.mmap), _libc.munmap, _libc.mincore
    _mmap.restype, _mmap.argtypes = (
        ctypes.c_void_p,
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64],
    )
    _munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _mincore_call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_how = ["cachestat" if _libc is not None else "none"]  # the way that works on this system


def pages_missing(fd: int, position: int, length: int) -> bool | None:
    """Whether some page of ``length`` bytes at ``position`` of open file ``fd`` is not
    in the page cache (a read there would wait for the disk); None if this system
    cannot tell for this file (no cachestat, and mincore cannot see its pages or is
    missing: the caller decides by other means)."""
    if length <= 0:
        return False
    if _how[0] == "cachestat":
        got = _cachestat(fd, position, length)
        if got is not None:
            return got
        # cachestat refuses files this process may not write, as mincore hides their
        # pages; refusing one it may write, it is missing or filtered here: stop trying it.
        if mincore_sees(fd):
            _how[0] = "mincore"
    if _how[0] == "none":
        return None
    return _mincore(fd, position, length)


def mincore_sees(fd: int) -> bool:
    """Whether mincore reports the page-cache state of open file ``fd`` to this process
    (the file's owner, root, or a process that may write the file)."""
    euid = os.geteuid()
    if euid == 0 or os.fstat(fd).st_uid == euid:
        return True
    return os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=True)


def _pages(position: int, length: int) -> tuple[int, int]:
    """The first page of the range and how many pages it touches."""
    first = position // PAGE
    return first, (position + length + PAGE - 1) // PAGE - first


def _cachestat(fd: int, position: int, length: int) -> bool | None:
    first, pages = _pages(position, length)
    cached = cached_pages(fd, first * PAGE, pages * PAGE)
    return None if cached is None else cached < pages


def _mincore(fd: int, position: int, length: int) -> bool | None:
    first, pages = _pages(position, length)
    read = read_pages(fd, first * PAGE, pages * PAGE)
    return None if read is None else read < pages


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


def read_pages(fd: int, position: int, length: int) -> int | None:
    """How many pages of the range (``position`` page-aligned) are in the page cache
    and read, by mincore(2) on a mapping of it (pages past the end of the file count
    as missing); None where mincore cannot tell for this file (see :func:`mincore_sees`),
    the file cannot be mapped now (its file system, the process's address space or map
    count) or this system has no mincore."""
    if _libc is None or not mincore_sees(fd):
        return None
    if length <= 0:
        return 0
    assert position % PAGE == 0, f"mincore range at {position}: not page-aligned"
    addr = _mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, position)
    if addr is None or addr == _MAP_FAILED:
        return None  # ENODEV, EACCES, ENOMEM, EAGAIN...: for this file, or for now
    try:
        vec = ctypes.create_string_buffer((length + PAGE - 1) // PAGE)
        if _mincore_call(addr, length, vec) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
                return None
            raise OSError(ctypes.get_errno(), f"mincore of fd {fd} at {position}")
        return len(vec.raw) - vec.raw.translate(_LOW_BIT).count(0)
    finally:
        _munmap(addr, length)


def read_exactly(fd: int, position: int, length: int, path: str) -> bytes:
    """``length`` bytes at ``position``; OSError if the file ends before (truncated or
    replaced underneath)."""
    data = OPS.pread(fd, length, position)
    while len(data) < length:
        more = OPS.pread(fd, length - len(data), position + len(data))
        if not more:
            raise OSError(
                errno.EIO, f"{path} ended at {position + len(data)} while reading {length} bytes at {position}"
            )
        data += more
    return data
