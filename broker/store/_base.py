"""What both storage modes share: configuration, the store's lifecycle, topic checks,
and the shape of put/get. Each mode supplies appending, reading and recovery."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Iterable, Self, Sequence

from clmq.commitlog import BatchEncoder, CommitLogConfig, DurableOffset, QueueKey
from clmq.common import (
    ConfigError,
    CorruptRecordError,
    InvalidInputError,
    Message,
    MiB,
    PackedMessages,
    PackError,
    Record,
    StoreError,
    StoreFailedError,
    unpack_messages,
)

from ._checkpoint import AbortMarker
from ._results import GetResult, GetStatus, PutResult, PutStatus, RawRead, Span
from ._topics import TopicTable, topic_name_error

STORAGE_MODES = ("commitlog", "partition-per-file")

log = logging.getLogger("clmq.store")

ReadAsk = tuple[str, int, int, Iterable[str] | None]  # topic, queue id, offset, tags (None: all)
ManyRead = RawRead | CorruptRecordError | None  # a queue's read, its damage, or not read (bounds reached)


class StoreLockedError(StoreError):
    """Another process has the data directory open."""


@dataclass(frozen=True)
class StoreConfig:
    data_dir: Path
    commitlog: CommitLogConfig = field(default_factory=CommitLogConfig)
    storage_mode: str = "commitlog"  # or "partition-per-file" (Kafka's layout, for comparison)
    cq_entries_per_file: int = 300_000
    max_open_files: int = 1024
    cq_flush_interval_ms: int = 1000  # also: how often the checkpoint is written
    cq_flush_min_bytes: int = 4096  # a queue's new entries wait in memory until this many ...
    cq_full_flush_interval_ms: int = 10_000  # ... or until this long has passed (bounds memory: rate x 20 B x this)
    dispatch_chunk_bytes: int = 4 * MiB
    retention_check_interval_ms: int = 10_000
    max_scan_entries: int = 16_000  # per get, when a tag filter skips entries
    index_interval_bytes: int = 4096  # partition-per-file: one offset index entry per this many bytes
    auto_create_topics: bool = False
    default_queue_count: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.storage_mode not in STORAGE_MODES:
            raise ConfigError(f"storage_mode={self.storage_mode!r}: use one of {', '.join(STORAGE_MODES)}")


class Stopwatch:
    """Times the phases of opening a store, for the log and for benchmarks."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stats[name] = round(now - self._last, 4)
        self._last = now


class StoreBase(ABC):
    """Lifecycle and the mode-independent half of the store API; each mode supplies the
    abstract hooks (appending, durability, reading, background work)."""

    topics: TopicTable

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.directory = config.data_dir
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._new_entries = threading.Condition()
        # Checkpoints come from the housekeeping thread and from callers (open, close,
        # tests): one at a time, or two could race on the temporary file and the
        # older one could land last.
        self._checkpoint_lock = threading.Lock()
        self._lock_fd = -1
        self._arrival_listeners: list[Callable[[Collection[QueueKey]], None]] = []
        self._failure_listeners: list[Callable[[StoreFailedError], None]] = []
        self._fail_lock = threading.Lock()
        self.open_stats: dict[str, float] = {}  # how long each phase of open took
        self._abort = AbortMarker(self.directory)
        self._manifest: dict[QueueKey, tuple[int, int]] = {}  # checkpointed extents of queues not loaded
        self._failure: StoreFailedError | None = None  # set once by _fail(); final until reopened

    # ---------------------------------------------------------------- lifecycle
    def _begin_open(self) -> bool:
        """Lock the directory and mark it open; returns True after an unclean stop."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreLockedError(f"data directory {self.directory} is in use by another process") from None
        unclean = self._abort.was_unclean()
        self._abort.create()  # before loading: a crash while loading is an unclean stop too
        self.topics = TopicTable(self.directory / "topics.json")
        return unclean

    @abstractmethod
    def start(self) -> StoreBase:
        """Start the mode's background threads; returns the store."""

    def _start_threads(self, targets: list[tuple[str, Callable[[], None]]]) -> None:
        for name, target in targets:
            thread = threading.Thread(target=self._guarded, args=(name, target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _guarded(self, name: str, target: Callable[[], None]) -> None:
        """Run a background thread's loop; its death is the store's failure, never a silence."""
        try:
            target()
        except BaseException as e:
            self._fail(name, e)

    @property
    def failure(self) -> StoreFailedError | None:
        """Why the store failed (None: it has not). Final until reopened. Includes a
        failure of the log's durability: the flushing thread records it (releasing sync
        waiters) before the exception reaches the thread's guard and :meth:`_fail`, and a
        waiter released then must see a failed store, not a flush timeout."""
        failure = self._failure
        if failure is None:
            lost = self._durability().failure
            if lost is not None:
                return lost if isinstance(lost, StoreFailedError) else StoreFailedError("durability", lost)
        return failure

    def _fail(self, where: str, error: BaseException) -> None:
        """Put the store into the failed state: pending and later puts fail at once with
        STORE_FAILED, :attr:`failure` says why. The first failure is kept."""
        with self._fail_lock:  # two threads failing at once: one failure, listeners told once
            first = self._failure is None
            if first:
                # The log's own StoreFailedError already says where: not wrapped twice.
                self._failure = error if isinstance(error, StoreFailedError) else StoreFailedError(where, error)
        failure = self.failure
        assert failure is not None
        if first:
            log.error("%s", failure, exc_info=error)
        self._durability().fail(failure)
        if first:
            for fn in self._failure_listeners:
                fn(failure)

    def add_failure_listener(self, fn: Callable[[StoreFailedError], None]) -> None:
        """Call ``fn(failure)`` once, from the failing thread, when the store fails (the
        broker re-registers at once as unhealthy). Called at once if it already has."""
        self._failure_listeners = [*self._failure_listeners, fn]
        if self.failure is not None:
            fn(self.failure)

    @property
    def append_checks_fields(self) -> bool:
        """True if the mode's append refuses a message with a field of the wrong type or
        range before any side effect, so that put_batch need not check first (the check
        costs about 0.4 us a message, a sixth of a put). The CommitLog mode's does: its
        encoder checks every message before it takes a queue offset. The partition mode
        writes one queue's share before it encodes the next, so it is checked first."""
        return self.config.storage_mode == "commitlog"

    @property
    def healthy(self) -> bool:
        """False once a background thread failed (the broker reports itself unhealthy)."""
        return self.failure is None

    @abstractmethod
    def _wake_threads(self) -> None:
        """Make background threads notice ``_stop`` now (each mode knows its own)."""

    def _stop_threads(self) -> None:
        self._stop.set()
        self._wake_threads()
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _end_close(self, clean: bool) -> None:
        if clean:
            self._abort.remove()
        os.close(self._lock_fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Clean shutdown: stop the threads, flush and checkpoint, remove the abort marker
        (unless something could not be written: then the next open validates)."""
        if self._closed:
            return
        self._closed = True
        self._stop_threads()
        if self.failure is not None:  # nothing written now can be trusted: recover at open
            self._release_files()
            self._end_close(clean=False)
            return
        self._end_close(self._close_files())

    def abandon(self) -> None:
        """Release files as a crash would: no flush, no checkpoint, abort marker left."""
        if self._closed:
            return
        self._closed = True
        self._stop_threads()
        self._release_files()
        self._end_close(clean=False)

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
        count = self.topics.queue_count(topic)
        return count is not None and 0 <= queue_id < count

    def _queue_count(self, topic: object) -> tuple[int, PutResult | None]:
        error = topic_name_error(topic)
        if error:
            return 0, PutResult(PutStatus.INVALID_TOPIC, error)
        assert isinstance(topic, str)  # topic_name_error refuses anything else
        count = self.topics.queue_count(topic)
        if count is None:
            if not self.config.auto_create_topics:
                return 0, PutResult(PutStatus.UNKNOWN_TOPIC, f"topic {topic!r} does not exist")
            self.topics.create(topic, self.config.default_queue_count)
            count = self.config.default_queue_count
        return count, None

    def _check_put(self, messages: Sequence[Message]) -> PutResult | None:
        """Why this batch cannot be put (closed, failed, empty, a field of the wrong type or
        range, bad topic or queue), or None. Nothing is assigned before this passes."""
        if self._closed:
            return PutResult(PutStatus.STORE_CLOSED, "the store is closed")
        if self.failure is not None:
            return PutResult(PutStatus.STORE_FAILED, str(self.failure))
        if not messages:
            return PutResult(PutStatus.INVALID_MESSAGE, "empty batch")
        topics = _topics_of(messages)  # None: a topic that is no str (or no message at all)
        if topics is None or not self.append_checks_fields:  # every field, before any queue offset is taken
            invalid = BatchEncoder.batch_error(messages)
            if invalid is not None:
                return PutResult(PutStatus.INVALID_MESSAGE, invalid)
        counts: dict[str, int] = {}
        for topic in topics or ():  # per topic, not per message: the hot path
            counts[topic], bad = self._queue_count(topic)
            if bad is not None:
                return bad
        if len(counts) == 1:
            ((topic, count),) = counts.items()
            qids = [m.queue_id for m in messages]
            if all(type(q) is int for q in qids) and min(qids) >= 0 and max(qids) < count:
                return None
        for i, m in enumerate(messages):
            count = counts[m.topic]
            if type(m.queue_id) is not int:  # a bool, a float...: the field is wrong, not the queue
                return PutResult(PutStatus.INVALID_MESSAGE, BatchEncoder.batch_error(messages) or f"message {i}")
            if not 0 <= m.queue_id < count:
                return PutResult(
                    PutStatus.INVALID_QUEUE_ID, f"queue id {m.queue_id} not in 0..{count - 1} of topic {m.topic!r}"
                )
        return None

    # --------------------------------------------------------------------- put
    def put(self, message: Message, *, wait_durable: bool | None = None) -> PutResult:
        return self.put_batch([message], wait_durable=wait_durable)

    def put_batch(self, messages: Sequence[Message], *, wait_durable: bool | None = None) -> PutResult:
        """Append messages in order. With ``wait_durable`` (default: the flush mode is
        sync) return only once they are fsynced, or FLUSH_DISK_TIMEOUT."""
        bad = self._check_put(messages)
        if bad is not None:
            return bad
        return self._settle(self._append(messages), wait_durable)

    def put_packed(self, batches: Sequence[PackedMessages], *, wait_durable: bool | None = None) -> PutResult:
        """Append packed messages (a producer's SEND_MESSAGE bodies, one topic each) in
        order, all or nothing, as :meth:`put_batch` does. The result's ``batch_sizes``
        counts each batch's messages (:meth:`PutResult.split`). Malformed bytes give
        MALFORMED_BATCH."""
        if self._closed:
            return PutResult(PutStatus.STORE_CLOSED, "the store is closed")
        if self.failure is not None:
            return PutResult(PutStatus.STORE_FAILED, str(self.failure))
        counts = []
        for batch in batches:
            count, bad = self._queue_count(batch.topic)
            if bad is not None:
                return bad
            counts.append(count)
        return self._settle(self._append_packed(batches, counts), wait_durable)

    def _settle(self, result: PutResult, wait_durable: bool | None) -> PutResult:
        if wait_durable is None:
            wait_durable = self.config.commitlog.acks_wait_for_fsync
        if result.ok and wait_durable:
            timeout_ms = self.config.commitlog.sync_flush_timeout_ms
            if not self.wait_durable(result.end_offset, timeout_ms / 1000) and self.failure is not None:
                result.status = PutStatus.STORE_FAILED
                result.error = str(self.failure)
            elif self.durable_offset < result.end_offset:
                result.status = PutStatus.FLUSH_DISK_TIMEOUT
                result.error = f"not fsynced within sync_flush_timeout_ms={timeout_ms}"
        return result

    @abstractmethod
    def _append(self, messages: Sequence[Message]) -> PutResult:
        """Append a checked batch, all or nothing."""

    def _append_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int]) -> PutResult:
        """By default through message objects; the commit log appends packed bytes as they are."""
        try:
            unpacked = [unpack_messages(batch) for batch in batches]
        except PackError as e:
            return PutResult(PutStatus.MALFORMED_BATCH, str(e))
        messages = [m for ms in unpacked for m in ms]
        bad = self._check_put(messages)
        if bad is not None:
            return bad
        result = self._append(messages)
        result.batch_sizes = [len(ms) for ms in unpacked]
        return result

    @abstractmethod
    def _durability(self) -> DurableOffset:
        """The durable offset the flusher publishes (group commit)."""

    def wait_durable(self, offset: int, timeout_s: float) -> bool:
        """Block until everything up to ``offset`` (an ``end_offset``) is fsynced (group commit)."""
        return self._durability().wait(offset, timeout_s)

    def on_durable(self, offset: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` from the flusher once everything up to ``offset`` is fsynced."""
        self._durability().on_durable(offset, callback)

    @property
    def durable_offset(self) -> int:
        return self._durability().value

    @property
    @abstractmethod
    def end_offset(self) -> int:
        """Where the next append goes (the durability token of :meth:`wait_durable`)."""

    @property
    @abstractmethod
    def dispatch_lag_bytes(self) -> int:
        """Bytes written but not yet visible to readers."""

    # --------------------------------------------------------------------- get
    @abstractmethod
    def min_offset(self, topic: str, queue_id: int) -> int:
        """The queue's first readable offset."""

    @abstractmethod
    def max_offset(self, topic: str, queue_id: int) -> int:
        """One past the queue's last readable message."""

    @abstractmethod
    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        """The first queue offset stored at or after ``timestamp_ms`` (max offset if none)."""

    @abstractmethod
    def _read(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None
    ) -> tuple[list[Record], int]:
        """Records from ``offset`` on (tag-filtered) and the queue offset after the last one looked at."""

    def get(
        self, topic: str, queue_id: int, offset: int, max_messages: int = 32, tags: Iterable[str] | None = None
    ) -> GetResult:
        """Up to ``max_messages`` records from queue offset ``offset``, optionally only
        those whose tag is in ``tags``.

        Arguments of the wrong type or range (``max_messages`` < 1, an offset that is no
        int, ``tags`` that are not strings...) are a caller's bug: :class:`InvalidInputError`
        (a ValueError) naming the argument, before anything is read. An offset outside
        the queue is an answer: OFFSET_TOO_SMALL, NO_MESSAGE or OFFSET_OVERFLOW."""
        tag_set = check_get_args(topic, queue_id, offset, max_messages, tags, 1)
        early, lo, hi = self.check_get(topic, queue_id, offset)
        if early is not None:
            return GetResult(early[0], next_offset=early[1], min_offset=lo, max_offset=hi)
        messages, next_offset = self._read(topic, queue_id, offset, max_messages, tag_set)
        status = GetStatus.FOUND if messages else GetStatus.NO_MATCHED_MESSAGE
        return GetResult(status, messages, next_offset, lo, hi)

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
        tag_set = check_get_args(topic, queue_id, offset, max_messages, tags, max_bytes)
        early, lo, hi = self.check_get(topic, queue_id, offset)
        if early is not None:
            return RawRead(early[0], next_offset=early[1], min_offset=lo, max_offset=hi)
        spans, count, next_offset = self._read_raw(topic, queue_id, offset, max_messages, tag_set, max_bytes)
        return RawRead(GetStatus.FOUND if count else GetStatus.NO_MATCHED_MESSAGE, spans, count, next_offset, lo, hi)

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
        out: list[ManyRead] = []
        found = nbytes = 0
        for ask in asks:
            res, found, nbytes = self.read_one_of_many(ask, found, nbytes, max_messages, max_per_queue, max_bytes)
            out.append(res)
        return out

    def read_one_of_many(
        self, ask: ReadAsk, found: int, nbytes: int, max_messages: int, max_per_queue: int, max_bytes: int
    ) -> tuple[ManyRead, int, int]:
        """One step of :meth:`read_raw_many`: the ask's read after ``found`` records of
        ``nbytes``, and the counts after it."""
        topic, queue_id, offset, tags = ask
        if found >= max_messages or nbytes >= max_bytes:
            return None, found, nbytes
        limit = min(max_per_queue, max_messages - found)
        res = self.read_raw_to_damage(topic, queue_id, offset, limit, tags, max_bytes - nbytes)
        if not isinstance(res, RawRead):
            return res, found, nbytes
        if nbytes and nbytes + res.nbytes > max_bytes:  # its first record alone is past the bound: next time
            return None, found, max_bytes
        return res, found + res.count, nbytes + res.nbytes

    def read_raw_to_damage(
        self, topic: str, queue_id: int, offset: int, limit: int, tags: Iterable[str] | None, max_bytes: int
    ) -> RawRead | CorruptRecordError:
        """:meth:`read_raw`, or the error of a damaged record at ``offset``. A read that
        meets a damaged record further on is retried with half the limit until it
        stops before it, so that the records before the damage are still served."""
        while True:
            try:
                return self.read_raw(topic, queue_id, offset, limit, tags, max_bytes)
            except CorruptRecordError as e:
                if limit <= 1:
                    return e
                limit //= 2

    def check_get(self, topic: str, queue_id: int, offset: int) -> tuple[tuple[GetStatus, int] | None, int, int]:
        """``(None or (status, next offset) when there is nothing to read, min, max)``."""
        if not self.queue_exists(topic, queue_id):
            return (GetStatus.NO_QUEUE, 0), 0, 0
        lo, hi = self.bounds(topic, queue_id)
        if offset < lo:
            return (GetStatus.OFFSET_TOO_SMALL, lo), lo, hi
        if offset >= hi:
            return (GetStatus.NO_MESSAGE if offset == hi else GetStatus.OFFSET_OVERFLOW, min(offset, hi)), lo, hi
        return None, lo, hi

    @abstractmethod
    def _read_raw(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None, max_bytes: int
    ) -> tuple[list[Span], int, int]:
        """``(spans, record count, next queue offset)`` from ``offset`` on, within ``max_bytes``."""

    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        """``(min offset, max offset)`` of an existing queue."""
        return self.min_offset(topic, queue_id), self.max_offset(topic, queue_id)

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


def check_get_args(
    topic: object, queue_id: object, offset: object, max_messages: object, tags: object, max_bytes: object
) -> set[str] | None:
    """The tag set of a read, once every argument has its type and range; else
    :class:`InvalidInputError` naming the argument (a caller's bug, not an answer)."""
    if type(topic) is not str:
        raise InvalidInputError(f"read: 'topic' must be a str, got {type(topic).__name__}")
    for name, value, least in (
        ("queue_id", queue_id, None),
        ("offset", offset, None),
        ("max_messages", max_messages, 1),
        ("max_bytes", max_bytes, 1),
    ):
        if type(value) is not int or (least is not None and value < least):
            want = "an int" if least is None else f"an int >= {least}"
            raise InvalidInputError(f"read: {name!r} must be {want}, got {value!r:.40}")
    if tags is None:
        return None
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):  # a string would be its letters
        raise InvalidInputError(f"read: 'tags' must be None or an iterable of str, got {tags!r:.40}")
    tag_set = set(tags)
    if not all(type(t) is str for t in tag_set):
        raise InvalidInputError(f"read: 'tags' must hold only str, got {sorted(map(repr, tag_set))[:3]}")
    return tag_set


def _topics_of(messages: Sequence[Message]) -> set[str] | None:
    """The topics of a batch, or None if one is no string (unhashable, or no message)."""
    try:
        topics = {m.topic for m in messages}
    except (TypeError, AttributeError):
        return None
    return topics if all(type(t) is str for t in topics) else None
