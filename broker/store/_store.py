"""The store: one CommitLog, its ConsumeQueues and the dispatcher, behind a narrow API.

This API (put, put_batch, get, offsets, flush, close) is what the broker uses and what
the partition-per-file mode implements too. It is synchronous and thread-safe; its
background work (flushing, dispatching, checkpoints, retention) runs in threads that
:meth:`Store.start` starts and :meth:`Store.close` stops.

Invariants:
- Nothing is served that the open did not check: a clean open passes the checkpoint's
  durable offset to the log as its expected end, and queue files are checked against
  the checkpoint (``_recovery``). Log bytes that are gone raise
  :class:`LogDamageError` naming the affected queues and offsets, after the directory
  lock is released (for ``clmq store repair``); nothing is cut implicitly.
- Every record returned through a queue entry is that queue's: :meth:`Store.get`
  decodes it (CRC checked) and checks size, commit-log offset, topic, queue id and
  queue offset; :meth:`Store.read_raw` checks the same header fields of every record
  it hands out as a file span (one read or map per contiguous run; the consumer
  checks the CRC), and :meth:`Store.read_raw_many` of every record it reads for many
  queues at once (one read per neighbourhood in the log). An entry pointing past the
  log's end is damage, not retention.
- A mismatch raises :class:`CorruptRecordError` (file, offset, field, expected,
  actual) and *marks the queue for rebuild*: it is recorded durably in
  ``rebuild-queues`` and the next open drops the queue and rebuilds it from the log
  (one pass for all marked queues). Until then its other offsets are served, each
  still checked; the damaged ones keep failing, never returning another record.
- Background threads: a dispatcher or housekeeping error fails the store
  (``StoreState.fail``, through the thread's guard), except a full disk (ENOSPC)
  when writing queue files, which the housekeeping thread retries (nothing is lost:
  entries stay in memory).

:class:`Store` is a facade over the mode's parts, which share one
:class:`~._log_parts.LogParts`: opening (:mod:`._log_open`, Kafka's ``LogLoader``),
reads of a queue (:mod:`._queue_reads`) and of many at once (:mod:`._read_many`),
checkpoints and retention (:mod:`._housekeeping`).
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from clmq.commitlog import CommitLog
from clmq.consumequeue import ConsumeQueueSet, Dispatcher, KeyIndex
from clmq.consumequeue import contiguous_runs as _contiguous_runs  # noqa: F401 (tests/test_store.py checks it here)

from ._base import StoreBase
from ._checkpoint import Checkpoint
from ._config import StoreConfig, StoreLockedError
from ._housekeeping import apply_retention, checkpoint, housekeeping_loop
from ._key_index import KeyMatches, find_by_key
from ._log_open import open_log_parts
from ._log_parts import LogAppender, LogParts
from ._partition_store import PartitionStore
from ._puts import PutPath
from ._queue_ends import QueueEnd, continue_queues, next_offsets, queue_ends_before
from ._queue_reads import QueueReads
from ._read_many import read_many
from ._reads import ManyRead, ReadAsk, Reads

__all__ = ["Store", "StoreConfig", "StoreLockedError"]

log = logging.getLogger("clmq.store")


class Store(StoreBase):
    """The CommitLog store. Open with :meth:`open`, then :meth:`start` the background threads.

    ``Store.open`` with ``storage_mode="partition-per-file"`` returns a
    :class:`~clmq.broker.store.PartitionStore` instead (the same API).
    """

    # Set by :meth:`open` (the parts' own, for callers: replication, the timer, tests).
    log: CommitLog
    queues: ConsumeQueueSet
    dispatcher: Dispatcher
    _parts: LogParts
    _queue_reads: QueueReads

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def open(cls, config: StoreConfig) -> Store:
        """Open the data directory, recovering from an unclean stop if there was one.

        Raises :class:`LogDamageError` (with the affected queues) when log bytes that
        were promised are gone; the directory is released first."""
        if config.storage_mode == "partition-per-file" and cls is Store:
            return PartitionStore.open(config)  # type: ignore[return-value]
        self = cls(config)
        unclean = self._begin_open()
        try:
            parts, self.open_stats = open_log_parts(self._state, unclean, self._notify_arrivals)
        except BaseException:  # the abort marker stays, so the next open validates
            self._life.end_close(clean=False)
            raise
        self._parts = parts
        self.log, self.queues, self.dispatcher = parts.log, parts.queues, parts.dispatcher
        self._puts = PutPath(self._state, LogAppender(parts.log))
        self._queue_reads = QueueReads(parts)
        self._reads = Reads(self._state, self._queue_reads)
        return self

    def start(self) -> Store:
        """Start flushing, dispatching and housekeeping in background threads."""
        parts, stop = self._parts, self._state.stop
        self._life.start_threads(
            [
                ("clmq-flush", lambda: parts.log.run_flusher(stop)),
                ("clmq-dispatch", lambda: parts.dispatcher.dispatch_loop(stop)),
                ("clmq-housekeeping", lambda: housekeeping_loop(parts)),
            ]
        )
        return self

    def _wake_threads(self) -> None:
        self.dispatcher.wake()
        self.log.wake_flusher()

    def _close_files(self) -> bool:
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
        self._parts.entries.close()
        if self._parts.index is not None:
            self._parts.index.close()
        self.log.close()
        return clean

    def _release_files(self) -> None:
        self._parts.release()

    # -------------------------------------------------------------- background
    def checkpoint(self, sync: bool = False, full: bool = True) -> Checkpoint:
        """Write queue entries to their files and record what is on disk (:func:`~._housekeeping.checkpoint`)."""
        return checkpoint(self._parts, sync, full)

    def apply_retention(self, now: float | None = None) -> int:
        """Delete expired log segments and the queue files that only point into them."""
        return apply_retention(self._parts, now)

    def flush(self) -> int:
        """fsync the log now; returns the durable offset."""
        return self.log.flush()

    # -------------------------------------------------------------- replication
    def truncate(self, offset: int) -> None:
        """Durably cut the log at ``offset`` (a record boundary) and everything derived
        from it: queue entries past it go, and the queue offsets are recomputed so the
        next message of each queue continues right after its last surviving one.

        For replication: a follower that diverged from its leader cuts back to where
        they agree. Callers must not append concurrently.
        """
        self.dispatcher.catch_up()  # every queue is complete up to here (the confirmed offset), then cut
        self.log.truncate(offset)
        self._parts.entries.forget_missing()  # a segment made again under the same name must be read anew
        for key in self.queues.known():
            self.queues.queue(*key).truncate_past(self.log.write_offset)
        if self._parts.index is not None:
            self._parts.index.truncate(self.log.write_offset)
        self.dispatcher.dispatched_offset = min(self.dispatcher.dispatched_offset, self.log.write_offset)
        self.log.set_queue_offset_table(self._next_offsets_after_cut())

    def _next_offsets_after_cut(self) -> dict[tuple[str, int], int]:
        """Each queue's next offset: past its entries, and past the records the log
        keeps that are in no queue yet (a follower dispatches only up to the confirmed
        offset; a cut above it keeps such records, whose offsets must not be reused)."""
        table = self.queues.next_offsets()
        for rec in self.log.iter_records(self.dispatcher.dispatched_offset, self.log.write_offset):
            key = (rec.topic, rec.queue_id)
            table[key] = max(table.get(key, 0), rec.queue_offset + 1)
        return table

    def restart_at(self, base: int) -> None:
        """Delete the whole log and start it empty at ``base`` (a follower whose leader's
        log starts past this one's end). Queue entries all point below ``base`` then, as
        after retention; each queue continues at the offsets the next records carry, or
        where :meth:`continue_queues` says (queues none of whose records the log will
        hold). Callers must not append concurrently."""
        self.dispatcher.catch_up()
        self.log.restart_at(base)
        self._parts.entries.forget_missing()
        if self._parts.index is not None:
            self._parts.index.restart_at(base)
        self.dispatcher.dispatched_offset = base
        self.log.set_queue_offset_table(next_offsets(self._parts))  # queues not loaded yet included

    def queue_ends_before(self, log_offset: int) -> list[QueueEnd]:
        """``(topic, queue id, next offset)`` of the queues that hold no record at or
        after ``log_offset`` (a leader, for a replica starting its log there; see
        :mod:`._queue_ends`). Loads every queue: call it from a worker thread."""
        return queue_ends_before(self._parts, log_offset)

    def continue_queues(self, ends: Iterable[QueueEnd]) -> int:
        """Continue each queue at least at its given next offset, durably (a replica
        whose log holds none of their records); returns how many moved. Callers must
        not append concurrently."""
        return continue_queues(self._parts, ends)

    # --------------------------------------------------------------------- get
    def queue_bytes(self, topic: str, queue_id: int, max_entries: int) -> int | None:
        """Bytes of the records a queue still holds (its entries' sizes summed); None
        when it holds more than ``max_entries`` (summing would read too much index)."""
        return self._queue_reads.queue_bytes(topic, queue_id, max_entries)

    def read_raw_many(
        self, asks: Sequence[ReadAsk], max_messages: int, max_per_queue: int, max_bytes: int
    ) -> list[ManyRead]:
        """:meth:`StoreBase.read_raw_many`, the records of all queues read together
        (see :mod:`._read_many`): the answers are the per-queue loop's."""
        return read_many(self._parts, self._reads, asks, (max_messages, max_per_queue, max_bytes))

    @property
    def key_index(self) -> KeyIndex | None:
        """The key index (None when ``index_enabled`` is off)."""
        return self._parts.index

    def find_by_key(
        self,
        topic: str,
        key: str,
        *,
        since_ms: int | None = None,
        until_ms: int | None = None,
        max_results: int = 1000,
    ) -> KeyMatches | None:
        """Messages of ``topic`` with ``key`` among their keys or as their UNIQ_KEY,
        stored in ``[since_ms, until_ms]``, newest first, through the key index
        (:mod:`._key_index`); None when the index is off (``index_enabled``)."""
        if self._parts.index is None:
            return None
        # The index is fed in batches: first up to the log's confirmed end (a failed writes' backlog: bounded).
        lag = self.dispatcher.index_now(self.config.index_query_catch_up_bytes)
        found = find_by_key(
            self._parts.index, self.log, topic, key, since_ms=since_ms, until_ms=until_ms, max_results=max_results
        )
        found.index_lag_bytes = lag
        return found

    @property
    def dispatch_lag_bytes(self) -> int:
        return self.dispatcher.lag_bytes

    def catch_up(self) -> None:
        """Dispatch everything written so far (readers see it when this returns)."""
        self.dispatcher.catch_up()

    @property
    def end_offset(self) -> int:
        """Where the next append goes (the durability token of :meth:`wait_durable`)."""
        return self.log.write_offset
