"""The wire protocol over trio, shared by every service and client: the server loop
(:class:`RpcServer`: connections, frames to handlers, replies and zero-copy file
spans) and the client side (:class:`RpcClient`: connections by address, requests
matched to responses by id).

The layer between the sans-IO protocol (the ``protocol`` package, which never imports
this one) and the services built on it (broker, name server, clients).
"""

from ._access import (
    ADMIN_OPERATIONS,
    OPEN,
    AccessControl,
    LoginStats,
    Need,
    Rule,
    exposure_problem,
    is_loopback,
    open_audit_log,
    warn_if_anonymous,
)
from ._client import RpcClient, background_nursery, split_addr
from ._errors import AuthenticationFailed, ConnectionFailed, RequestError, RpcError
from ._handler import FileSpan, Handler, Later, Peer, Reply, Session, checked, need
from ._http import Collected, HttpRequest, HttpResponse, Login, metrics_page, rendered_in_thread, serve_http
from ._http_login import metrics_login, metrics_login_required
from ._limits import ServerLimits
from ._security import ClientSecurity
from ._server import RpcServer
from ._spans import send_spans
from ._stats import LATENCY_BUCKETS_S, CodeStats, RequestStats, cumulative_buckets
from ._tls import TlsSettings, TlsSettingsError, peer_identity, tls_settings, tls_settings_of
from ._tls_stream import TlsHandshakes, close_stream, describe_tls_error

__all__ = [
    "ADMIN_OPERATIONS",
    "LATENCY_BUCKETS_S",
    "OPEN",
    "AccessControl",
    "AuthenticationFailed",
    "ClientSecurity",
    "CodeStats",
    "Collected",
    "ConnectionFailed",
    "FileSpan",
    "Handler",
    "HttpRequest",
    "HttpResponse",
    "Later",
    "Login",
    "LoginStats",
    "Need",
    "Peer",
    "Reply",
    "RequestError",
    "RequestStats",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "Rule",
    "ServerLimits",
    "Session",
    "TlsHandshakes",
    "TlsSettings",
    "TlsSettingsError",
    "background_nursery",
    "checked",
    "close_stream",
    "cumulative_buckets",
    "describe_tls_error",
    "exposure_problem",
    "is_loopback",
    "metrics_login",
    "metrics_login_required",
    "metrics_page",
    "need",
    "open_audit_log",
    "peer_identity",
    "rendered_in_thread",
    "send_spans",
    "serve_http",
    "split_addr",
    "tls_settings",
    "tls_settings_of",
    "warn_if_anonymous",
]
