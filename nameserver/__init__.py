"""clmq's name server: where brokers register their topics and clients find them.
It serves over ``clmq.protocol.transport``'s :class:`~clmq.protocol.transport.RpcServer`."""

from ._routes import RouteTable
from ._service import NameServer, NameServerConfig, serve

__all__ = ["NameServer", "NameServerConfig", "RouteTable", "serve"]
