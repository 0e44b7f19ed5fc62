"""The server side of the wire protocol over trio, shared by the name server and the
broker: accept connections, decode frames, run handlers, write responses.

Per connection, requests run concurrently (a long-polling pull must not hold up the
next request), except those whose codes are *serial* (produce: appends from one
connection keep their order), which one task runs in arrival order. Every
connection is bounded (``max_inflight_per_connection``; beyond it: SYSTEM_BUSY) and
closed after ``idle_timeout_ms`` without requests. One misbehaving client only
ever loses its own connection.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, TypeVar

import trio

from protocol import (
    FLAG_ONEWAY,
    NEED_DATA,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameRejected,
    ProtocolError,
    encode_frame,
    encode_frame_prefix,
    response_to,
)  # fmt: skip

from ._errors import RequestError
from ._handler import Handler, Later, Peer, Reply
from ._spans import send_spans

log = logging.getLogger("clmq.server")

T = TypeVar("T")


class RpcServer:
    """Serves ``handlers`` (request code -> handler) on a TCP port."""

    def __init__(self, name: str, handlers: dict[int, Handler], *, max_frame_bytes: int, idle_timeout_ms: int,
                 max_inflight_per_connection: int = 256, serial_codes: frozenset[int] = frozenset()) -> None:  # fmt: skip
        self.name = name
        self.handlers = handlers
        self.max_frame_bytes = max_frame_bytes
        self.idle_timeout_ms = idle_timeout_ms
        self.max_inflight = max_inflight_per_connection
        self.serial_codes = serial_codes
        self.port = 0
        self.inflight = 0
        self.draining = False
        self.connections = 0
        self._accept_scope = trio.CancelScope()
        self._idle = trio.Event()

    async def serve(self, host: str, port: int, handler_nursery: trio.Nursery, *,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:  # fmt: skip
        """Accept until :meth:`stop_accepting`; connections live in ``handler_nursery``."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        with self._accept_scope:
            await trio.serve_listeners(self._connection, listeners, handler_nursery=handler_nursery,
                                       task_status=_Started(task_status, self.port))  # fmt: skip
        for listener in listeners:
            await listener.aclose()

    def stop_accepting(self) -> None:
        self._accept_scope.cancel()

    async def drain(self, timeout_s: float) -> bool:
        """Answer new requests with SHUTTING_DOWN and wait for those in flight."""
        self.draining = True
        with trio.move_on_after(timeout_s):
            while self.inflight:
                self._idle = trio.Event()
                await self._idle.wait()
            return True
        return False

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = _ServerConnection(self, stream)
        self.connections += 1
        try:
            await conn.run()
        finally:
            self.connections -= 1
            with trio.CancelScope(shield=True):
                await stream.aclose()

    def _done(self) -> None:
        self.inflight -= 1
        if not self.inflight:
            self._idle.set()


class _Started:
    """Reports the bound port instead of the listeners."""

    def __init__(self, status: trio.TaskStatus[int], port: int) -> None:
        self._status, self._port = status, port

    def started(self, _value: object = None) -> None:
        self._status.started(self._port)


class _ServerConnection:
    def __init__(self, server: RpcServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.decoder = FrameDecoder(server.max_frame_bytes)
        self.send_lock = trio.Lock()
        self.inflight = 0
        try:
            host, port = stream.socket.getpeername()[:2]
        except (OSError, AttributeError):
            host, port = "0.0.0.0", 0
        self.peer = Peer(host, port)
        self.serial_send, self.serial_recv = trio.open_memory_channel[Frame](server.max_inflight)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serial_worker)
            try:
                await self._read_loop(nursery)
            finally:
                nursery.cancel_scope.cancel()

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        idle_s = self.server.idle_timeout_ms / 1000
        while True:
            data = None
            with trio.move_on_after(idle_s) as scope:
                try:
                    data = await self.stream.receive_some(1 << 18)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return
            if scope.cancelled_caught:
                if self.inflight:
                    continue  # long polls in flight: not idle
                log.info("%s: closing idle connection from %s:%d", self.server.name, self.peer.host, self.peer.port)
                return
            if not data:
                return
            self.decoder.receive_data(data)
            try:
                self._take_events(nursery)
            except ProtocolError as e:
                log.warning("%s: closing connection from %s:%d: %s", self.server.name, self.peer.host, self.peer.port, e)
                return

    def _take_events(self, nursery: trio.Nursery) -> None:
        while True:
            event = self.decoder.next_event()
            if event is NEED_DATA:
                return
            if isinstance(event, FrameRejected):
                if event.request_id >= 0 and not event.flags & FLAG_ONEWAY:
                    nursery.start_soon(self._send_error, event.code, event.request_id, ErrorCode.FRAME_TOO_LARGE, event.reason)
                continue
            assert isinstance(event, Frame)
            if event.is_response:
                continue  # servers do not send requests; ignore stray responses
            self._admit(event, nursery)

    def _admit(self, frame: Frame, nursery: trio.Nursery) -> None:
        if self.server.draining:
            nursery.start_soon(
                self._send_error, frame.code, frame.request_id, ErrorCode.SHUTTING_DOWN, "the server is shutting down"
            )
            return
        if self.inflight >= self.server.max_inflight:
            nursery.start_soon(self._send_error, frame.code, frame.request_id, ErrorCode.SYSTEM_BUSY,
                               f"more than {self.server.max_inflight} requests in flight on this connection")  # fmt: skip
            return
        self.inflight += 1
        self.server.inflight += 1
        if frame.code in self.server.serial_codes:
            self.serial_send.send_nowait(frame)  # cannot block: the channel holds max_inflight
        else:
            nursery.start_soon(self._handle, frame)

    async def _serial_worker(self) -> None:
        async with trio.open_nursery() as finishing:
            async for frame in self.serial_recv:
                await self._handle(frame, finishing)

    async def _handle(self, frame: Frame, finishing: trio.Nursery | None = None) -> None:
        later = False
        try:
            reply = await self._run_handler(frame)
            if isinstance(reply, Later) and finishing is not None:
                later = True
                finishing.start_soon(self._finish, frame, reply)
                return
            if isinstance(reply, Later):
                reply = await self._guard(frame, reply.finish)
            if not frame.is_oneway:
                await self._send_reply(frame, reply)
        finally:
            if not later:
                self.inflight -= 1
                self.server._done()

    async def _finish(self, frame: Frame, later: Later) -> None:
        try:
            reply = await self._guard(frame, later.finish)
            if not frame.is_oneway:
                await self._send_reply(frame, reply)
        finally:
            self.inflight -= 1
            self.server._done()

    async def _run_handler(self, frame: Frame) -> Reply | Later:
        handler = self.server.handlers.get(frame.code)
        if handler is None:
            return Reply(
                error_code=ErrorCode.REQUEST_NOT_SUPPORTED,
                error_text=f"request code {frame.code} is not served by {self.server.name}",
            )
        return await self._guard(frame, lambda: handler(frame, self.peer))

    async def _guard(self, frame: Frame, fn: Callable[[], Awaitable[T]]) -> T | Reply:
        """Run a handler step; failures become error replies, never a dropped connection."""
        try:
            return await fn()
        except RequestError as e:
            return Reply(error_code=e.code, error_text=e.text)
        except trio.TooSlowError:
            return Reply(error_code=ErrorCode.TIMEOUT, error_text="the request timed out on the server")
        except Exception as e:  # a handler bug must not take the connection down
            log.exception("%s: request %d failed", self.server.name, frame.code)
            return Reply(error_code=ErrorCode.SYSTEM_ERROR, error_text=f"{type(e).__name__}: {e}")

    async def _send_error(self, code: int, request_id: int, error: ErrorCode, text: str) -> None:
        await self._send_reply(Frame(code, request_id), Reply(error_code=error, error_text=text))

    async def _send_reply(self, request: Frame, reply: Reply) -> None:
        frame = response_to(request, reply.fields, reply.body, reply.error_code, reply.error_text)
        try:
            async with self.send_lock:
                if reply.spans:
                    length = sum(s.length for s in reply.spans)
                    await self.stream.send_all(encode_frame_prefix(frame, length))
                    await send_spans(self.stream, reply.spans)
                else:
                    await self.stream.send_all(encode_frame(frame))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            # A frame may be half-sent: the stream is unusable from here on.
            log.info("%s: could not answer %s:%d: %s", self.server.name, self.peer.host, self.peer.port, e)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
