"""clmq's name server: where brokers register their topics and clients find them.
It serves over ``protocol.transport``'s :class:`~protocol.transport.RpcServer`."""

from ._routes import RouteTable
from ._service import NameServer, NameServerConfig, serve

__all__ = ["NameServer", "NameServerConfig", "RouteTable", "serve"]
