"""One server connection: read frames within the server's limits (:class:`Intake`),
run their handlers (serial codes in arrival order, the rest concurrently), write the
replies (:class:`Outbox`: the replies ready together go out in one send). A
misbehaving client only ever loses its own connection."""

from __future__ import annotations

import functools
import logging
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, TypeVar

import msgpack
import trio

from clmq.protocol import (
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    NEED_DATA,
    PROTOCOL_VERSION,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameRejected,
    ProtocolError,
    encode_frame,
    encode_frame_prefix,
    response_to,
)

from ._errors import RequestError
from ._handler import Handler, Later, Peer, Reply, Session
from ._intake import Intake
from ._limits import ByteBudget, ServerLimits
from ._spans import read_spans, send_spans
from ._stats import RequestStats
from ._tls_stream import peer_of


class ConnectionHost(Protocol):
    """What a connection uses of its server (:class:`RpcServer`)."""

    name: str
    handlers: dict[int, Handler]
    max_frame_bytes: int
    idle_timeout_ms: int
    max_inflight: int
    serial_codes: frozenset[int]
    limits: ServerLimits
    budget: ByteBudget
    draining: bool
    inflight: int
    stats: WriteStats
    request_stats: RequestStats

    def request_done(self, n: int = 1) -> None: ...


log = logging.getLogger("clmq.server")

T = TypeVar("T")
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


TLS_RECORD_BYTES = 16 * 1024  # the most plaintext one TLS record carries
MAX_JOINED_PIECES = 4096  # TLS: a run of replies and stored bytes is written once it has this many pieces
_PREFIX = struct.Struct("<II")  # protocol._frame's prefix: frame length, header length


_THREAD = threading.local()  # its ``packer``: one msgpack Packer per thread (not thread-safe)


def _packer() -> msgpack.Packer:
    """This thread's Packer: ``packb`` makes one per call, about half of its cost for
    a reply's header (a Packer starts clean again after a failed ``pack``)."""
    try:
        return _THREAD.packer
    except AttributeError:
        _THREAD.packer = packer = msgpack.Packer(use_bin_type=True)
        return packer


def encode_reply(request: Frame, reply: Reply) -> bytes:
    """``encode_frame(response_to(request, ...))`` of a reply without file spans, without
    making the Frame (once per reply on a busy server; same bytes: tests/test_reply_coalescing)."""
    h: dict[str, Any] = {"v": PROTOCOL_VERSION, "c": request.code, "i": request.request_id, "f": FLAG_RESPONSE}
    if reply.error_code:
        h["e"], h["m"] = reply.error_code, reply.error_text
    if reply.fields:
        h["x"] = reply.fields
    header: bytes = _packer().pack(h)
    body = reply.body
    return b"".join((_PREFIX.pack(4 + len(header) + len(body), len(header)), header, body))


@dataclass
class WriteStats:
    """What a server's connections wrote: replies, and the send calls they took (one
    per run of replies ready together, one more per reply with file spans)."""

    replies: int = 0
    writes: int = 0


class _Out:
    """One reply waiting in an :class:`Outbox`."""

    __slots__ = ("close_text", "data", "held", "size", "spans")

    def __init__(self, data: bytes, spans: list[Any] | None, held: int, close_text: str | None) -> None:
        self.data = data  # the frame, or with spans its prefix (header and fields)
        self.spans = spans
        self.size = len(data) + (sum(s.length for s in spans) if spans else 0)
        # The request's frame bytes, given back once written or given up (the connection
        # is gone); -1: not a request in flight (an error answered while reading).
        self.held = held
        self.close_text = close_text  # not None: close the connection after this reply, saying why


Finished = Callable[[int, int], None]  # (requests, their frame bytes): written, or given up


class Outbox:
    """A connection's replies waiting to be written, and the one task that writes them.

    Why: a reply written by its own handler costs a ``send`` system call (and a lock)
    per request; with hundreds of requests in flight on a connection, most of them
    finish together. Replies are queued synchronously; the writer takes all that are
    waiting and sends them joined, in one call (a reply with file spans: its prefix
    joined with what precedes it, then its spans, so bytes of different replies never
    interleave). Replies go out in the order they were queued.
    """

    def __init__(
        self, stream: trio.abc.Stream, limit_bytes: int, stats: WriteStats, say: Callable[..., None], finished: Finished
    ) -> None:
        self.stream = stream
        # A socket stream sends stored bytes with sendfile; a TLS stream reads them and
        # writes them encrypted, joined with the replies around them.
        self._sendfile = getattr(stream, "socket", None) is not None
        self.limit_bytes = limit_bytes  # max_connection_send_buffer_bytes
        self.stats = stats
        self._say = say
        # Called once per run of replies written (not once per reply: the accounting
        # of a request's end costs as much as its answer's encoding).
        self._finished = finished
        self._items: list[_Out] = []
        self._plain = True  # no reply waiting has file spans or closes the connection
        self.pending_bytes = 0  # queued or being written
        self.closed = False
        self._ready = trio.Event()
        self._room = trio.Event()

    def put(self, out: _Out) -> None:
        """Queue a reply (never blocks; the reader stops while the box is full)."""
        if self.closed:
            self._release([out], queued=False)
            return
        self._items.append(out)
        if out.spans or out.close_text is not None:
            self._plain = False
        self.pending_bytes += out.size
        self._ready.set()

    async def wait_room(self) -> None:
        """Wait while more than ``limit_bytes`` wait to be written (the client is not
        reading its replies): the connection's requests are not read meanwhile."""
        while self.pending_bytes > self.limit_bytes and not self.closed:
            self._room = trio.Event()
            await self._room.wait()

    async def write_loop(self) -> None:
        """The writer task: until the connection closes, write what is waiting."""
        try:
            while not self.closed:
                if not self._items:
                    self._ready = trio.Event()
                    await self._ready.wait()
                items, self._items = self._items, []
                plain, self._plain = self._plain, True
                try:
                    await (self._write_plain(items) if plain else self._write(items))
                finally:
                    self._release(items)
                    self._room.set()
        finally:
            self.closed = True
            self._room.set()
            left, self._items = self._items, []
            self._release(left)

    def _release(self, items: list[_Out], queued: bool = True) -> None:
        """``items`` are written or given up: their bytes leave the box (if ``queued``:
        they were in it), their requests end."""
        requests = held = size = 0
        for out in items:
            size += out.size
            if out.held >= 0:
                requests += 1
                held += out.held
        if queued:
            self.pending_bytes -= size
        if requests:
            self._finished(requests, held)

    async def _write(self, items: list[_Out]) -> None:
        chunk: list[bytes] = []
        replies = 0  # in ``chunk``, counted as written once sent
        try:
            for out in items:
                chunk.append(out.data)
                replies += 1
                if out.spans and self._sendfile:
                    await self._send(chunk)
                    await send_spans(self.stream, out.spans)
                    self.stats.writes += 1
                elif out.spans:  # TLS: the stored bytes join the replies around them, in one write
                    chunk.extend(await read_spans(out.spans))
                if (out.spans and self._sendfile) or out.close_text is not None or len(chunk) > MAX_JOINED_PIECES:
                    await self._send(chunk)
                    self.stats.replies, replies = self.stats.replies + replies, 0
                if out.close_text is not None:
                    self._say(logging.WARNING, "closing the connection after %s", out.close_text)
                    await self._close()
                    return
            await self._send(chunk)
            self.stats.replies += replies
        except _BROKEN as e:
            # A frame may be half-sent: the stream is unusable from here on.
            self._say(logging.INFO, "could not answer: %s", e)
            await self._close()

    async def _write_plain(self, items: list[_Out]) -> None:
        """:meth:`_write` of replies that are bytes alone (most runs): joined, checked no further."""
        try:
            for at in range(0, len(items), MAX_JOINED_PIECES):
                run = items[at : at + MAX_JOINED_PIECES]
                await self._send([out.data for out in run])
                self.stats.replies += len(run)
        except _BROKEN as e:
            self._say(logging.INFO, "could not answer: %s", e)
            await self._close()

    async def _send(self, chunk: list[bytes]) -> None:
        if chunk:
            data = chunk[0] if len(chunk) == 1 else b"".join(chunk)
            chunk.clear()
            self.stats.writes += 1
            await self.stream.send_all(data)

    async def _close(self) -> None:
        self.closed = True
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class ServerConnection:
    """``stream``: a ``SocketStream``, or an ``SSLStream`` over one whose handshake is
    done (``session`` then says so, and names the user of a verified client
    certificate)."""

    def __init__(self, server: ConnectionHost, stream: trio.abc.Stream, session: Session | None = None) -> None:
        self.server = server
        self.stream = stream
        # TLS: bytes already decrypted cannot be waited for on the socket; the first
        # byte of a read is taken while waiting (see _readable), the rest follows it.
        self._tls = isinstance(stream, trio.SSLStream)
        self._peeked = b""
        self._eof = False
        # Plaintext: the stream's own receive (bytes), no wrapper on the hot path.
        self._receive_some: Callable[[int], Awaitable[bytes]] = (
            self._tls_receive_some if self._tls else stream.receive_some  # type: ignore[assignment]
        )
        self.decoder = FrameDecoder(server.max_frame_bytes)
        limits = server.limits
        self.intake = Intake(
            server.budget,
            self.decoder,
            server.max_frame_bytes,
            limits.max_connection_buffer_bytes,
            limits.frame_timeout_ms / 1000,
        )
        self.inflight = 0
        host, port = peer_of(stream)
        self.peer = Peer(host, port, session or Session())
        self.outbox = Outbox(stream, limits.max_connection_send_buffer_bytes, server.stats, self._say, self._finished)
        # Serial frames waiting for the serial worker (at most max_inflight: _admit), and
        # the event it waits on when there are none (a deque: a channel costs a few
        # microseconds per frame, as much as the rest of its reading).
        self._serial: deque[tuple[Frame, int]] = deque()
        self._serial_ready: trio.Event | None = None

    async def serve(self) -> None:
        """Until the client goes or the connection is closed: read requests, answer them."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.outbox.write_loop)
                nursery.start_soon(self._serial_worker)
                try:
                    await self._read_loop(nursery)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self.intake.close()

    def _say(self, level: int, what: str, *args: object) -> None:
        log.log(level, "%s: %s:%d: " + what, self.server.name, self.peer.host, self.peer.port, *args)

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        more = False  # the last read between frames filled its buffer: more bytes are likely waiting
        while True:
            await self.outbox.wait_room()  # a client not reading its replies: read no more requests
            if self.outbox.closed:
                return
            waited = not (more or self.intake.reserved)
            if waited and not await self._deadline(self._readable):
                return  # charged only once bytes are there: a silent connection holds nothing
            n = await self.intake.admit_read()
            between_frames = not self.intake.reserved  # this read is charged until decoded
            if waited:  # readable: the receive does not block (no deadline, a cancel scope fewer per read)
                data = await self._receive(n)
            else:
                data = await self._deadline(functools.partial(self._receive_some, n))
            if not data:
                return
            more = between_frames and len(data) == n
            self.intake.receive(data)
            try:
                self._take_events(nursery)
            except ProtocolError as e:
                self._say(logging.WARNING, "closing the connection: %s", e)
                return
            finally:
                self.intake.settle()

    async def _tls_receive_some(self, n: int) -> bytes:
        if self._peeked:  # taken by _readable and not all read yet: those bytes come first
            data, self._peeked = self._peeked[:n], self._peeked[n:]
            return data
        return bytes(await self.stream.receive_some(n))  # an SSLStream gives a bytearray

    async def _receive(self, n: int) -> bytes | None:
        try:
            if self._peeked or self._eof:
                return await self._take_peeked(n)
            return await self._receive_some(n)
        except _BROKEN:
            return None

    async def _take_peeked(self, n: int) -> bytes:
        """Up to ``n`` of the bytes taken by :meth:`_readable` through TLS (the rest are
        kept for the next read), and what else is decrypted already (without waiting)."""
        data = await self._tls_receive_some(n)
        if data and n > len(data) and not self._peeked and self.stream.pending():  # type: ignore[attr-defined]
            data += await self._tls_receive_some(n - len(data))
        return data

    async def _readable(self) -> bool:
        if not self._tls:
            await trio.lowlevel.wait_readable(self.stream.socket)  # type: ignore[attr-defined]
            return True
        # TLS: the socket may be silent while decrypted bytes wait in the SSL object
        # (several records came in one read). A record is taken to wait for one: it is
        # decrypted whole anyway, so a connection holds at most one record (16 KiB)
        # outside the byte budget, whether one byte of it is taken or all (all: one
        # call of the SSL stream per record instead of two).
        if not self._peeked and not self._eof and not self.stream.pending():  # type: ignore[attr-defined]
            self._peeked = bytes(await self.stream.receive_some(TLS_RECORD_BYTES))
            self._eof = not self._peeked
        return True

    async def _deadline(self, wait: Callable[[], Awaitable[T]]) -> T | None:
        """``wait()`` for bytes within the connection's deadline; None when the
        connection is to be closed instead: broken, idle too long (with no request in
        flight: long polls count), or a frame not complete within frame_timeout_ms."""
        intake = self.intake
        while True:
            mid_frame = intake.mid_frame
            timeout_s = intake.frame_left_s if mid_frame else self.server.idle_timeout_ms / 1000
            start = trio.current_time()
            result: T | None = None
            with trio.move_on_after(timeout_s) as scope:
                try:
                    result = await wait()
                except _BROKEN:
                    return None
            if mid_frame:  # the frame's clock runs only while waiting for its bytes, not for the budget
                intake.frame_left_s -= trio.current_time() - start
            if not scope.cancelled_caught:
                return result
            if mid_frame and intake.frame_left_s <= 0:
                self._say(
                    logging.INFO,
                    "closing: a frame did not arrive within frame_timeout_ms=%d",
                    self.server.limits.frame_timeout_ms,
                )
                return None
            if not mid_frame and not self.inflight:
                self._say(logging.INFO, "closing the idle connection")
                return None

    def _take_events(self, nursery: trio.Nursery) -> None:
        while True:
            event = self.decoder.next_event()
            if event is NEED_DATA:
                return
            assert isinstance(event, (Frame, FrameRejected))
            size = self.intake.claim(event)
            if isinstance(event, FrameRejected):
                if event.request_id >= 0 and not event.flags & FLAG_ONEWAY:
                    self._send_error(event.code, event.request_id, ErrorCode.FRAME_TOO_LARGE, event.reason)
            elif event.is_response or not self._admit(event, size, nursery):
                self.intake.release(size)  # servers send no requests: stray responses are dropped

    def _admit(self, frame: Frame, size: int, nursery: trio.Nursery) -> bool:
        if self.server.draining:
            self._send_error(frame.code, frame.request_id, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
            return False
        if self.inflight >= self.server.max_inflight:
            self._send_error(
                frame.code,
                frame.request_id,
                ErrorCode.SYSTEM_BUSY,
                f"more than {self.server.max_inflight} requests in flight on this connection",
            )
            return False
        self.inflight += 1
        self.server.inflight += 1
        if frame.code in self.server.serial_codes:
            self._serial.append((frame, size))
            if self._serial_ready is not None:
                self._serial_ready.set()
        else:
            nursery.start_soon(self._handle, frame, size)
        return True

    async def _serial_worker(self) -> None:
        queue = self._serial
        async with trio.open_nursery() as finishing:
            while True:
                if not queue:
                    self._serial_ready = trio.Event()
                    await self._serial_ready.wait()
                    self._serial_ready = None
                # Every serial frame already decoded, in order, without yielding in between
                # (a produce handler does not block): the append lane takes them as one group.
                while queue:
                    frame, size = queue.popleft()
                    await self._handle(frame, size, finishing)

    async def _handle(self, frame: Frame, size: int, finishing: trio.Nursery | None = None) -> None:
        handed = False  # the reply (or the Later) now owns the request's accounting
        started = time.perf_counter()
        try:
            handler = self.server.handlers.get(frame.code)
            reply: Reply | Later
            if handler is None:
                reply = self._unserved(frame)
            else:
                try:  # as _guard, without its wrapper (once per request)
                    reply = await handler(frame, self.peer)
                except Exception as e:
                    reply = error_reply(self.server.name, frame, e)
            if isinstance(reply, Later) and finishing is not None:
                if reply.subscribe is not None:
                    reply.subscribe(functools.partial(self._delivered, frame, size, reply, finishing, started))
                else:
                    finishing.start_soon(self._finish, frame, size, reply, started)
                handed = True
                return
            if isinstance(reply, Later):
                reply = await self._guard(frame, reply.finish)
            handed = True
            self._answer(frame, reply, size, started)
        finally:
            if not handed:
                self._done(size)

    def _delivered(
        self, frame: Frame, size: int, later: Later, finishing: trio.Nursery, started: float, reply: Reply | None
    ) -> None:
        """A subscribed Later's outcome: its reply, or None (await ``finish`` after all)."""
        if reply is not None:
            self._answer(frame, reply, size, started)
            return
        try:
            finishing.start_soon(self._finish, frame, size, later, started)
        except RuntimeError:  # the connection is gone (its nursery closed): nobody to answer
            self._done(size)

    async def _finish(self, frame: Frame, size: int, later: Later, started: float) -> None:
        handed = False
        try:
            reply = await self._guard(frame, later.finish)
            handed = True
            self._answer(frame, reply, size, started)
        finally:
            if not handed:
                self._done(size)

    def _done(self, size: int) -> None:
        self._finished(1, size)

    def _finished(self, requests: int, held: int) -> None:
        """``requests`` of this connection are done (answered, or given up), holding
        ``held`` frame bytes between them."""
        self.inflight -= requests
        self.intake.release(held)
        self.server.request_done(requests)

    def _unserved(self, frame: Frame) -> Reply:
        return Reply(
            error_code=ErrorCode.REQUEST_NOT_SUPPORTED,
            error_text=f"request code {frame.code} is not served by {self.server.name}",
        )

    async def _guard(self, frame: Frame, fn: Callable[[], Awaitable[T]]) -> T | Reply:
        """Run a handler step; failures become error replies, never a dropped connection."""
        try:
            return await fn()
        except Exception as e:
            return error_reply(self.server.name, frame, e)

    def _send_error(self, code: int, request_id: int, error: ErrorCode, text: str) -> None:
        self._answer(Frame(code, request_id), Reply(error_code=error, error_text=text))

    def _answer(self, request: Frame, reply: Reply, held: int = -1, started: float | None = None) -> None:
        """Queue the reply to ``request`` for the writer. ``held``: the bytes of a request
        in flight, which ends once its reply is written (at once for a one-way request,
        which gets none); -1: not a request in flight. ``started``: when the request
        was taken up (its latency is counted in the server's request stats)."""
        if started is not None:
            self.server.request_stats.record(request.code, time.perf_counter() - started, reply.error_code != 0)
        if request.flags & FLAG_ONEWAY:
            if held >= 0:
                self._done(held)
            return
        data, reply = _encoded(self.server.name, request, reply)
        close_text = f"{ErrorCode(reply.error_code).name}: {reply.error_text}" if reply.close_after else None
        self.outbox.put(_Out(data, reply.spans or None, held, close_text))


def error_reply(server_name: str, frame: Frame, e: Exception) -> Reply:
    """The answer to a request whose handler raised ``e`` (never a dropped connection)."""
    if isinstance(e, RequestError):
        return Reply(error_code=e.code, error_text=e.text, close_after=e.close)
    if isinstance(e, trio.TooSlowError):
        return Reply(error_code=ErrorCode.TIMEOUT, error_text="the request timed out on the server")
    # a handler bug must not take the connection down
    log.exception("%s: request %d failed", server_name, frame.code, exc_info=e)
    return Reply(error_code=ErrorCode.SYSTEM_ERROR, error_text=f"{type(e).__name__}: {e}")


def _encoded(server_name: str, request: Frame, reply: Reply) -> tuple[bytes, Reply]:
    """The bytes of ``reply`` (with spans: its frame's prefix, the spans follow), and
    the reply they carry: an error reply if ``reply`` cannot be encoded."""
    try:
        if reply.spans:
            frame = response_to(request, reply.fields, reply.body, reply.error_code, reply.error_text)
            return encode_frame_prefix(frame, sum(s.length for s in reply.spans)), reply
        return encode_reply(request, reply), reply
    except Exception as e:  # fields a handler should not have answered: still an answer
        log.exception("%s: cannot encode the reply to request %d", server_name, request.code)
        reply = Reply(error_code=ErrorCode.SYSTEM_ERROR, error_text=f"cannot encode the reply: {type(e).__name__}: {e}")
        return encode_frame(response_to(request, {}, b"", reply.error_code, reply.error_text)), reply
