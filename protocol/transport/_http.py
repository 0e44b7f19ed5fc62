"""A small HTTP/1.1 server on trio for what a service shows over HTTP: the Prometheus
``/metrics`` page and the dashboard's pages and JSON. GET and HEAD only, one request
per connection (``Connection: close``), every step bounded in time and size. HTTPS
when given an ``ssl.SSLContext`` (the service's TLS settings)."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import trio

log = logging.getLogger("clmq.http")

HTTP_MAX_REQUEST_HEAD_BYTES = 16 * 1024  # a request line and headers longer than this: 431
HTTP_REQUEST_TIMEOUT_S = 10.0  # reading the request and writing the answer, each
HTTP_MAX_CONNECTIONS = 64  # more at once wait for a slot (a scrape is rare, a dashboard polls)


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


Route = Callable[[HttpRequest], Awaitable[HttpResponse]]
REASONS = {
    200: "OK",
    400: "Bad Request",
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
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer every request with ``route`` until cancelled; reports the port it listens on
    (``port`` 0: any free port). ``tls``: HTTPS only (the handshake within the request's
    time bound; a failed one closes that connection alone)."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as e:  # say which port: a service may listen on several
        raise OSError(e.errno, f"cannot listen on {host}:{port} for the {name}: {e.strerror}") from e
    slots = trio.CapacityLimiter(HTTP_MAX_CONNECTIONS)
    bound = listeners[0].socket.getsockname()[1]
    log.info("%s: %s on %s:%d", name, "HTTP" if tls is None else "HTTPS", host, bound)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept, listener, route, slots, name, tls)
        task_status.started(bound)


async def _accept(
    listener: trio.SocketListener, route: Route, slots: trio.CapacityLimiter, name: str, tls: ssl.SSLContext | None
) -> None:
    async with trio.open_nursery() as nursery:
        while True:
            stream = await listener.accept()
            nursery.start_soon(_one, stream, route, slots, name, tls)


async def _one(
    tcp: trio.SocketStream, route: Route, slots: trio.CapacityLimiter, name: str, tls: ssl.SSLContext | None
) -> None:
    stream: trio.abc.Stream = tcp if tls is None else trio.SSLStream(tcp, tls, server_side=True, https_compatible=True)
    async with slots, stream:
        try:
            with trio.fail_after(HTTP_REQUEST_TIMEOUT_S):
                if isinstance(stream, trio.SSLStream):
                    await stream.do_handshake()
                request = await _read_request(stream)
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


async def _read_request(stream: trio.abc.Stream) -> HttpRequest | None:
    """The request line and headers (the body of a GET is ignored); None if malformed."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > HTTP_MAX_REQUEST_HEAD_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        data += chunk
    parts = data.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None
    url = urlsplit(parts[1])
    return HttpRequest(parts[0], url.path, {k: v[-1] for k, v in parse_qs(url.query).items()})


def _encode(response: HttpResponse, *, head_only: bool) -> bytes:
    head = (
        f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}\r\n"
        f"Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + (b"" if head_only else response.body)


def metrics_page(render: Callable[[], bytes], content_type: str) -> Route:
    """The route of a metrics port: ``GET /metrics`` answers ``render()``."""

    async def route(request: HttpRequest) -> HttpResponse:
        if request.path != "/metrics":
            return HttpResponse(404, b"try /metrics\n")
        return HttpResponse(200, render(), content_type)

    return route
