"""The Kafka listener: TCP connections speaking Kafka's protocol, each read by the
sans-IO :class:`KafkaRequestReader` and answered in request order.

A connection reads up to ``kafka_max_inflight_requests`` requests ahead of their
answers (Kafka clients pipeline: librdkafka and the Java client keep up to five
produce requests in flight per connection). Each request is started in arrival order
(a handler's synchronous part, e.g. a produce's place in the append lane, runs before
the next request is read) and runs in its own task; a writer task sends the answers in
the order of the requests, as Kafka requires. A request that cannot be decoded, an
unknown API or version (but ApiVersions, answered as Kafka does), or a frame above
``kafka_max_frame_bytes`` closes the connection, as a Kafka broker does; nothing of
such a request was done.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

import trio

from clmq.protocol.kafka import (
    ApiKey,
    KafkaDecodeError,
    KafkaFrameTooLarge,
    KafkaRequest,
    KafkaRequestReader,
    NeedData,
    UnsupportedRequest,
    encode_api_versions_unsupported,
    encode_response,
)
from clmq.protocol.transport import RequestStats, Session, TlsHandshakes, close_stream, peer_identity

log = logging.getLogger("clmq.broker.kafka")

RECEIVE_BYTES = 256 * 1024


class Turn:
    """A produce request's place among its connection's produce requests: the part
    inside ``async with turn`` (the checks and the place in the append lane) runs in
    the order the client sent them, whatever order their tasks start in."""

    __slots__ = ("_line", "_number")

    def __init__(self, line: _Line, number: int) -> None:
        self._line, self._number = line, number

    async def __aenter__(self) -> None:
        line = self._line
        while line.served < self._number:
            await line.changed.wait()

    async def __aexit__(self, *exc: object) -> None:
        line = self._line
        line.served = self._number + 1
        line.changed.set()
        line.changed = trio.Event()


class _Line:
    __slots__ = ("changed", "issued", "served")

    def __init__(self) -> None:
        self.issued = 0
        self.served = 0
        self.changed = trio.Event()

    def turn(self) -> Turn:
        self.issued += 1
        return Turn(self, self.issued - 1)


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a request: the client's address and id; a produce request's turn; the
    connection's session (its login, whether it is TLS), shared by all its requests."""

    host: str
    port: int
    client_id: str = ""
    turn: Turn | None = None
    session: Session = field(default_factory=Session, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class Closing:
    """A handler's answer after which the connection is closed (a failed login)."""

    body: dict[str, Any]


class Refused(Exception):
    """Raised by ``dispatch``: the request is not served and the connection is closed
    (a request before the login), once the answers before it are sent; the text is logged."""


# None: no answer (produce with acks=0)
Handler = Callable[[KafkaRequest, Peer], Awaitable["dict[str, Any] | Closing | None"]]


@dataclass(frozen=True)
class ListenerSettings:
    max_frame_bytes: int
    max_connections: int
    max_inflight_requests: int
    idle_timeout_ms: int
    request_timeout_ms: int = 60_000


class _Pending:
    """One request's answer, in the order the writer sends them."""

    __slots__ = ("close_after", "data", "done", "failed")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None
        self.failed = False  # nothing to send: the connection is closed here
        self.close_after = False  # sent, then the connection is closed


class KafkaListener:
    """Accepts Kafka connections and serves them with ``dispatch``."""

    def __init__(
        self,
        settings: ListenerSettings,
        dispatch: Callable[[KafkaRequest, Peer], Handler | None],
        advertised: Mapping[ApiKey, tuple[int, int]],
        serial: frozenset[int] = frozenset(),
    ) -> None:
        self.settings = settings
        self.advertised = advertised  # what ApiVersions lists; other APIs close the connection
        # APIs answered before the connection's next request is started (the SASL login:
        # the requests after it are judged by its outcome, as Kafka does).
        self.serial = serial
        self._dispatch = dispatch
        self.connections = 0
        self.stats = RequestStats()  # per API key: requests, failures, time to the answer (metrics)
        self.refused_connections = 0  # closed at once: kafka_max_connections reached
        self.closed_bad_input = 0  # closed for a request that could not be decoded, or too large
        self.port = -1
        self._refused_burst = False
        self._listeners: list[trio.SocketListener] = []
        # The Kafka SSL listener: set (by the broker, from its tls_* settings) before
        # serve; each accepted connection's handshake then runs in its own task.
        self.tls: TlsHandshakes | None = None

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on ``host:port`` (0: any free port) until cancelled; reports the port."""
        self._listeners = list(await trio.open_tcp_listeners(port, host=host))
        self.port = self._listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            await trio.serve_listeners(self._serve_one, self._listeners, handler_nursery=nursery)

    async def stop_accepting(self) -> None:
        for listener in self._listeners:
            await listener.aclose()

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        if self.connections >= self.settings.max_connections:
            if not self._refused_burst:
                log.warning(
                    "kafka listener: kafka_max_connections=%d reached; closing new connections",
                    self.settings.max_connections,
                )
                self._refused_burst = True
            self.refused_connections += 1
            await stream.aclose()
            return
        self._refused_burst = False
        self.connections += 1
        conn: trio.abc.Stream = stream
        try:
            host, port = stream.socket.getpeername()[:2]
            session = Session()
            if self.tls is not None:
                tls = await self.tls.accept(stream)  # a failure is counted and logged there
                if tls is None:
                    return
                conn = tls
                session = Session(tls=True, cert_user=peer_identity(tls.getpeercert()))
            await _Connection(self, conn, Peer(str(host), int(port), session=session)).run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away: what it asked and was not answered was not acknowledged
        except* Exception:  # a bug must close this connection, never the listener (and the broker)
            log.exception("kafka: a connection failed; it is closed, the listener goes on")
        finally:
            self.connections -= 1
            await close_stream(conn)


class _Connection:
    def __init__(self, listener: KafkaListener, stream: trio.abc.Stream, peer: Peer) -> None:
        self.listener = listener
        self.settings = listener.settings
        self.stream = stream
        self.peer = peer
        self.reader = KafkaRequestReader(self.settings.max_frame_bytes, listener.advertised)
        self.inflight = 0
        self.produce_line = _Line()
        self._idle: trio.CancelScope | None = None  # the read waiting for the next request

    def _arm_idle(self) -> None:
        """The idle clock runs while nothing is in flight: a connection waiting on a long
        Fetch is not idle, and one whose last answer is done is idle from that moment
        (re-armed here, not only when the next read starts, which may be long before)."""
        if self._idle is not None:
            idle_s = self.settings.idle_timeout_ms / 1000
            self._idle.deadline = trio.current_time() + idle_s if not self.inflight else math.inf

    async def run(self) -> None:
        send, receive = trio.open_memory_channel[_Pending](self.settings.max_inflight_requests)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_loop, receive, nursery.cancel_scope)
            async with send:
                await self._read_loop(send, nursery)

    async def _read_loop(self, send: trio.MemorySendChannel[_Pending], nursery: trio.Nursery) -> None:
        while True:
            with trio.CancelScope() as idle:
                self._idle = idle
                self._arm_idle()
                data = await self.stream.receive_some(RECEIVE_BYTES)
            self._idle = None
            if idle.cancelled_caught:
                log.debug("kafka: closing idle connection from %s:%d", self.peer.host, self.peer.port)
                return
            if not data:
                return
            self.reader.receive_data(bytes(data))  # an SSLStream's reads are bytearrays (bytes: no copy)
            while True:
                try:
                    request = self.reader.next_request()
                except (KafkaDecodeError, KafkaFrameTooLarge) as e:
                    self.listener.closed_bad_input += 1
                    log.warning("kafka: closing the connection from %s:%d: %s", self.peer.host, self.peer.port, e)
                    return
                if isinstance(request, NeedData):
                    break
                if isinstance(request, UnsupportedRequest):
                    await self._unsupported(request, send)
                    if not request.is_api_versions:
                        return
                    continue
                pending = self._start(request, nursery)
                await send.send(pending)
                if request.api_key in self.listener.serial:
                    await pending.done.wait()
                if pending.failed or pending.close_after:
                    return  # the writer sends what is before it, then closes

    async def _unsupported(self, e: UnsupportedRequest, send: trio.MemorySendChannel[_Pending]) -> None:
        """ApiVersions of a version this broker does not know is answered with v0 and
        UNSUPPORTED_VERSION (the client then retries with a version listed); any other
        unknown request closes the connection, as Kafka does."""
        if e.is_api_versions:
            pending = _Pending()
            pending.data = encode_api_versions_unsupported(e.correlation_id, self.listener.advertised)
            pending.done.set()
            await send.send(pending)
            return
        log.warning(
            "kafka: closing the connection from %s:%d: API %d v%d is not served",
            self.peer.host,
            self.peer.port,
            e.api_key,
            e.api_version,
        )

    def _start(self, request: KafkaRequest, nursery: trio.Nursery) -> _Pending:
        pending = _Pending()
        turn = self.produce_line.turn() if request.api_key == ApiKey.PRODUCE else None
        peer = Peer(self.peer.host, self.peer.port, request.client_id or "", turn, self.peer.session)
        try:
            handler = self.listener._dispatch(request, peer)
        except Refused as e:
            log.warning("kafka: closing the connection from %s:%d: %s", peer.host, peer.port, e)
            handler = None
        else:
            if handler is None:  # an API this broker lists as unsupported: never sent by a well-behaved client
                log.warning("kafka: %s:%d sent API %d, which is not served", peer.host, peer.port, request.api_key)
        if handler is None:
            pending.failed = True
            pending.done.set()
            return pending
        self.inflight += 1
        nursery.start_soon(self._answer, request, handler(request, peer), pending)
        return pending

    async def _answer(
        self, request: KafkaRequest, answer: Awaitable[dict[str, Any] | Closing | None], pending: _Pending
    ) -> None:
        started = time.perf_counter()
        try:
            with trio.fail_after(self.settings.request_timeout_ms / 1000):
                body = await answer
            if isinstance(body, Closing):
                body, pending.close_after = body.body, True
            if body is not None:
                pending.data = encode_response(request.api_key, request.api_version, request.correlation_id, body)
        except trio.TooSlowError:
            log.warning(
                "kafka: API %d v%d from %s:%d not answered within kafka_request_timeout_ms=%d; closing the connection",
                request.api_key,
                request.api_version,
                self.peer.host,
                self.peer.port,
                self.settings.request_timeout_ms,
            )
            pending.failed = True
        except Exception:
            log.exception(
                "kafka: API %d v%d from %s:%d failed; closing the connection",
                request.api_key,
                request.api_version,
                self.peer.host,
                self.peer.port,
            )
            pending.failed = True
        finally:
            self.listener.stats.record(request.api_key, time.perf_counter() - started, pending.failed)
            self.inflight -= 1
            if not self.inflight:
                self._arm_idle()
            pending.done.set()

    async def _write_loop(self, receive: trio.MemoryReceiveChannel[_Pending], scope: trio.CancelScope) -> None:
        async with receive:
            async for pending in receive:
                await pending.done.wait()
                if pending.failed:
                    scope.cancel()
                    return
                if pending.data is not None:
                    await self.stream.send_all(pending.data)
                if pending.close_after:
                    scope.cancel()
                    return
        scope.cancel()  # the client closed its side and every answer is sent
