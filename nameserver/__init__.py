"""clmq's name server: where brokers register their topics and clients find them.

Also home of the server side of the wire protocol over trio (:class:`RpcServer`),
which the broker uses too.
"""

from ._routes import RouteTable
from ._server import Later, Peer, Reply, RequestError, RpcServer, need, send_spans
from ._service import NameServer, NameServerConfig, serve

__all__ = [
    "Later", "NameServer", "NameServerConfig", "Peer", "Reply", "RequestError", "RouteTable", "RpcServer", "need", "send_spans",
    "serve",
]  # fmt: skip
