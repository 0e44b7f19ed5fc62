"""The wire protocol over trio, shared by every service and client: the server loop
(:class:`RpcServer`: connections, frames to handlers, replies and zero-copy file
spans) and the client side (:class:`RpcClient`: connections by address, requests
matched to responses by id).

The layer between the sans-IO protocol (the ``protocol`` package, which never imports
this one) and the services built on it (broker, name server, clients).
"""

from ._client import RpcClient, background_nursery, split_addr
from ._errors import ConnectionFailed, RequestError, RpcError
from ._handler import FileSpan, Handler, Later, Peer, Reply, Session, checked, need
from ._tls import TlsSettings, TlsSettingsError, peer_identity, tls_settings
from ._http import HttpRequest, HttpResponse, metrics_page, serve_http
from ._limits import ServerLimits
from ._server import RpcServer
from ._spans import send_spans
from ._stats import LATENCY_BUCKETS_S, CodeStats, RequestStats, cumulative_buckets

__all__ = [
    "LATENCY_BUCKETS_S",
    "CodeStats",
    "ConnectionFailed",
    "FileSpan",
    "Handler",
    "HttpRequest",
    "HttpResponse",
    "Later",
    "Peer",
    "Reply",
    "RequestError",
    "RequestStats",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "ServerLimits",
    "Session",
    "TlsSettings",
    "TlsSettingsError",
    "background_nursery",
    "checked",
    "cumulative_buckets",
    "metrics_page",
    "need",
    "peer_identity",
    "send_spans",
    "serve_http",
    "split_addr",
    "tls_settings",
]
