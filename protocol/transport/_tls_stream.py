"""TLS over trio for every server and client of the transport: the handshake of an
accepted connection (bounded in time, its failures counted and logged once per
burst with the peer and the reason), the text of a failed handshake, a bounded close
(a TLS close sends close_notify, which a peer that reads nothing could hold up for
ever), and the address of the socket under a stream.

Sendfile cannot go through TLS (no kernel TLS from Python): :func:`send_spans` sees
no ``socket`` on an ``SSLStream`` and reads stored bytes in a thread, then sends them.
"""

from __future__ import annotations

import logging
import socket
import ssl

import trio

from ._limits import Burst

log = logging.getLogger("clmq.tls")

CLOSE_TIMEOUT_S = 1.0  # a TLS close (close_notify) may take this long, then the socket is closed
TLS_QUIET_S = 5.0  # a burst of failed handshakes ends once a handshake has worked this long after the last failure
TLS_HANDSHAKE_RECORD = 0x16  # the first byte a TLS client sends (a handshake record: its ClientHello)


def socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    """The socket under ``stream`` (a ``SocketStream``, or an ``SSLStream`` over one)."""
    while True:
        sock: trio.socket.SocketType | None = getattr(stream, "socket", None)
        if sock is not None:
            return sock
        inner = getattr(stream, "transport_stream", None)
        if inner is None:
            return None
        stream = inner


def peer_of(stream: trio.abc.Stream) -> tuple[str, int]:
    """The peer's (host, port) of a socket stream, TLS or not; ("0.0.0.0", 0) if unknown."""
    sock = socket_of(stream)
    try:
        host, port = sock.getpeername()[:2] if sock is not None else ("0.0.0.0", 0)
    except OSError:
        host, port = "0.0.0.0", 0
    return str(host), int(port)


def describe_tls_error(e: BaseException | None) -> str:
    """What went wrong in a handshake, in words: ``certificate verify failed: certificate
    has expired``, ``tlsv1 alert unknown ca``, ``wrong version number``, ..."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {e.verify_message}"
    if isinstance(e, ssl.SSLError):
        reason = (e.reason or "").replace("_", " ").lower()
        if isinstance(e, ssl.SSLEOFError) or "eof" in (reason or str(e).lower()):
            return "the peer closed the connection during the handshake"
        if reason == "wrong version number" or reason == "http request":
            return f"{reason} (the peer does not speak TLS)"
        return reason or str(e)
    if isinstance(e, trio.BrokenResourceError):
        return describe_tls_error(e.__cause__) if e.__cause__ is not None else "the connection broke"
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e) if e is not None else "the connection broke"


async def send_alert(tls: trio.SSLStream[trio.SocketStream]) -> None:
    """After a failed handshake, send the alert OpenSSL wrote (``unknown ca``,
    ``certificate expired``, ...) so that the peer can log why: trio's SSLStream
    raises before sending it. Best effort, briefly; the caller closes the socket."""
    outgoing = getattr(tls, "_outgoing", None)  # trio's outgoing MemoryBIO (not public API)
    if not isinstance(outgoing, ssl.MemoryBIO) or not outgoing.pending:
        return
    with trio.move_on_after(CLOSE_TIMEOUT_S):
        try:
            await tls.transport_stream.send_all(outgoing.read())
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError):
            pass


async def close_stream(stream: trio.abc.AsyncResource, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Close ``stream`` whatever happens (shielded from cancellation): gracefully within
    ``timeout_s``, else forcefully."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(timeout_s):
            try:
                await stream.aclose()
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError):
                pass
        await trio.aclose_forcefully(stream)


class TlsHandshakes:
    """A listener's TLS handshakes: wraps accepted streams, counts and logs failures."""

    def __init__(
        self, name: str, context: ssl.SSLContext, timeout_ms: int, *, plaintext_reply: bytes | None = None
    ) -> None:
        self.name = name
        self.context = context
        self.timeout_s = timeout_ms / 1000
        # What a client that does not speak TLS is told before the connection closes
        # (in its own protocol: a clmq error frame), or None: closed without a word.
        self.plaintext_reply = plaintext_reply
        self.failures = 0
        self._burst = Burst(log, f"{name}: failed TLS handshakes")

    async def accept(self, stream: trio.SocketStream) -> trio.SSLStream[trio.SocketStream] | None:
        """``stream`` after a successful handshake, or None (the failure counted and
        logged; the caller closes ``stream``)."""
        tls = trio.SSLStream(stream, self.context, server_side=True, https_compatible=False)
        try:
            with trio.fail_after(self.timeout_s):
                first = await self._first_byte(stream)
                if first is None:
                    self.failed(stream, "the peer closed the connection before its handshake")
                    return None
                if first != TLS_HANDSHAKE_RECORD:
                    self.failed(stream, "the peer does not speak TLS (a plaintext client)")
                    await self._tell_plaintext(stream)
                    return None
                await tls.do_handshake()
        except trio.TooSlowError:
            self.failed(stream, f"no handshake within {self.timeout_s * 1000:.0f} ms")
            return None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            await send_alert(tls)
            self.failed(stream, describe_tls_error(e))
            return None
        if self._burst.count and trio.current_time() - self._burst.last_s > TLS_QUIET_S:
            self._burst.end()
        return tls

    @staticmethod
    async def _first_byte(stream: trio.SocketStream) -> int | None:
        """The first byte the client sent, left unread (None: it closed first)."""
        data = await stream.socket.recv(1, socket.MSG_PEEK)
        return data[0] if data else None

    async def _tell_plaintext(self, stream: trio.SocketStream) -> None:
        if self.plaintext_reply is None:
            return
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            try:
                await stream.send_all(self.plaintext_reply)
                await stream.send_eof()
                # Read what the client sent until it closes: closing a socket with unread
                # bytes resets the connection, and the client might lose the reply.
                while await stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    def failed(self, stream: trio.abc.Stream, reason: str) -> None:
        self.failures += 1
        host, port = peer_of(stream)
        self._burst.hit(f"{self.name}: TLS handshake with {host}:{port} failed: {reason}")
