"""Sending stored bytes: file spans with ``os.sendfile`` (zero copy), or bytes.

``sendfile`` of bytes that are not in the page cache reads the disk synchronously in
the calling thread: on the event loop, that stalls every connection for as long as
the disk takes (a consumer far behind, a follower catching up from old segments). So
a file span goes out with ``sendfile`` only when its pages are known to be cached
(checked here with one ``cachestat`` or ``mincore`` call, or by the caller: a span
whose ``resident`` attribute is true was checked in a read thread just before);
otherwise, or where the check cannot tell, its bytes are read in a worker thread and
sent as bytes. The check: :func:`pages_missing`.
"""

from __future__ import annotations

import os
from typing import Any

import trio

from clmq.commitlog import pages_missing, read_exactly

# What send_spans did, process-wide (tests and the broker's counters read them).
SPAN_COUNTERS: dict[str, int] = {"sendfile_spans": 0, "thread_read_spans": 0, "inline_read_spans": 0, "data_spans": 0}


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
            if sock is not None and (
                getattr(span, "resident", False) or pages_missing(fd, span.position, span.length) is False
            ):
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


async def read_spans(spans: list[Any]) -> list[bytes]:
    """The bytes of ``spans``, for a stream that cannot take ``sendfile`` (TLS): a span
    whose pages are cached is read at once (a copy from memory, as cheap as the thread
    hop it saves), the others all together in one worker thread (the disk is never read
    on the event loop). The caller joins them into as few TLS writes as it can: one
    write per span would cost a record, a Python call and a thread hop each."""
    out: list[bytes] = []
    cold: list[tuple[int, Any]] = []
    fds: dict[str, int] = {}
    try:
        for span in spans:
            if span.data is not None:
                SPAN_COUNTERS["data_spans"] += 1
                out.append(span.data)
                continue
            fd = fds.get(span.path)
            if fd is None:
                fd = fds[span.path] = os.open(span.path, os.O_RDONLY)
            if getattr(span, "resident", False) or pages_missing(fd, span.position, span.length) is False:
                SPAN_COUNTERS["inline_read_spans"] += 1
                out.append(read_exactly(fd, span.position, span.length, span.path))
            else:
                cold.append((len(out), span))
                out.append(b"")
        if cold:
            SPAN_COUNTERS["thread_read_spans"] += len(cold)
            datas = await trio.to_thread.run_sync(_read_cold, fds, [span for _i, span in cold])
            for (i, _span), data in zip(cold, datas):
                out[i] = data
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _read_cold(fds: dict[str, int], spans: list[Any]) -> list[bytes]:
    return [read_exactly(fds[s.path], s.position, s.length, s.path) for s in spans]
