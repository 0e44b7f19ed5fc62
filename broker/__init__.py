"""clmq's broker. The storage facade (:class:`Store`) is synchronous and trio-free;
the network service built on it lives in the broker's service modules.
"""

from ._results import GetResult, GetStatus, PutResult, PutStatus, RawRead, Span
from ._base import STORAGE_MODES, StoreBase, StoreConfig, StoreLockedError
from ._partition_store import PartitionStore
from ._store import Store
from ._topics import topic_name_error

__all__ = [
    "GetResult", "GetStatus", "PartitionStore", "PutResult", "PutStatus", "RawRead", "Span", "STORAGE_MODES", "Store", "StoreBase",
    "StoreConfig", "StoreLockedError",
    "topic_name_error",
]  # fmt: skip

from ._config import BrokerConfig  # noqa: E402  (the service layer, after the store)
from ._service import Broker, serve  # noqa: E402

__all__ += ["Broker", "BrokerConfig", "serve"]
