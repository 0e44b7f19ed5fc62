"""The client side of the wire protocol over trio: connections by address, many
requests in flight on each, matched to their responses by request id."""

from __future__ import annotations

import itertools
import logging
import math
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio

from clmq.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_ONEWAY,
    NEED_DATA,
    Frame,
    FrameDecoder,
    FrameRejected,
    ProtocolError,
    encode_frame,
)

from ._errors import ConnectionFailed, RpcError

log = logging.getLogger("clmq.rpc")


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


class _Connection:
    def __init__(self, addr: str, stream: trio.abc.Stream, max_frame_bytes: int) -> None:
        self.addr = addr
        self.stream = stream
        self.decoder = FrameDecoder(max_frame_bytes)
        self.send_lock = trio.Lock()
        self.waiting: dict[int, tuple[trio.Event, list[Frame]]] = {}
        self.ids = itertools.count(1)
        self.closed = False
        self.error = ""

    async def read_loop(self) -> None:
        try:
            while True:
                data = await self.stream.receive_some(1 << 18)
                if not data:
                    self.error = self.error or "connection closed by the server"
                    return
                self.decoder.receive_data(data)
                self._deliver()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            self.error = f"connection lost: {e}"
        except ProtocolError as e:
            self.error = f"bad data from the server: {e}"
        finally:
            self.closed = True
            for event, _slot in self.waiting.values():
                event.set()
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def _deliver(self) -> None:
        while True:
            event = self.decoder.next_event()
            if event is NEED_DATA:
                return
            if isinstance(event, FrameRejected):
                raise ProtocolError(f"response of {event.frame_bytes} bytes exceeds this client's max_frame_bytes")
            assert isinstance(event, Frame)
            if event.request_id == 0 and event.error_code:  # no request has id 0: the server says why it closes
                self.error = f"refused by the server: {event.error_text}"
                continue
            waiter = self.waiting.pop(event.request_id, None)
            if waiter is not None:
                waiter[1].append(event)
                waiter[0].set()

    async def send(self, frame: Frame) -> None:
        data = encode_frame(frame)
        async with self.send_lock:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                self.closed = True
                raise ConnectionFailed(f"{self.addr}: send failed: {e}") from None


class RpcClient:
    """Connections opened on demand and kept; their reader tasks run in ``nursery``."""

    def __init__(
        self, nursery: trio.Nursery, *, connect_timeout_ms: int = 3000, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self._nursery = nursery
        self.connect_timeout_ms = connect_timeout_ms
        self.max_frame_bytes = max_frame_bytes
        self._conns: dict[str, _Connection] = {}
        self._connecting: dict[str, trio.Lock] = {}

    async def _connection(self, addr: str) -> _Connection:
        conn = self._conns.get(addr)
        if conn is not None and not conn.closed:
            return conn
        lock = self._connecting.setdefault(addr, trio.Lock())
        async with lock:
            conn = self._conns.get(addr)
            if conn is not None and not conn.closed:
                return conn
            host, port = split_addr(addr)
            try:
                with trio.fail_after(self.connect_timeout_ms / 1000):
                    stream = await trio.open_tcp_stream(host, port)
            except (OSError, trio.TooSlowError) as e:
                raise ConnectionFailed(f"cannot connect to {addr}: {e or 'timed out'}") from None
            conn = self._conns[addr] = _Connection(addr, stream, self.max_frame_bytes)
            self._nursery.start_soon(conn.read_loop)
            return conn

    async def request(
        self,
        addr: str,
        code: int,
        fields: dict[str, Any] | None = None,
        body: bytes = b"",
        *,
        timeout_ms: float = 3000,
        check: bool = True,
    ) -> Frame:
        """Send a request and wait for its response; raises :class:`RpcError` if the
        response carries an error (unless ``check`` is false), :class:`ConnectionFailed`
        or ``trio.TooSlowError``."""
        conn = await self._connection(addr)
        rid = next(conn.ids)
        event = trio.Event()
        slot: list[Frame] = []  # the read loop puts the response here
        conn.waiting[rid] = (event, slot)
        try:
            with trio.fail_after(timeout_ms / 1000 if timeout_ms != math.inf else math.inf):
                await conn.send(Frame(code, rid, fields or {}, body))
                await event.wait()
        finally:
            conn.waiting.pop(rid, None)
        if not slot:
            raise ConnectionFailed(f"{addr}: {conn.error or 'connection closed'}")
        response = slot[0]
        if check and response.error_code:
            raise RpcError(addr, response.error_code, response.error_text)
        return response

    async def oneway(self, addr: str, code: int, fields: dict[str, Any] | None = None, body: bytes = b"") -> None:
        """Send a request that gets no response."""
        conn = await self._connection(addr)
        await conn.send(Frame(code, next(conn.ids), fields or {}, body, FLAG_ONEWAY))

    async def aclose(self) -> None:
        for conn in list(self._conns.values()):
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()
        self._conns.clear()


@asynccontextmanager
async def background_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for a client's background tasks, as the body of an async context
    manager: an error raised by the caller's code comes out as itself, not wrapped in
    an exception group, so ``except SendError`` works around ``async with``."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if leaf is group:
            raise
        raise leaf from None
