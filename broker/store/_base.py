"""What both storage modes share: the store's API, :class:`StoreBase`, a facade over
parts as Kafka's ``UnifiedLog`` is over ``LocalLog`` and ``LogLoader``. The parts share
one :class:`~._state.StoreState` (the failed state, the durable offset, the topics) and
hold no reference to the store:

- :class:`~._lifecycle.Lifecycle`: the directory's lock and abort marker around an
  open, and the background threads, guarded;
- :class:`~._puts.PutPath`: the checks before a put, the mode's
  :class:`~._puts.Appender`, the wait for durability after;
- :class:`~._reads.Reads`: the arguments of reads, the early answers, many queues one
  by one, over the mode's :class:`~._reads.QueueSource`.

A mode sets ``_puts`` and ``_reads`` when it opens, and supplies the hooks left
abstract here: its background threads, closing its files, flushing, retention.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Callable, Collection, Iterable, Self, Sequence

from clmq.commitlog import DurableOffset, QueueKey
from clmq.common import CorruptRecordError, Message, MiB, PackedMessages, StoreFailedError

from ._config import StoreConfig
from ._lifecycle import Lifecycle
from ._puts import PutPath
from ._reads import ManyRead, ReadAsk, Reads, read_one_of_many, read_raw_to_damage
from ._results import GetResult, GetStatus, PutResult, RawRead
from ._state import StoreState
from ._topics import TopicTable


class StoreBase(ABC):
    """The store API of both modes over their parts (see the module docstring)."""

    topics: TopicTable  # set by :meth:`_begin_open`

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.directory = config.data_dir
        self._state = StoreState(config)
        self._life = Lifecycle(self._state)
        self._new_entries = threading.Condition()
        self._arrival_listeners: list[Callable[[Collection[QueueKey]], None]] = []
        self.open_stats: dict[str, float] = {}  # how long each phase of open took

    # ---------------------------------------------------------------- lifecycle
    def _begin_open(self) -> bool:
        """Lock the directory, mark it open, load the topics; True after an unclean stop."""
        unclean = self._life.begin_open()
        self.topics = self._state.topics
        return unclean

    @abstractmethod
    def start(self) -> StoreBase:
        """Start the mode's background threads; returns the store."""

    @property
    def failure(self) -> StoreFailedError | None:
        """Why the store failed (None: it has not); see :attr:`StoreState.failure`."""
        return self._state.failure

    def add_failure_listener(self, fn: Callable[[StoreFailedError], None]) -> None:
        """Call ``fn(failure)`` once, from the failing thread, when the store fails (the
        broker re-registers at once as unhealthy). Called at once if it already has."""
        self._state.add_failure_listener(fn)

    @property
    def healthy(self) -> bool:
        """False once a background thread failed (the broker reports itself unhealthy)."""
        return self.failure is None

    @abstractmethod
    def _wake_threads(self) -> None:
        """Make background threads notice ``stop`` now (each mode knows its own)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Clean shutdown: stop the threads, flush and checkpoint, remove the abort marker
        (unless something could not be written: then the next open validates)."""
        if self._state.closed:
            return
        self._state.closed = True
        self._life.stop_threads(self._wake_threads)
        if self.failure is not None:  # nothing written now can be trusted: recover at open
            self._release_files()
            self._life.end_close(clean=False)
            return
        self._life.end_close(self._close_files())

    def abandon(self) -> None:
        """Release files as a crash would: no flush, no checkpoint, abort marker left."""
        if self._state.closed:
            return
        self._state.closed = True
        self._life.stop_threads(self._wake_threads)
        self._release_files()
        self._life.end_close(clean=False)

    @abstractmethod
    def _close_files(self) -> bool:
        """Flush, checkpoint and close; True if everything was written."""

    @abstractmethod
    def _release_files(self) -> None:
        """Close the files without flushing or checkpointing (as a crash would)."""

    @abstractmethod
    def flush(self) -> int:
        """fsync what was appended; returns the durable offset."""

    @abstractmethod
    def catch_up(self) -> None:
        """Make everything written so far visible to readers before returning."""

    @abstractmethod
    def apply_retention(self, now: float | None = None) -> int:
        """Delete segments past retention; returns how many went."""

    # ------------------------------------------------------------------ topics
    def create_topic(self, topic: str, queue_count: int) -> None:
        self.topics.create(topic, queue_count)

    def delete_topic(self, topic: str) -> bool:
        """Forget a topic: it takes no more messages and serves no reads. Its records
        stay in the log until retention removes them."""
        return self.topics.delete(topic)

    def queue_exists(self, topic: str, queue_id: int) -> bool:
        return self.topics.has_queue(topic, queue_id)

    # --------------------------------------------------------------------- put
    # Set by the mode once it can append: the put path over its appender.
    _puts: PutPath

    @property
    def append_checks_fields(self) -> bool:
        """True if the mode's append checks every field itself (see :class:`~._puts.Appender`)."""
        return self._puts.append_checks_fields

    def put(self, message: Message, *, wait_durable: bool | None = None) -> PutResult:
        return self.put_batch([message], wait_durable=wait_durable)

    def put_batch(self, messages: Sequence[Message], *, wait_durable: bool | None = None) -> PutResult:
        """Append messages in order. With ``wait_durable`` (default:
        :attr:`CommitLogConfig.acks_wait_for_fsync`) return only once they are fsynced,
        or FLUSH_DISK_TIMEOUT."""
        return self._puts.put_batch(messages, wait_durable)

    def put_packed(self, batches: Sequence[PackedMessages], *, wait_durable: bool | None = None) -> PutResult:
        """Append packed messages (a producer's SEND_MESSAGE bodies, one topic each) in
        order, all or nothing, as :meth:`put_batch` does. The result's ``batch_sizes``
        counts each batch's messages (:meth:`PutResult.split`). Malformed bytes give
        MALFORMED_BATCH."""
        return self._puts.put_packed(batches, wait_durable)

    # -------------------------------------------------------------- durability
    def _durability(self) -> DurableOffset:
        """The durable offset the flusher publishes (group commit)."""
        return self._state.durable

    def wait_durable(self, offset: int, timeout_s: float) -> bool:
        """Block until everything up to ``offset`` (an ``end_offset``) is fsynced (group commit)."""
        return self._state.durable.wait(offset, timeout_s)

    def on_durable(self, offset: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` from the flusher once everything up to ``offset`` is fsynced."""
        self._state.durable.on_durable(offset, callback)

    @property
    def durable_offset(self) -> int:
        return self._state.durable.value

    @property
    @abstractmethod
    def end_offset(self) -> int:
        """Where the next append goes (the durability token of :meth:`wait_durable`)."""

    @property
    @abstractmethod
    def dispatch_lag_bytes(self) -> int:
        """Bytes written but not yet visible to readers."""

    # --------------------------------------------------------------------- get
    # Set by the mode once its queues can be read: the read API over them.
    _reads: Reads

    def min_offset(self, topic: str, queue_id: int) -> int:
        """The queue's first readable offset."""
        return self._reads.source.min_offset(topic, queue_id)

    def max_offset(self, topic: str, queue_id: int) -> int:
        """One past the queue's last readable message."""
        return self._reads.source.max_offset(topic, queue_id)

    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        """``(min offset, max offset)`` of an existing queue."""
        return self._reads.source.bounds(topic, queue_id)

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        """The first queue offset stored at or after ``timestamp_ms`` (max offset if none)."""
        return self._reads.source.offset_for_timestamp(topic, queue_id, timestamp_ms)

    def get(
        self, topic: str, queue_id: int, offset: int, max_messages: int = 32, tags: Iterable[str] | None = None
    ) -> GetResult:
        """Up to ``max_messages`` records from queue offset ``offset``, optionally only
        those whose tag is in ``tags``.

        Arguments of the wrong type or range (``max_messages`` < 1, an offset that is no
        int, ``tags`` that are not strings...) are a caller's bug: :class:`InvalidInputError`
        (a ValueError) naming the argument, before anything is read. An offset outside
        the queue is an answer: OFFSET_TOO_SMALL, NO_MESSAGE or OFFSET_OVERFLOW."""
        return self._reads.get(topic, queue_id, offset, max_messages, tags)

    def read_raw(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_messages: int = 32,
        tags: Iterable[str] | None = None,
        max_bytes: int = 4 * MiB,
    ) -> RawRead:
        """Like :meth:`get`, but the records as stored (file spans, for zero-copy sends);
        at most ``max_bytes`` unless the first record alone is larger. Bad arguments
        are refused as by :meth:`get`."""
        return self._reads.read_raw(topic, queue_id, offset, max_messages, tags, max_bytes)

    def read_raw_many(
        self, asks: Sequence[ReadAsk], max_messages: int, max_per_queue: int, max_bytes: int
    ) -> list[ManyRead]:
        """:meth:`read_raw` of many queues ``(topic, queue id, offset, tags or None)`` in
        the order given (Kafka's fetch): each up to ``max_per_queue`` records, all of
        them up to ``max_messages`` and ``max_bytes`` (except that a first record larger
        than it is answered alone: the reader must progress). Per ask its
        :class:`RawRead`; the :class:`CorruptRecordError` of a damaged record where the
        queue stands (the records before one further on are answered, as far as halving
        the limit reaches them; the other queues are read as usual); None for a queue
        not read (the request's bounds were reached: ask again)."""
        return self._reads.read_raw_many(asks, (max_messages, max_per_queue, max_bytes))

    def read_one_of_many(
        self, ask: ReadAsk, found: int, nbytes: int, max_messages: int, max_per_queue: int, max_bytes: int
    ) -> tuple[ManyRead, int, int]:
        """One step of :meth:`read_raw_many`: the ask's read after ``found`` records of
        ``nbytes``, and the counts after it."""
        return read_one_of_many(self._reads.read_raw, ask, found, nbytes, (max_messages, max_per_queue, max_bytes))

    def read_raw_to_damage(
        self, topic: str, queue_id: int, offset: int, limit: int, tags: Iterable[str] | None, max_bytes: int
    ) -> RawRead | CorruptRecordError:
        """:meth:`read_raw`, or the error of a damaged record at ``offset`` (the records
        before a damaged one further on are still served: see :func:`~._reads.read_raw_to_damage`)."""
        return read_raw_to_damage(self._reads.read_raw, topic, queue_id, offset, limit, tags, max_bytes)

    def check_get(self, topic: str, queue_id: int, offset: int) -> tuple[tuple[GetStatus, int] | None, int, int]:
        """``(None or (status, next offset) when there is nothing to read, min, max)``."""
        return self._reads.check_get(topic, queue_id, offset)

    def wait_for_entries(self, topic: str, queue_id: int, offset: int, timeout_s: float) -> bool:
        """Block until the queue's max offset exceeds ``offset`` (long polling, threads)."""
        with self._new_entries:
            return self._new_entries.wait_for(lambda: self.max_offset(topic, queue_id) > offset, timeout_s)

    def _notify_arrivals(self, keys: Collection[QueueKey]) -> None:
        with self._new_entries:
            self._new_entries.notify_all()
        for fn in self._arrival_listeners:
            fn(keys)

    def add_arrival_listener(self, fn: Callable[[Collection[QueueKey]], None]) -> None:
        """Call ``fn(keys)`` when queues get new messages readers can see (long polling)."""
        self._arrival_listeners = [*self._arrival_listeners, fn]
