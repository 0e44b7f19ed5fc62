"""The storage facade: one CommitLog, its ConsumeQueues and the dispatcher behind a
narrow synchronous API (:class:`Store`), and the partition-per-file mode (Kafka's
layout, :class:`PartitionStore`) behind the same API. Both fulfil
:class:`StorageEngine`. No trio: background work runs in threads the store starts
and stops.
"""

from typing import TYPE_CHECKING

from ._base import STORAGE_MODES, StoreBase, StoreConfig, StoreLockedError
from ._durable_file import LoadedJson, MetadataSource, load_json, previous_path, read_json, write_atomic, write_json
from ._engine import StorageEngine
from ._partition_store import PartitionStore
from ._results import GetResult, GetStatus, PutResult, PutStatus, RawRead, Span
from ._store import Store
from ._topics import MAX_QUEUES_PER_TOPIC, TopicTable, topic_name_error

if TYPE_CHECKING:  # mypy checks here that both storage modes fulfil the contract

    def _conforms(one_log: Store, per_queue: PartitionStore) -> tuple[StorageEngine, StorageEngine]:
        return one_log, per_queue


__all__ = [
    "MAX_QUEUES_PER_TOPIC", "STORAGE_MODES", "GetResult", "GetStatus", "LoadedJson", "MetadataSource",
    "PartitionStore", "PutResult", "PutStatus", "RawRead", "Span", "StorageEngine", "Store", "StoreBase", "StoreConfig",
    "StoreLockedError", "TopicTable", "load_json", "previous_path", "read_json", "topic_name_error", "write_atomic",
    "write_json",
]  # fmt: skip
