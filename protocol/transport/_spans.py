"""Sending stored bytes: file spans with ``os.sendfile`` (zero copy), or bytes.

``sendfile`` of bytes that are not in the page cache reads the disk synchronously in
the calling thread: on the event loop, that stalls every connection for as long as
the disk takes (a consumer far behind, a follower catching up from old segments). So
a file span goes out with ``sendfile`` only when its pages are all cached (checked
here with one ``cachestat`` call, or by the caller: a span whose ``resident``
attribute is true was checked in a read thread just before); otherwise its bytes are
read in a worker thread and sent as bytes. The check: :func:`pages_missing`.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from typing import Any

import trio

PAGE = mmap.PAGESIZE
# cachestat(2) (Linux 6.5): the page-cache state of a file range, no data copied. Same
# number on every architecture with the generic syscall table (x86_64, arm64).
SYS_CACHESTAT = 451
# Where cachestat is missing: a non-blocking read of the range (preadv2 RWF_NOWAIT,
# Linux 4.14) tells the same at the cost of a copy, in pieces of at most this many bytes.
NOWAIT_PROBE_BYTES = 256 * 1024

# What send_spans did, process-wide (tests and the broker's counters read them).
SPAN_COUNTERS: dict[str, int] = {"sendfile_spans": 0, "thread_read_spans": 0, "data_spans": 0}


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
    rng, st = _Range(first * PAGE, pages * PAGE), _Stat()
    assert _libc is not None
    if _libc.syscall(SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):  # not this kernel (or a sandbox)
            return None
        raise OSError(ctypes.get_errno(), f"cachestat of fd {fd}")
    return bool(st.nr_cache < pages)


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
    data = os.pread(fd, length, position)
    while len(data) < length:
        more = os.pread(fd, length - len(data), position + len(data))
        if not more:
            raise OSError(errno.EIO, f"{path} ended at {position + len(data)} while reading {length} bytes at {position}")
        data += more
    return data


async def send_spans(stream: trio.abc.SendStream, spans: list[Any]) -> None:
    """Send stored bytes: with ``os.sendfile`` (zero copy) when ``stream`` is a TCP
    socket stream, the span names a file and its pages are cached, else by reading
    (in a worker thread) and sending."""
    sock = getattr(stream, "socket", None)
    for span in spans:
        if span.data is not None:
            SPAN_COUNTERS["data_spans"] += 1
            await stream.send_all(span.data)
            continue
        fd = os.open(span.path, os.O_RDONLY)
        try:
            if sock is not None and (getattr(span, "resident", False) or not pages_missing(fd, span.position, span.length)):
                SPAN_COUNTERS["sendfile_spans"] += 1
                await _sendfile(sock, fd, span.path, span.position, span.length)
            else:  # cold (or no socket): the disk is read in a thread, never on the event loop
                SPAN_COUNTERS["thread_read_spans"] += 1
                data = await trio.to_thread.run_sync(read_exactly, fd, span.position, span.length, span.path)
                await stream.send_all(data)
        finally:
            os.close(fd)


async def _sendfile(sock: trio.socket.SocketType, fd: int, path: str, position: int, length: int) -> None:
    sent = 0
    while sent < length:
        try:
            n = os.sendfile(sock.fileno(), fd, position + sent, length - sent)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        if n == 0:
            raise OSError(f"{path} ended at {position + sent} while sending (truncated underneath?)")
        sent += n
