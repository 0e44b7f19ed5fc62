"""Sending stored bytes: file spans with ``os.sendfile`` (zero copy), or bytes."""

from __future__ import annotations

import os
from typing import Any

import trio


async def send_spans(stream: trio.abc.SendStream, spans: list[Any]) -> None:
    """Send stored bytes: with ``os.sendfile`` (zero copy) when ``stream`` is a TCP
    socket stream and the span names a file, else by reading and sending."""
    sock = getattr(stream, "socket", None)
    for span in spans:
        if span.data is not None:
            await stream.send_all(span.data)
        elif sock is not None:
            await _sendfile(sock, span.path, span.position, span.length)
        else:
            await stream.send_all(await trio.to_thread.run_sync(_pread, span.path, span.length, span.position))


async def _sendfile(sock: trio.socket.SocketType, path: str, position: int, length: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
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
    finally:
        os.close(fd)


def _pread(path: str, length: int, position: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), length, position)
