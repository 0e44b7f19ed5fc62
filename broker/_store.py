"""The store: one CommitLog, its ConsumeQueues and the dispatcher, behind a narrow API.

This API (put, put_batch, get, offsets, flush, close) is what the broker uses and what
the partition-per-file mode implements too. It is synchronous and thread-safe; its
background work (flushing, dispatching, checkpoints, retention) runs in threads that
:meth:`Store.start` starts and :meth:`Store.close` stops.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from commitlog import (
    OFF_STORE_TS, CommitLog, CommitLogConfig, FlushMode, Message, MiB, QueueKey, Record, StoreError, decode_record,
)
from consumequeue import ENTRY_DTYPE, ConsumeQueueSet, Dispatcher, tag_hash

from ._checkpoint import AbortMarker, Checkpoint
from ._recovery import recover_queues
from ._results import GetResult, GetStatus, PutResult, PutStatus
from ._topics import TopicTable, topic_name_error

log = logging.getLogger("clmq.store")


class _Stopwatch:
    """Times the phases of opening a store, for the log and for benchmarks."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stats[name] = round(now - self._last, 4)
        self._last = now


class StoreLockedError(StoreError):
    """Another process has the data directory open."""


@dataclass(frozen=True)
class StoreConfig:
    data_dir: Path
    commitlog: CommitLogConfig = field(default_factory=CommitLogConfig)
    cq_entries_per_file: int = 300_000
    max_open_files: int = 1024
    cq_flush_interval_ms: int = 1000
    dispatch_chunk_bytes: int = 4 * MiB
    retention_check_interval_ms: int = 10_000
    max_scan_entries: int = 16_000  # per get, when a tag filter skips entries
    auto_create_topics: bool = False
    default_queue_count: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))


class Store:
    """Open with :meth:`open`, then :meth:`start` the background threads."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.directory = config.data_dir
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._new_entries = threading.Condition()
        self._lock_fd = -1
        self._arrival_listeners: list[Callable[[set[QueueKey]], None]] = []
        self.open_stats: dict[str, float] = {}  # how long each phase of open took

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def open(cls, config: StoreConfig) -> "Store":
        """Open the data directory, recovering from an unclean stop if there was one."""
        self = cls(config)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_directory()
        clock = _Stopwatch()
        abort = AbortMarker(self.directory)
        checkpoint = Checkpoint.load(self.directory / "checkpoint")
        unclean = abort.was_unclean() or checkpoint is None
        abort.create()  # before loading: a crash while loading is an unclean stop too
        self.log = CommitLog.open(self.directory / "commitlog", config.commitlog, clean=not unclean,
                                  checkpoint_offset=checkpoint.log_durable if checkpoint else None)  # fmt: skip
        clock.lap("log_open_s")
        self.topics = TopicTable(self.directory / "topics.json")
        self.queues = ConsumeQueueSet(self.directory / "consumequeue", config.cq_entries_per_file, config.max_open_files)
        start = recover_queues(self.log, self.queues, checkpoint, unclean)
        clock.lap("queue_check_s")
        self.dispatcher = Dispatcher(self.log, self.queues, start, config.dispatch_chunk_bytes)
        self.dispatcher.add_listener(self._on_dispatched)
        clock.stats["redispatched_records"] = self.dispatcher.catch_up()  # serve nothing until queues agree with the log
        clock.lap("redispatch_s")
        table = self.queues.next_offsets()
        if checkpoint is not None and not unclean:
            for key, (_first, nxt) in checkpoint.queues.items():  # queues whose records all expired
                table[key] = max(table.get(key, 0), nxt)
        self.log.set_queue_offset_table(table)
        self._abort = abort
        try:
            self.checkpoint()
        except OSError as e:  # e.g. disk full: entries stay in memory until there is room
            log.warning("store open: could not write consume queues yet: %s", e)
        clock.lap("queue_files_s")
        self.open_stats = {"unclean": unclean, **clock.stats}
        log.info("store opened (%s): %s", "after an unclean stop" if unclean else "clean", self.open_stats)
        return self

    def _lock_directory(self) -> None:
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreLockedError(f"data directory {self.directory} is in use by another process") from None

    def start(self) -> "Store":
        """Start flushing, dispatching and housekeeping in background threads."""
        for name, target in (
            ("clmq-flush", lambda: self.log.run_flusher(self._stop)),
            ("clmq-dispatch", lambda: self.dispatcher.run(self._stop)),
            ("clmq-housekeeping", self._housekeeping),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _stop_threads(self) -> None:
        self._stop.set()
        self.dispatcher.wake()
        self.log.wake_flusher()
        for thread in self._threads:
            thread.join()
        self._threads = []

    def close(self) -> None:
        """Clean shutdown: dispatch the rest, flush everything, remove the abort marker."""
        if self._closed:
            return
        self._closed = True
        self._stop_threads()
        self.dispatcher.catch_up()
        self.log.flush()
        try:
            self.checkpoint(sync=True)
            self.queues.close()
            clean = True
        except OSError as e:  # the log is durable; the queues get rebuilt from it at open
            log.error("store close: could not write consume queues (%s); next open will rebuild them", e)
            self.queues.files.close()
            clean = False
        self.log.close()
        if clean:
            self._abort.remove()
        os.close(self._lock_fd)

    def abandon(self) -> None:
        """Release files as a crash would: no flush, no checkpoint, abort marker left."""
        if self._closed:
            return
        self._closed = True
        self._stop_threads()
        self.queues.files.close()
        self.log.abandon()
        os.close(self._lock_fd)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- background
    def checkpoint(self, sync: bool = False) -> Checkpoint:
        """Write queue entries to their files and record what is on disk.

        Raises OSError (disk full) with nothing lost: entries that could not be written
        stay in memory and the previous checkpoint stays in force.
        """
        dispatched = self.dispatcher.dispatched_offset  # read first: entries below it are in memory
        expected = self.queues.extents()
        self.queues.flush(sync=sync)
        cp = Checkpoint(self.log.durable_offset, dispatched, expected)
        cp.save(self.directory / "checkpoint")
        return cp

    def _housekeeping(self) -> None:
        interval = self.config.cq_flush_interval_ms / 1000
        every = max(1, self.config.retention_check_interval_ms // self.config.cq_flush_interval_ms)
        rounds = 0
        while not self._stop.wait(interval):
            try:
                self.checkpoint()
                rounds += 1
                if rounds % every == 0:
                    self.apply_retention()
            except OSError as e:
                log.warning("store housekeeping: %s; retrying in %d ms", e, self.config.cq_flush_interval_ms)

    def apply_retention(self, now: float | None = None) -> int:
        """Delete expired log segments and the queue files that only point into them."""
        deleted = self.log.delete_expired(now)
        if deleted:
            for key in self.queues.known():
                self.queues.queue(*key).delete_before(self.log.min_offset)
        return deleted

    def _on_dispatched(self, keys: set[QueueKey]) -> None:
        with self._new_entries:
            self._new_entries.notify_all()
        for fn in self._arrival_listeners:
            fn(keys)

    def add_arrival_listener(self, fn: Callable[[set[QueueKey]], None]) -> None:
        """Call ``fn(keys)`` from the dispatch thread when queues get new entries (long polling)."""
        self._arrival_listeners = [*self._arrival_listeners, fn]

    # ------------------------------------------------------------------ topics
    def create_topic(self, topic: str, queue_count: int) -> None:
        self.topics.create(topic, queue_count)

    def _queue_count(self, topic: object) -> tuple[int, PutResult | None]:
        error = topic_name_error(topic)
        if error:
            return 0, PutResult(PutStatus.INVALID_TOPIC, error)
        count = self.topics.queue_count(topic)  # type: ignore[arg-type]
        if count is None:
            if not self.config.auto_create_topics:
                return 0, PutResult(PutStatus.UNKNOWN_TOPIC, f"topic {topic!r} does not exist")
            self.topics.create(topic, self.config.default_queue_count)  # type: ignore[arg-type]
            count = self.config.default_queue_count
        return count, None

    def _check_targets(self, messages: Sequence[Message]) -> PutResult | None:
        """Topics exist and queue ids are in range; checked per topic, not per message."""
        counts: dict[str, int] = {}
        for topic in {m.topic for m in messages}:
            counts[topic], bad = self._queue_count(topic)
            if bad is not None:
                return bad
        if len(counts) == 1:
            (topic, count), = counts.items()
            qids = [m.queue_id for m in messages]
            if all(type(q) is int for q in qids) and 0 <= min(qids) and max(qids) < count:
                return None
        for m in messages:
            count = counts[m.topic]
            if type(m.queue_id) is not int or not 0 <= m.queue_id < count:
                return PutResult(PutStatus.INVALID_QUEUE_ID, f"queue id {m.queue_id} not in 0..{count - 1} of topic {m.topic!r}")
        return None

    # --------------------------------------------------------------------- put
    def put(self, message: Message, *, wait_durable: bool | None = None) -> PutResult:
        return self.put_batch([message], wait_durable=wait_durable)

    def put_batch(self, messages: Sequence[Message], *, wait_durable: bool | None = None) -> PutResult:
        """Append messages in order. With ``wait_durable`` (default: the flush mode is
        sync) return only once they are fsynced, or FLUSH_DISK_TIMEOUT."""
        if self._closed:
            return PutResult(PutStatus.STORE_CLOSED, "the store is closed")
        if not messages:
            return PutResult(PutStatus.INVALID_MESSAGE, "empty batch")
        bad = self._check_targets(messages)
        if bad is not None:
            return bad
        result = PutResult.from_append(self.log.append(messages))
        if wait_durable is None:
            wait_durable = self.config.commitlog.flush_mode is FlushMode.SYNC
        if result.ok and wait_durable:
            if not self.log.wait_durable(result.end_offset, self.config.commitlog.sync_flush_timeout_ms / 1000):
                result.status = PutStatus.FLUSH_DISK_TIMEOUT
                result.error = f"not fsynced within sync_flush_timeout_ms={self.config.commitlog.sync_flush_timeout_ms}"
        return result

    def flush(self) -> int:
        """fsync the log now; returns the durable offset."""
        return self.log.flush()

    def truncate(self, offset: int) -> None:
        """Durably cut the log at ``offset`` (a record boundary) and everything derived
        from it: queue entries past it go, and the queue offsets are recomputed so the
        next message of each queue continues right after its last surviving one.

        For replication: a follower that diverged from its leader cuts back to where
        they agree. Callers must not append concurrently.
        """
        self.dispatcher.catch_up()  # every queue is complete up to here, then cut
        self.log.truncate(offset)
        for key in self.queues.known():
            self.queues.queue(*key).truncate_past(self.log.write_offset)
        self.dispatcher.dispatched_offset = min(self.dispatcher.dispatched_offset, self.log.write_offset)
        self.log.set_queue_offset_table(self.queues.next_offsets())

    # --------------------------------------------------------------------- get
    def min_offset(self, topic: str, queue_id: int) -> int:
        return self.queues.queue(topic, queue_id).min_offset(self.log.min_offset)

    def max_offset(self, topic: str, queue_id: int) -> int:
        """One past the last dispatched message of the queue."""
        return self.queues.queue(topic, queue_id).next_offset

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        """The first queue offset stored at or after ``timestamp_ms`` (max offset if none)."""
        cq = self.queues.queue(topic, queue_id)
        log_min = self.log.min_offset

        def stored_at_or_after(entry: tuple[int, int, int]) -> bool:
            if entry[0] < log_min:
                return False
            raw = self.log.read_bytes(entry[0] + OFF_STORE_TS, 8)
            return raw is not None and struct.unpack("<Q", raw)[0] >= timestamp_ms

        return cq.search(stored_at_or_after)

    def queue_exists(self, topic: str, queue_id: int) -> bool:
        count = self.topics.queue_count(topic)
        return count is not None and 0 <= queue_id < count

    def get(self, topic: str, queue_id: int, offset: int, max_messages: int = 32,
            tags: Iterable[str] | None = None) -> GetResult:  # fmt: skip
        """Up to ``max_messages`` records from ``offset``, optionally only those whose tag
        is in ``tags`` (filtered by hash on the entries, re-checked on the records)."""
        if not self.queue_exists(topic, queue_id):
            return GetResult(GetStatus.NO_QUEUE)
        lo, hi = self.min_offset(topic, queue_id), self.max_offset(topic, queue_id)
        if offset < lo:
            return GetResult(GetStatus.OFFSET_TOO_SMALL, next_offset=lo, min_offset=lo, max_offset=hi)
        if offset >= hi:
            status = GetStatus.NO_MESSAGE if offset == hi else GetStatus.OFFSET_OVERFLOW
            return GetResult(status, next_offset=hi if offset > hi else offset, min_offset=lo, max_offset=hi)
        tag_set = set(tags) if tags is not None else None
        scan = max_messages if tag_set is None else max(max_messages, self.config.max_scan_entries)
        at, raw = self.queues.queue(topic, queue_id).read(offset, scan)
        picked, next_offset = self._select(at, raw, max_messages, tag_set)
        messages = [r for r in self._read_records(picked) if tag_set is None or r.tags in tag_set]
        status = GetStatus.FOUND if messages else GetStatus.NO_MATCHED_MESSAGE
        return GetResult(status, messages, next_offset, lo, hi)

    def _select(self, at: int, raw: bytes, max_messages: int, tag_set: set[str] | None) -> tuple[np.ndarray, int]:
        entries = np.frombuffer(raw, ENTRY_DTYPE)
        mask = (entries["size"] > 0) & (entries["offset"] >= self.log.min_offset)
        if tag_set is not None:
            mask &= np.isin(entries["tag"], np.array([tag_hash(t) for t in tag_set], dtype=np.uint64))
        idx = np.flatnonzero(mask)[:max_messages]
        next_offset = at + (int(idx[-1]) + 1 if len(idx) == max_messages else len(entries))
        return entries[idx], next_offset

    def _read_records(self, picked: np.ndarray) -> list[Record]:
        """Read picked records, coalescing runs that are contiguous in the log."""
        out: list[Record] = []
        offsets, sizes = picked["offset"].tolist(), picked["size"].tolist()
        i = 0
        while i < len(offsets):
            j = i + 1
            while j < len(offsets) and offsets[j] == offsets[j - 1] + sizes[j - 1] and offsets[j] - offsets[i] < 4 * MiB:
                j += 1
            start, end = offsets[i], offsets[j - 1] + sizes[j - 1]
            data = self.log.read_bytes(start, end - start)
            if data is None:  # fell out of retention while we looked
                i = j
                continue
            where = self.log.segment_path(start)
            for k in range(i, j):
                out.append(decode_record(data, offsets[k] - start, where, offsets[k]))
            i = j
        return out

    def wait_for_entries(self, topic: str, queue_id: int, offset: int, timeout_s: float) -> bool:
        """Block until the queue's max offset exceeds ``offset`` (long polling, threads)."""
        cq = self.queues.queue(topic, queue_id)
        with self._new_entries:
            return self._new_entries.wait_for(lambda: cq.next_offset > offset, timeout_s)

    @property
    def dispatch_lag_bytes(self) -> int:
        return self.dispatcher.lag_bytes

