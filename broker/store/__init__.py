"""The storage facade: one CommitLog, its ConsumeQueues and the dispatcher behind a
narrow synchronous API (:class:`Store`), and the partition-per-file mode (Kafka's
layout, :class:`PartitionStore`) behind the same API. Both fulfil
:class:`StorageEngine`. No trio: background work runs in threads the store starts
and stops.
"""

from typing import TYPE_CHECKING

from clmq.commitlog import LoadedJson, MetadataSource, load_json, previous_path, read_json, write_atomic, write_json

from ._base import StoreBase
from ._check import (
    Damage,
    MetadataStatus,
    QueueFinding,
    StoreReport,
    check_store,
    detect_mode,
    log_bytes,
    store_lock,
)
from ._config import STORAGE_MODES, StoreConfig, StoreLockedError
from ._engine import StorageEngine
from ._key_index import INDEX_DIR, KeyMatches
from ._partition_store import PartitionStore
from ._repair import repair_store
from ._results import GetResult, GetStatus, PutResult, PutStatus, RawRead, Span
from ._store import Store
from ._topics import MAX_QUEUES_PER_TOPIC, TopicTable, topic_name_error

if TYPE_CHECKING:  # mypy checks here that both storage modes fulfil the contract

    def _conforms(one_log: Store, per_queue: PartitionStore) -> tuple[StorageEngine, StorageEngine]:
        return one_log, per_queue


__all__ = [
    "INDEX_DIR",
    "MAX_QUEUES_PER_TOPIC",
    "STORAGE_MODES",
    "Damage",
    "GetResult",
    "GetStatus",
    "KeyMatches",
    "LoadedJson",
    "MetadataSource",
    "MetadataStatus",
    "PartitionStore",
    "PutResult",
    "PutStatus",
    "QueueFinding",
    "RawRead",
    "Span",
    "StorageEngine",
    "Store",
    "StoreBase",
    "StoreConfig",
    "StoreLockedError",
    "StoreReport",
    "TopicTable",
    "check_store",
    "detect_mode",
    "load_json",
    "log_bytes",
    "previous_path",
    "read_json",
    "repair_store",
    "store_lock",
    "topic_name_error",
    "write_atomic",
    "write_json",
]
