"""What a request handler sees and returns: the peer, the reply (fields and a body of
bytes or file spans), a deferred reply for serial requests, and errors that become
error replies. Shared by every service that serves over :class:`RpcServer`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from clmq.protocol import SUPPORTED_VERSIONS, ErrorCode, Frame, check_request

from ._errors import RequestError


class FileSpan(Protocol):
    path: str | None
    position: int
    length: int
    data: bytes | None


@dataclass
class Reply:
    """A handler's answer: fields, and a body given as bytes or as file spans."""

    fields: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""
    spans: list[Any] | None = None
    error_code: int = 0
    error_text: str = ""
    close_after: bool = False  # close the connection once this reply is sent (a peer that lied)


Deliver = Callable[["Reply | None"], None]


@dataclass
class Later:
    """A handler's answer for a *serial* request whose ordered part is done: the
    connection goes on to its next request while ``finish`` produces the reply.

    ``subscribe`` (optional) saves the task and the wait per request that ``finish``
    costs when the reply is usually known the moment some shared work completes (a
    produce: once the append lane stored its group). The connection calls
    ``subscribe(deliver)``; the handler arranges for ``deliver(reply)`` to be called
    once, on the event loop's thread, by whatever completes the work, or
    ``deliver(None)`` when the reply needs waiting after all (the connection then
    awaits ``finish()`` in a task, as without ``subscribe``).
    """

    finish: Callable[[], Awaitable[Reply]]
    subscribe: Callable[[Deliver], None] | None = None


@dataclass(eq=False)
class Session:
    """Who is at the other end of one connection, as far as the server knows:
    ``principal`` (``User:<name>``) once a login succeeded or a verified client
    certificate named a user; the login in progress (``exchange``); whether the
    connection is TLS. One per connection, shared by its requests."""

    principal: str | None = None
    tls: bool = False
    cert_user: str | None = None  # the common name of a verified client certificate (mutual TLS)
    exchange: Any = None  # a login in progress (a ScramServer)
    failed_logins: int = 0


@dataclass(frozen=True)
class Peer:
    host: str
    port: int
    session: Session = field(default_factory=Session, compare=False, hash=False)


Handler = Callable[[Frame, Peer], Awaitable["Reply | Later"]]


def need(fields: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A required request field of the given type, or a MALFORMED_REQUEST error."""
    value = fields.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise RequestError(
            ErrorCode.MALFORMED_REQUEST, f"field {name!r} missing or not {getattr(kind, '__name__', kind)}"
        )
    return value


def checked(handler: Handler) -> Handler:
    """``handler`` behind :func:`clmq.protocol.check_request`: a request of a protocol
    version this server does not speak, or with a field missing or of the wrong type
    or range, is answered (UNSUPPORTED_VERSION with the versions it does speak,
    MALFORMED_REQUEST naming the field) before it does anything. Every service wraps
    its handlers so."""

    async def check_then_handle(frame: Frame, peer: Peer) -> Reply | Later:
        problem = check_request(frame)
        if problem is None:
            return await handler(frame, peer)
        code, text = problem
        fields = {"versions": sorted(SUPPORTED_VERSIONS)} if code is ErrorCode.UNSUPPORTED_VERSION else {}
        return Reply(fields, error_code=code, error_text=text)

    return check_then_handle
