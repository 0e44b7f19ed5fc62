"""The client side of the wire protocol over trio: connections by address, many
requests in flight on each, matched to their responses by request id.

With :class:`ClientSecurity`: each connection is TLS (the handshake done within the
connect timeout; a certificate the CA does not vouch for is a ConnectionFailed saying
why), and logs in (a SCRAM exchange of two AUTHENTICATE requests) before any other
request goes out on it."""

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
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameRejected,
    ProtocolError,
    RequestCode,
    encode_frame,
)
from clmq.protocol.auth import ScramClient, ScramError

from ._errors import AuthenticationFailed, ConnectionFailed, RpcError
from ._security import ClientSecurity
from ._tls_stream import close_stream, describe_tls_error, send_alert

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
            # through TLS the cause says why (a server refusing this client's certificate answers at the first read)
            self.error = f"connection lost: {describe_tls_error(e) if e.__cause__ is not None else e}"
        except ProtocolError as e:
            self.error = f"bad data from the server: {e}"
        finally:
            self.closed = True
            for event, _slot in self.waiting.values():
                event.set()
            await close_stream(self.stream)

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


LOGIN_TIMEOUT_MS = 10_000  # a login's two requests (a server answers a failed one after a delay)


class RpcClient:
    """Connections opened on demand and kept; their reader tasks run in ``nursery``.

    ``security``: TLS and a login for every connection (None or plain: neither). The
    TLS context is made here, so that a missing or mismatched file fails at once."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        connect_timeout_ms: int = 3000,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        security: ClientSecurity | None = None,
        login_timeout_ms: int = LOGIN_TIMEOUT_MS,
    ) -> None:
        self._nursery = nursery
        self.connect_timeout_ms = connect_timeout_ms
        self.max_frame_bytes = max_frame_bytes
        self.security = security or ClientSecurity()
        self.login_timeout_ms = login_timeout_ms
        tls = self.security.tls
        self._tls_context = tls.client_context() if tls is not None else None
        self._conns: dict[str, _Connection] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self.principals: dict[str, str] = {}  # address -> the principal its server logged this client in as

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
            deadline = trio.current_time() + self.connect_timeout_ms / 1000
            try:
                with trio.fail_at(deadline):
                    tcp = await trio.open_tcp_stream(host, port)
            except (OSError, trio.TooSlowError) as e:
                raise ConnectionFailed(f"cannot connect to {addr}: {e or 'timed out'}") from None
            stream: trio.abc.Stream = tcp
            if self._tls_context is not None:
                stream = await self._handshake(addr, host, tcp, deadline)
            conn = _Connection(addr, stream, self.max_frame_bytes)
            self._nursery.start_soon(conn.read_loop)
            if self.security.user:
                try:
                    await self._login(conn)
                except BaseException:
                    await close_stream(conn.stream)
                    raise
            self._conns[addr] = conn
            return conn

    async def _handshake(self, addr: str, host: str, tcp: trio.SocketStream, deadline: float) -> trio.abc.Stream:
        assert self._tls_context is not None and self.security.tls is not None
        tls = trio.SSLStream(tcp, self._tls_context, server_hostname=self.security.tls.server_hostname or host)
        try:
            with trio.fail_at(deadline):
                await tls.do_handshake()
        except trio.TooSlowError:
            await trio.aclose_forcefully(tcp)
            raise ConnectionFailed(
                f"TLS handshake with {addr} failed: no answer within {self.connect_timeout_ms} ms (is it a TLS port?)"
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            await send_alert(tls)
            await trio.aclose_forcefully(tcp)
            raise ConnectionFailed(f"TLS handshake with {addr} failed: {describe_tls_error(e)}") from None
        return tls

    async def _login(self, conn: _Connection) -> None:
        """The SCRAM exchange on a new connection, before anything else is sent on it.
        A server that serves no logins (a name server) is used without one."""
        sec, addr = self.security, conn.addr
        scram = ScramClient(sec.mechanism, sec.user, sec.password)
        timeout_ms = self.login_timeout_ms
        try:
            first = await self._call(
                conn, RequestCode.AUTHENTICATE, {"mechanism": sec.mechanism, "data": scram.first()}, timeout_ms
            )
            if first.error_code == ErrorCode.REQUEST_NOT_SUPPORTED:
                log.debug("%s serves no logins: connected without one", addr)
                return
            _check_login(first, addr, sec.user)
            final = await self._call(
                conn, RequestCode.AUTHENTICATE, {"data": scram.final(_data(first, addr, sec.user))}, timeout_ms
            )
            _check_login(final, addr, sec.user)
            scram.check(_data(final, addr, sec.user))
        except ScramError as e:
            raise AuthenticationFailed(addr, sec.user, str(e)) from None
        except trio.TooSlowError:
            raise AuthenticationFailed(addr, sec.user, f"no answer within {timeout_ms} ms") from None
        if not final.fields.get("done", True):
            raise AuthenticationFailed(addr, sec.user, "the server did not finish the exchange in two steps")
        principal = final.fields.get("principal")
        self.principals[addr] = principal if isinstance(principal, str) else f"User:{sec.user}"
        log.debug("logged in to %s as %s", addr, self.principals[addr])

    async def _call(
        self, conn: _Connection, code: int, fields: dict[str, Any], timeout_ms: float, body: bytes = b""
    ) -> Frame:
        """One request on ``conn``, its response (an error answer not raised)."""
        rid = next(conn.ids)
        event = trio.Event()
        slot: list[Frame] = []  # the read loop puts the response here
        conn.waiting[rid] = (event, slot)
        try:
            with trio.fail_after(timeout_ms / 1000 if timeout_ms != math.inf else math.inf):
                await conn.send(Frame(code, rid, fields, body))
                await event.wait()
        finally:
            conn.waiting.pop(rid, None)
        if not slot:
            raise ConnectionFailed(f"{conn.addr}: {conn.error or 'connection closed'}")
        return slot[0]

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
        response = await self._call(conn, code, fields or {}, timeout_ms, body)
        if check and response.error_code:
            raise RpcError(addr, response.error_code, response.error_text)
        return response

    async def oneway(self, addr: str, code: int, fields: dict[str, Any] | None = None, body: bytes = b"") -> None:
        """Send a request that gets no response."""
        conn = await self._connection(addr)
        await conn.send(Frame(code, next(conn.ids), fields or {}, body, FLAG_ONEWAY))

    async def aclose(self) -> None:
        for conn in list(self._conns.values()):
            await close_stream(conn.stream)
        self._conns.clear()


def _check_login(response: Frame, addr: str, user: str) -> None:
    if response.error_code:
        try:
            name = ErrorCode(response.error_code).name
        except ValueError:
            name = f"error {response.error_code}"
        text = f": {response.error_text}" if response.error_text else ""
        raise AuthenticationFailed(addr, user, f"{name}{text}")


def _data(response: Frame, addr: str, user: str) -> bytes:
    data = response.fields.get("data")
    if not isinstance(data, bytes):
        raise AuthenticationFailed(addr, user, "the server's answer carries no SCRAM message")
    return data


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
