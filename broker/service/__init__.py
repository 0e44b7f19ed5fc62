"""The broker as a network service: a :class:`~clmq.broker.store.StorageEngine` behind the
wire protocol (``clmq.protocol.transport``'s server), registered with every name server,
stopped gracefully within a deadline. Start it with :func:`serve`."""

from ._broker import Broker, open_store, serve
from ._config import BrokerConfig
from ._offsets import write_version_1 as write_offsets_version_1

__all__ = ["Broker", "BrokerConfig", "open_store", "serve", "write_offsets_version_1"]
