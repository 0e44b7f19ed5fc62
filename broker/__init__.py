"""clmq's broker. The storage facade (:class:`Store`) is synchronous and trio-free;
the network service built on it lives in the broker's service modules.
"""

from ._results import GetResult, GetStatus, PutResult, PutStatus
from ._store import Store, StoreConfig, StoreLockedError
from ._topics import topic_name_error

__all__ = [
    "GetResult", "GetStatus", "PutResult", "PutStatus", "Store", "StoreConfig", "StoreLockedError",
    "topic_name_error",
]  # fmt: skip
