"""The server side of the wire protocol over trio, shared by the name server and the
broker: accept connections, decode frames, run handlers, write responses.

Per connection, requests run concurrently (a long-polling pull must not hold up the
next request), except those whose codes are *serial* (produce: appends from one
connection keep their order), which one task runs in arrival order. Every
connection is bounded (``max_inflight_per_connection``; beyond it: SYSTEM_BUSY) and
closed after ``idle_timeout_ms`` without requests. One misbehaving client only
ever loses its own connection.

Limits at the door (:class:`ServerLimits`): connections beyond ``max_connections`` (or
beyond what the descriptor limit leaves) are told TOO_MANY_CONNECTIONS and closed; accept
failing for lack of descriptors (EMFILE, ENFILE) backs off and retries; request bytes
held are bounded per connection and in all, by not reading (back-pressure); a frame
must arrive within ``frame_timeout_ms``. Each kind of refusal is logged once per burst.

TLS (``tls``, an ``ssl.SSLContext``): each accepted connection's handshake runs in
its own task, within ``tls_handshake_timeout_ms``; a failed one (a client of another
CA, an expired certificate, a plaintext client, a silent one) is counted
(``tls_handshake_failures``), logged once per burst with the peer and the reason, and
costs no other connection anything. Replies of stored bytes go through TLS by reading
and sending (no sendfile).
"""

from __future__ import annotations

import errno
import logging
import ssl

import trio

from clmq.protocol import FLAG_RESPONSE, ErrorCode, Frame, encode_frame

from ._connection import ServerConnection, WriteStats
from ._handler import Handler, Session
from ._limits import Burst, ByteBudget, ServerLimits
from ._stats import RequestStats
from ._tls import DEFAULT_HANDSHAKE_TIMEOUT_MS, peer_identity
from ._tls_stream import TlsHandshakes, close_stream

log = logging.getLogger("clmq.server")

ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_FIRST_S = 0.01  # after accept fails for lack of resources: back off, doubling ...
ACCEPT_RETRY_MAX_S = 1.0  # ... up to this
ACCEPT_QUIET_S = 5.0  # a lack of descriptors ends once accept has worked this long
REFUSAL_SEND_S = 0.5  # how long a refused connection may take to be told why


class RpcServer:
    """Serves ``handlers`` (request code -> handler) on a TCP port."""

    def __init__(
        self,
        name: str,
        handlers: dict[int, Handler],
        *,
        max_frame_bytes: int,
        idle_timeout_ms: int,
        max_inflight_per_connection: int = 256,
        serial_codes: frozenset[int] = frozenset(),
        limits: ServerLimits | None = None,
        tls: ssl.SSLContext | None = None,
        tls_handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS,
    ) -> None:
        self.name = name
        self.handlers = handlers
        self.max_frame_bytes = max_frame_bytes
        self.idle_timeout_ms = idle_timeout_ms
        self.max_inflight = max_inflight_per_connection
        self.serial_codes = serial_codes
        self.limits = limits or ServerLimits()
        self.limits.check(max_frame_bytes)
        self.budget = ByteBudget(self.limits.max_buffered_request_bytes)
        self.max_connections = self.limits.max_connections
        self.port = 0
        self.inflight = 0
        self.draining = False
        self.connections = 0
        self.refused_connections = 0
        self.stats = WriteStats()  # replies written and the send calls they took, all connections
        self.request_stats = RequestStats()  # per request code: count, errors, latency
        self._refusals = Burst(log, f"{name}: connections refused")
        self._no_descriptors = Burst(log, f"{name}: accepts failed for lack of descriptors")
        self._accept_scope = trio.CancelScope()
        self._idle = trio.Event()
        self.tls = tls
        self._handshakes = None
        if tls is not None:
            text = (
                f"{name} speaks TLS only on this port: connect with TLS (--tls-ca, $CLMQ_TLS_CA_FILE, ClientSecurity)"
            )
            refusal = Frame(0, 0, flags=FLAG_RESPONSE, error_code=ErrorCode.TLS_REQUIRED, error_text=text)
            self._handshakes = TlsHandshakes(name, tls, tls_handshake_timeout_ms, plaintext_reply=encode_frame(refusal))

    @property
    def tls_handshake_failures(self) -> int:
        """TLS handshakes that failed since the start (0 for a plaintext server)."""
        return 0 if self._handshakes is None else self._handshakes.failures

    @property
    def buffered_request_bytes(self) -> int:
        """Request bytes held now (read and not yet handled, or reserved for a frame
        being read)."""
        return self.budget.used

    @property
    def peak_buffered_request_bytes(self) -> int:
        return self.budget.peak

    async def serve(
        self,
        host: str,
        port: int,
        handler_nursery: trio.Nursery,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept until :meth:`stop_accepting`; connections live in ``handler_nursery``."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        self.max_connections = self.limits.connection_cap()
        if self.max_connections < self.limits.max_connections:
            log.info(
                "%s: at most %d connections (max_connections=%d, lowered to leave reserved_file_descriptors=%d "
                "of the descriptor limit)",
                self.name,
                self.max_connections,
                self.limits.max_connections,
                self.limits.reserved_file_descriptors,
            )
        try:
            with self._accept_scope:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept_loop, listener, handler_nursery)
                    task_status.started(self.port)
        finally:
            for listener in listeners:
                await trio.aclose_forcefully(listener)

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept for ever. Why not ``trio.serve_listeners``: it logs a traceback every
        100 ms while descriptors are lacking, and it has no connection limit."""
        backoff_s = ACCEPT_RETRY_FIRST_S
        while True:
            try:
                stream = await listener.accept()
            except OSError as e:
                if e.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                self._no_descriptors.hit(
                    f"{self.name}: cannot accept connections: out of file descriptors or "
                    f"memory ({errno.errorcode[e.errno]}); retrying, backing off up to "
                    f"{ACCEPT_RETRY_MAX_S:g} s"
                )
                await trio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, ACCEPT_RETRY_MAX_S)
                continue
            backoff_s = ACCEPT_RETRY_FIRST_S
            if trio.current_time() - self._no_descriptors.last_s > ACCEPT_QUIET_S:
                self._no_descriptors.end()
            self._start(stream, nursery)

    def _start(self, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
        if self.connections >= self.max_connections:
            self.refused_connections += 1
            self._refusals.hit(
                f"{self.name}: refusing connections: {self.connections} open, max_connections={self.max_connections}"
            )
            nursery.start_soon(self._refuse, stream)
            return
        self._refusals.end()
        self.connections += 1  # counted here, not in the task: a burst of accepts cannot overshoot
        nursery.start_soon(self._connection, stream)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """Tell a connection over the limit why (an error frame with request id 0, which
        no request uses), then close it. Through TLS, after a handshake (not counted
        as a failure if it fails: the connection is refused anyway)."""
        text = f"too many connections to {self.name}: max_connections={self.max_connections}"
        out: trio.abc.Stream = stream
        try:
            with trio.move_on_after(REFUSAL_SEND_S if self.tls is None else 4 * REFUSAL_SEND_S):
                if self.tls is not None:
                    out = trio.SSLStream(stream, self.tls, server_side=True)
                await out.send_all(
                    encode_frame(
                        Frame(0, 0, flags=FLAG_RESPONSE, error_code=ErrorCode.TOO_MANY_CONNECTIONS, error_text=text)
                    )
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(out)

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
        conn: trio.abc.Stream = stream
        try:
            if self._handshakes is None:
                await ServerConnection(self, stream).serve()
                return
            tls = await self._handshakes.accept(stream)
            if tls is None:
                return
            conn = tls
            session = Session(tls=True, cert_user=peer_identity(tls.getpeercert()))
            await ServerConnection(self, tls, session).serve()
        finally:
            self.connections -= 1
            if conn is stream:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
            else:
                await close_stream(conn)

    def request_done(self, n: int = 1) -> None:
        """``n`` of a connection's requests are finished (answered, or given up)."""
        self.inflight -= n
        if not self.inflight:
            self._idle.set()
