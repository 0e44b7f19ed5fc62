"""The store: one CommitLog, its ConsumeQueues and the dispatcher, behind a narrow API.

This API (put, put_batch, get, offsets, flush, close) is what the broker uses and what
the partition-per-file mode implements too. It is synchronous and thread-safe; its
background work (flushing, dispatching, checkpoints, retention) runs in threads that
:meth:`Store.start` starts and :meth:`Store.close` stops.
"""

from __future__ import annotations

import logging
import struct
from typing import Iterator, Sequence

import numpy as np

from commitlog import OFF_STORE_TS, CommitLog, DurableOffset, Message, MiB, PackedMessages, Record, decode_record
from consumequeue import ENTRY_DTYPE, ConsumeQueueSet, Dispatcher, tag_hash

from ._base import Stopwatch, StoreBase, StoreConfig, StoreLockedError
from ._checkpoint import Checkpoint
from ._partition_store import PartitionStore
from ._recovery import recover_queues
from ._results import PutResult, Span

__all__ = ["Store", "StoreConfig", "StoreLockedError"]

log = logging.getLogger("clmq.store")


class Store(StoreBase):
    """The CommitLog store. Open with :meth:`open`, then :meth:`start` the background threads.

    ``Store.open`` with ``storage_mode="partition-per-file"`` returns a
    :class:`~broker.store.PartitionStore` instead (the same API).
    """

    # Set by :meth:`open`, which builds them in recovery order (the log, then the queues
    # checked against it, then the dispatcher that brings them up to the log's end).
    log: CommitLog
    queues: ConsumeQueueSet
    dispatcher: Dispatcher
    _saved: Checkpoint | None  # the last checkpoint written

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def open(cls, config: StoreConfig) -> Store:
        """Open the data directory, recovering from an unclean stop if there was one."""
        if config.storage_mode == "partition-per-file" and cls is Store:
            return PartitionStore.open(config)  # type: ignore[return-value]
        self = cls(config)
        clock = Stopwatch()
        unclean = self._begin_open()
        checkpoint = Checkpoint.load(self.directory / "checkpoint")
        unclean = unclean or checkpoint is None
        self.log = CommitLog.open(self.directory / "commitlog", config.commitlog, clean=not unclean,
                                  checkpoint_offset=checkpoint.log_durable if checkpoint else None)  # fmt: skip
        clock.lap("log_open_s")
        self.queues = ConsumeQueueSet(self.directory / "consumequeue", config.cq_entries_per_file, config.max_open_files)
        start = recover_queues(self.log, self.queues, checkpoint, unclean)
        clock.lap("queue_check_s")
        self.dispatcher = Dispatcher(self.log, self.queues, start, config.dispatch_chunk_bytes)
        self.dispatcher.add_listener(self._notify_arrivals)
        clock.stats["redispatched_records"] = self.dispatcher.catch_up()  # serve nothing until queues agree with the log
        clock.lap("redispatch_s")
        # Queues not loaded (clean stop, files intact) keep the checkpoint's extents; the
        # checkpoint carries them forward until they are loaded.
        self._manifest = dict(checkpoint.queues) if checkpoint is not None and not unclean else {}
        self._saved = None
        table = {key: nxt for key, (_first, nxt) in self._manifest.items()}
        table.update(self.queues.next_offsets())
        self.log.set_queue_offset_table(table)
        try:
            self.checkpoint()
        except OSError as e:  # e.g. disk full: entries stay in memory until there is room
            log.warning("store open: could not write consume queues yet: %s", e)
        clock.lap("queue_files_s")
        self.open_stats = {"unclean": unclean, **clock.stats}
        log.info("store opened (%s): %s", "after an unclean stop" if unclean else "clean", self.open_stats)
        return self

    def start(self) -> Store:
        """Start flushing, dispatching and housekeeping in background threads."""
        self._start_threads([
            ("clmq-flush", lambda: self.log.run_flusher(self._stop)),
            ("clmq-dispatch", lambda: self.dispatcher.run(self._stop)),
            ("clmq-housekeeping", self._housekeeping),
        ])  # fmt: skip
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
        self.log.close()
        return clean

    def _release_files(self) -> None:
        self.queues.files.close()
        self.log.abandon()

    # -------------------------------------------------------------- background
    def checkpoint(self, sync: bool = False, full: bool = True) -> Checkpoint:
        """Write queue entries to their files and record what is on disk (see ``_checkpoint``)."""
        with self._checkpoint_lock:
            return self._checkpoint(sync, full)

    def _checkpoint(self, sync: bool, full: bool) -> Checkpoint:
        """Write queue entries to their files (``full``: all; else those with at least
        ``cq_flush_min_bytes`` waiting) and record what is on disk.

        Raises OSError (disk full) with nothing lost: entries that could not be written
        stay in memory and the previous checkpoint stays in force.
        """
        dispatched = self.dispatcher.dispatched_offset  # read first: entries below it are in memory
        oldest = self.queues.flush(sync=sync, min_bytes=0 if full else self.config.cq_flush_min_bytes)
        if oldest is not None:  # re-dispatch must start before entries that only memory holds
            dispatched = min(dispatched, oldest)
        expected = {**self._manifest, **self.queues.extents()}
        self._manifest = expected
        cp = Checkpoint(self.log.durable_offset, dispatched, expected)
        if cp != self._saved:  # unchanged (an idle or read-only second): the file already says it
            cp.save(self.directory / "checkpoint")
            self._saved = cp
        return cp

    def _housekeeping(self) -> None:
        interval = self.config.cq_flush_interval_ms / 1000
        every = max(1, self.config.retention_check_interval_ms // self.config.cq_flush_interval_ms)
        full_every = max(1, self.config.cq_full_flush_interval_ms // self.config.cq_flush_interval_ms)
        rounds = 0
        while not self._stop.wait(interval):
            try:
                self.checkpoint(full=(rounds + 1) % full_every == 0)
                rounds += 1
                if rounds % every == 0:
                    self.apply_retention()
            except OSError as e:
                log.warning("store housekeeping: %s; retrying in %d ms", e, self.config.cq_flush_interval_ms)

    def apply_retention(self, now: float | None = None) -> int:
        """Delete expired log segments and the queue files that only point into them."""
        deleted = self.log.delete_expired(now)
        if deleted:
            for key in self.queues.known():  # queues not loaded yet are trimmed when they are
                cq = self.queues.queue(*key)
                if cq.loaded:
                    cq.delete_before(self.log.min_offset)
        return deleted

    # --------------------------------------------------------------------- put
    def _append(self, messages: Sequence[Message]) -> PutResult:
        return PutResult.from_append(self.log.append(messages))

    def _append_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int]) -> PutResult:
        return PutResult.from_append(self.log.append_packed(batches, queue_counts))

    def _durability(self) -> DurableOffset:
        return self.log.durability

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

    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        return self.queues.queue(topic, queue_id).bounds(self.log.min_offset)

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

    def _read(self, topic: str, queue_id: int, offset: int, max_messages: int,
              tags: set[str] | None) -> tuple[list[Record], int]:  # fmt: skip
        scan = max_messages if tags is None else max(max_messages, self.config.max_scan_entries)
        at, raw = self.queues.queue(topic, queue_id).read(offset, scan)
        picked, next_offset = self._select(at, raw, max_messages, tags)
        return [r for r in self._read_records(picked) if tags is None or r.tags in tags], next_offset

    def _select(self, at: int, raw: bytes, max_messages: int, tag_set: set[str] | None,
                max_bytes: int | None = None) -> tuple[np.ndarray, int]:  # fmt: skip
        """The entries to read from ``raw`` (entries from queue offset ``at``) and the
        queue offset after the last one looked at."""
        entries = np.frombuffer(raw, ENTRY_DTYPE)
        mask = (entries["size"] > 0) & (entries["offset"] >= self.log.min_offset)
        if tag_set is not None:
            mask &= np.isin(entries["tag"], np.array([tag_hash(t) for t in tag_set], dtype=np.uint64))
        idx = np.flatnonzero(mask)[:max_messages]
        full = len(idx) == max_messages
        if max_bytes is not None and len(idx):
            cum = np.cumsum(entries["size"][idx].astype(np.int64))
            keep = max(1, int(np.searchsorted(cum, max_bytes, side="right")))  # the first record always
            full, idx = full or keep < len(idx), idx[:keep]
        next_offset = at + (int(idx[-1]) + 1 if full else len(entries))
        return entries[idx], next_offset

    def _read_raw(self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None,
                  max_bytes: int) -> tuple[list[Span], int, int]:  # fmt: skip
        scan = max_messages if tags is None else max(max_messages, self.config.max_scan_entries)
        at, raw = self.queues.queue(topic, queue_id).read(offset, scan)
        picked, next_offset = self._select(at, raw, max_messages, tags, max_bytes)
        spans: list[Span] = []
        count = 0
        runs = _contiguous_runs(picked["offset"], picked["size"])
        offsets, sizes = picked["offset"].tolist(), picked["size"].tolist()
        for i, j in runs:
            start, end = offsets[i], offsets[j - 1] + sizes[j - 1]
            where = self.log.file_span(start, end - start)
            if where is not None:
                spans.append(Span(str(where[0]), where[1], end - start))
                count += j - i
                continue
            for k in range(i, j):  # crosses a segment end, or fell out of retention: record by record
                one = self.log.file_span(offsets[k], sizes[k])
                if one is not None:
                    spans.append(Span(str(one[0]), one[1], sizes[k]))
                    count += 1
        return spans, count, next_offset

    def _read_records(self, picked: np.ndarray) -> list[Record]:
        """Read picked records, coalescing runs that are contiguous in the log."""
        out: list[Record] = []
        for pieces in self._run_bytes(picked):
            for at, data in pieces:
                where, pos = self.log.segment_path(at), 0
                while pos < len(data):
                    rec = decode_record(data, pos, where, at + pos)
                    out.append(rec)
                    pos += rec.size
        return out

    def _run_bytes(self, picked: np.ndarray) -> Iterator[list[tuple[int, bytes]]]:
        """Per run of log-contiguous records: ``[(offset, bytes), ...]``,
        one piece unless the run crosses a segment end; records that fell out of
        retention meanwhile are left out."""
        runs = _contiguous_runs(picked["offset"], picked["size"])
        offsets, sizes = picked["offset"].tolist(), picked["size"].tolist()
        for i, j in runs:
            start, end = offsets[i], offsets[j - 1] + sizes[j - 1]
            data = self.log.read_bytes(start, end - start)
            if data is not None:
                yield [(start, data)]
                continue
            singles = [(offsets[k], self.log.read_bytes(offsets[k], sizes[k])) for k in range(i, j)]
            yield [(o, d) for o, d in singles if d is not None]

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


def _contiguous_runs(offsets: np.ndarray, sizes: np.ndarray, max_run_bytes: int = 4 * MiB) -> list[tuple[int, int]]:
    """Index ranges ``[i, j)`` of records that follow each other in the log; a run ends
    before a record starting ``max_run_bytes`` or more after the run's start. Found
    with array operations: a loop per record here cost half of a 256-record read."""
    n = len(offsets)
    if n == 0:
        return []
    starts = offsets.astype(np.int64)
    cuts = (np.flatnonzero(starts[1:] != starts[:-1] + sizes[:-1]) + 1).tolist()
    runs: list[tuple[int, int]] = []
    i = 0
    for j in cuts + [n]:
        while int(starts[j - 1] - starts[i]) >= max_run_bytes:  # too long: split it
            k = i + int(np.searchsorted(starts[i:j], starts[i] + max_run_bytes, side="left"))
            runs.append((i, k))
            i = k
        runs.append((i, j))
        i = j
    return runs
