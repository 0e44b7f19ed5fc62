"""The transport's errors: a server that cannot be reached, a server's error answer,
and a handler's way to give one."""

from __future__ import annotations

from clmq.common import TransportError
from clmq.protocol import ErrorCode


class RpcError(TransportError):
    """The server answered a request with an error code."""

    def __init__(self, addr: str, code: int, text: str) -> None:
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"error {code}"
        super().__init__(f"{addr}: {name}: {text}")
        self.addr, self.code, self.text = addr, code, text


class ConnectionFailed(TransportError):
    """Could not reach a server, or the connection broke before the answer came."""


class RequestError(TransportError):
    """Raised by a handler to answer with an error code (and, with ``close``, to close
    the connection after the answer: a peer that broke the protocol's promises)."""

    def __init__(self, code: ErrorCode, text: str, *, close: bool = False) -> None:
        super().__init__(text)
        self.code, self.text, self.close = code, text, close


class AuthenticationFailed(ConnectionFailed):
    """A connection was made but its login (the SCRAM exchange of
    :class:`ClientSecurity`'s user) was refused, or the server could not prove it
    knows the user's credential. Not retried: the same login would fail again."""

    def __init__(self, addr: str, user: str, reason: str) -> None:
        super().__init__(f"login as {user!r} to {addr} failed: {reason}")
        self.addr, self.user, self.reason = addr, user, reason
