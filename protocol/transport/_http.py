"""A small HTTP/1.1 server on trio for what a service shows over HTTP: the Prometheus
``/metrics`` page and the dashboard's pages and JSON. GET and HEAD only, one request
per connection (``Connection: close``), every step bounded in time and size. HTTPS
when given an ``ssl.SSLContext`` (the service's TLS settings). Logins, when given a
``login`` function: HTTP Basic (RFC 7617), the only header read; a request without
credentials that ``login`` accepts is answered 401 and nothing else. Basic sends the
password with every request, base64 but in clear: serve HTTPS where it matters."""

from __future__ import annotations

import base64
import binascii
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import parse_qs, urlsplit

import trio

log = logging.getLogger("clmq.http")

HTTP_MAX_REQUEST_HEAD_BYTES = 16 * 1024  # a request line and headers longer than this: 431
HTTP_REQUEST_TIMEOUT_S = 10.0  # reading the request and writing the answer, each
HTTP_MAX_CONNECTIONS = 64  # more at once wait for a slot (a scrape is rare, a dashboard polls)
HTTP_MAX_AUTHORIZATION_BYTES = 1024  # a longer Authorization header is no login
HTTP_LOGIN_TIMEOUT_S = 30.0  # a login function that takes longer refuses (its failure delay included)
BASIC_CHALLENGE = (("WWW-Authenticate", 'Basic realm="clmq"'),)


@dataclass
class HttpRequest:
    method: str
    path: str
    query: dict[str, str]


@dataclass
class HttpResponse:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()  # more header lines


Route = Callable[[HttpRequest], Awaitable[HttpResponse]]
# (user, password, the peer's host) -> whether that login may see the pages. It slows,
# counts and logs a failure itself (with the peer's address).
Login = Callable[[str, str, str], Awaitable[bool]]
REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


async def serve_http(
    host: str,
    port: int,
    route: Route,
    name: str = "http",
    *,
    tls: ssl.SSLContext | None = None,
    login: Login | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer every request with ``route`` until cancelled; reports the port it listens on
    (``port`` 0: any free port). ``tls``: HTTPS only (the handshake within the request's
    time bound; a failed one closes that connection alone). ``login``: every request
    needs HTTP Basic credentials it accepts, else 401 with ``WWW-Authenticate: Basic
    realm="clmq"``."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as e:  # say which port: a service may listen on several
        raise OSError(e.errno, f"cannot listen on {host}:{port} for the {name}: {e.strerror}") from e
    slots = trio.CapacityLimiter(HTTP_MAX_CONNECTIONS)
    bound = listeners[0].socket.getsockname()[1]
    log.info("%s: %s on %s:%d%s", name, "HTTP" if tls is None else "HTTPS", host, bound, " (login)" if login else "")
    serving = _Serving(route, slots, name, tls, login)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept, listener, serving)
        task_status.started(bound)


@dataclass(frozen=True)
class _Serving:
    route: Route
    slots: trio.CapacityLimiter
    name: str
    tls: ssl.SSLContext | None
    login: Login | None


async def _accept(listener: trio.SocketListener, serving: _Serving) -> None:
    async with trio.open_nursery() as nursery:
        while True:
            stream = await listener.accept()
            nursery.start_soon(_one, stream, serving)


async def _one(tcp: trio.SocketStream, serving: _Serving) -> None:
    tls, route, name = serving.tls, serving.route, serving.name
    stream: trio.abc.Stream = tcp if tls is None else trio.SSLStream(tcp, tls, server_side=True, https_compatible=True)
    async with serving.slots, stream:
        try:
            with trio.fail_after(HTTP_REQUEST_TIMEOUT_S):
                if isinstance(stream, trio.SSLStream):
                    await stream.do_handshake()
                request, credentials = await _read_request(stream)
            if (
                serving.login is not None
                and request is not None
                and not await _logged_in(serving.login, credentials, tcp)
            ):
                response = HttpResponse(401, b"login required\n", headers=BASIC_CHALLENGE)
            else:
                response = await _respond(request, route, name)
            with trio.fail_after(HTTP_REQUEST_TIMEOUT_S):
                await stream.send_all(_encode(response, head_only=request is not None and request.method == "HEAD"))
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # a client that went away or stalled: nothing to answer


async def _respond(request: HttpRequest | None, route: Route, name: str) -> HttpResponse:
    if request is None:
        return HttpResponse(400, b"bad request\n")
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(405, b"GET or HEAD only\n")
    try:
        return await route(request)
    except Exception as e:  # a page's bug answers 500, it does not take the server down
        log.exception("%s: %s failed", name, request.path)
        return HttpResponse(500, f"{type(e).__name__}: {e}\n".encode())


async def _logged_in(login: Login, credentials: tuple[str, str] | None, tcp: trio.SocketStream) -> bool:
    """Whether ``credentials`` (HTTP Basic, if any) log in; ``login`` slows, counts and
    logs a refusal (a request without credentials is no attempt: a browser's first)."""
    if credentials is None:
        return False
    try:
        host = str(tcp.socket.getpeername()[0])
    except OSError:
        return False
    with trio.move_on_after(HTTP_LOGIN_TIMEOUT_S):
        try:
            return await login(*credentials, host)
        except Exception:  # a login's bug refuses that request, it does not take the server down
            log.exception("login of %s from %s failed", credentials[0][:64], host)
            return False
    return False


async def _read_request(stream: trio.abc.Stream) -> tuple[HttpRequest | None, tuple[str, str] | None]:
    """The request line and, of the headers, the Basic credentials (user, password) of
    ``Authorization``; (None, None) if malformed. The body of a GET is ignored."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > HTTP_MAX_REQUEST_HEAD_BYTES:
            return None, None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None, None
        data += chunk
    lines = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    parts = lines[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None, None
    url = urlsplit(parts[1])
    credentials = None
    for line in lines[1:]:
        field, sep, value = line.partition(b":")
        if sep and field.strip().lower() == b"authorization":
            credentials = basic_credentials(value)
            break
    return HttpRequest(parts[0], url.path, {k: v[-1] for k, v in parse_qs(url.query).items()}), credentials


def basic_credentials(value: bytes) -> tuple[str, str] | None:
    """(user, password) of an ``Authorization: Basic <base64 of user:password>`` value
    (UTF-8, RFC 7617); None for anything else or longer than the bound."""
    if len(value) > HTTP_MAX_AUTHORIZATION_BYTES:
        return None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    if not sep or not user:
        return None
    return user, password


def _encode(response: HttpResponse, *, head_only: bool) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in response.headers)
    head = (
        f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}\r\n"
        f"Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
        f"{extra}Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + (b"" if head_only else response.body)


def metrics_page(render: Callable[[], bytes | Awaitable[bytes]], content_type: str) -> Route:
    """The route of a metrics port: ``GET /metrics`` answers ``render()``, awaited when
    it is async (as :func:`rendered_in_thread`'s renderers are)."""

    async def route(request: HttpRequest) -> HttpResponse:
        if request.path != "/metrics":
            return HttpResponse(404, b"try /metrics\n")
        body = render()
        return HttpResponse(200, body if isinstance(body, bytes) else await body, content_type)

    return route


M = TypeVar("M")


class Collected(Generic[M]):
    """Metric families already collected, in the shape a text renderer reads (``collect()``)."""

    def __init__(self, families: list[M]) -> None:
        self.families = families

    def collect(self) -> list[M]:
        """The families, as collected."""
        return self.families


def rendered_in_thread(
    collect: Callable[[], Iterable[M]], render: Callable[[Collected[M]], bytes]
) -> Callable[[], Awaitable[bytes]]:
    """A renderer for :func:`metrics_page`: ``collect()`` reads the service's state on
    its event loop (a consistent snapshot, no locks), ``render`` turns the families into
    text in a worker thread. Rendering 10,000 series takes about 45 ms of CPU: on the
    loop, that was a stall of every request behind it (docs/operations.md "Event-loop
    stalls")."""

    async def rendered() -> bytes:
        families = Collected(list(collect()))
        return await trio.to_thread.run_sync(render, families)

    return rendered
