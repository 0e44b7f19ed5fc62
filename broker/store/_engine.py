"""The contract of a storage engine: what the broker service, the benchmarks and the
command line may rely on, and what both storage modes (:class:`~clmq.broker.store.Store`,
one CommitLog; :class:`~clmq.broker.store.PartitionStore`, one log per queue) fulfil.

mypy checks the conformance of both modes (``broker/store/__init__.py``); the
contract suite (``tests/test_store.py`` and friends, run against both modes) checks
the behaviour behind it. Semantics every implementation keeps:

- *puts are results, never exceptions*: bad input, a full disk or a closed store come
  back as a :class:`PutResult` whose status says why, and then nothing was written;
- a batch is all or nothing, appended in order; queue offsets are dense per queue and
  never reused;
- ``end_offset`` is the durability token: ``wait_durable(end_offset)`` returns once
  everything put so far is fsynced (group commit);
- reads see what is dispatched (``max_offset``); ``get``/``read_raw`` below
  ``min_offset`` answer OFFSET_TOO_SMALL with the new minimum as ``next_offset``;
- the engine is thread-safe; its background threads start with ``start`` and stop with
  ``close`` (clean) or ``abandon`` (as a crash would).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Collection, Iterable, Protocol, Sequence, runtime_checkable

from clmq.commitlog import QueueKey
from clmq.common import CorruptRecordError, Message, PackedMessages, StoreFailedError

from ._config import StoreConfig
from ._reads import ManyRead, ReadAsk
from ._results import GetResult, PutResult, RawRead
from ._topics import TopicTable


@runtime_checkable
class StorageEngine(Protocol):
    """A storage engine: topics, puts, durable offsets and reads of queues."""

    config: StoreConfig
    directory: Path
    topics: TopicTable

    # lifecycle
    def start(self) -> StorageEngine: ...
    def close(self) -> None: ...
    def abandon(self) -> None: ...
    def flush(self) -> int: ...
    def catch_up(self) -> None: ...
    def apply_retention(self, now: float | None = None) -> int: ...

    # topics
    def create_topic(self, topic: str, queue_count: int) -> None: ...
    def delete_topic(self, topic: str) -> bool: ...
    def queue_exists(self, topic: str, queue_id: int) -> bool: ...

    # puts and durability
    def put(self, message: Message, *, wait_durable: bool | None = None) -> PutResult: ...
    def put_batch(self, messages: Sequence[Message], *, wait_durable: bool | None = None) -> PutResult: ...
    def put_packed(self, batches: Sequence[PackedMessages], *, wait_durable: bool | None = None) -> PutResult: ...
    def wait_durable(self, offset: int, timeout_s: float) -> bool: ...
    def on_durable(self, offset: int, callback: Callable[[], None]) -> None: ...
    @property
    def durable_offset(self) -> int: ...
    @property
    def end_offset(self) -> int: ...
    @property
    def dispatch_lag_bytes(self) -> int: ...

    # reads
    def min_offset(self, topic: str, queue_id: int) -> int: ...
    def max_offset(self, topic: str, queue_id: int) -> int: ...
    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]: ...
    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int: ...
    def get(
        self, topic: str, queue_id: int, offset: int, max_messages: int = 32, tags: Iterable[str] | None = None
    ) -> GetResult: ...
    def read_raw(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_messages: int = 32,
        tags: Iterable[str] | None = None,
        max_bytes: int = ...,
    ) -> RawRead: ...
    def read_raw_to_damage(
        self, topic: str, queue_id: int, offset: int, limit: int, tags: Iterable[str] | None, max_bytes: int
    ) -> RawRead | CorruptRecordError: ...
    def read_raw_many(
        self, asks: Sequence[ReadAsk], max_messages: int, max_per_queue: int, max_bytes: int
    ) -> list[ManyRead]: ...
    def wait_for_entries(self, topic: str, queue_id: int, offset: int, timeout_s: float) -> bool: ...
    def add_arrival_listener(self, fn: Callable[[Collection[QueueKey]], None]) -> None: ...

    # health: a failed background thread (an fsync error, ...) is a state, not a silence
    @property
    def failure(self) -> StoreFailedError | None: ...
    @property
    def healthy(self) -> bool: ...
    def add_failure_listener(self, fn: Callable[[StoreFailedError], None]) -> None: ...
