"""The partition-per-file store: Kafka's layout behind the store's API, for comparison.

Each (topic, queue) has its own segmented log (see ``_partition_log``). A batch is
grouped by queue and written with one system call per queue file; the flusher fsyncs
every file written since the last flush (sync mode: group commit over all of them).
Durability is tracked by a *virtual offset*: the count of bytes appended across every
partition, so that "durable up to X" means the same as in the CommitLog mode.

Promises (issue 14), as in the CommitLog mode:
- ``recovery-points`` holds, per partition, the queue offset below which everything was
  fsynced when it was written (each checkpoint). Every open, clean or not, checks each
  partition against it (:class:`~._partition_log.PartitionLoader`): bytes promised and
  gone refuse the open with :class:`~commitlog.LogDamageError`.
- One flush at a time: the durable offset is published only after every fsync covering
  it has returned. An fsync error fails the store (nothing retried, nothing published);
  housekeeping retries only a full disk.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from clmq.commitlog import (
    BatchEncoder,
    DurableOffset,
    EncodeError,
    MetadataSource,
    QueueKey,
    fsync_dir,
    load_json,
    now_ms,
    write_json,
)
from clmq.common import LogDamageError, Message, Record, StoreFailedError
from clmq.consumequeue import FileCache

from ._base import Stopwatch, StoreBase, StoreConfig
from ._partition_log import LoadReport, PartitionLoader, PartitionLog, PartSegment
from ._results import PutResult, PutStatus, Span

log = logging.getLogger("clmq.partition")

# How to cut a partition back after a failed batch: the partition, the segment written
# to, and (segment count, size, record count, index length, time index length,
# since_index) as they were before the batch.
_Undo = tuple[PartitionLog, PartSegment, tuple[int, int, int, int, int, int]]
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # the only errors housekeeping retries


class PartitionStore(StoreBase):
    """Same API as :class:`~broker.Store`; open with :meth:`open`, then :meth:`start`."""

    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        cl = config.commitlog
        # Whole batches go to one file: no segment splitting (and so no blank markers).
        self._encoder = BatchEncoder(1 << 62, cl.max_message_bytes, cl.store_host)
        self.files = FileCache(config.max_open_files)
        self.partitions: dict[QueueKey, PartitionLog] = {}
        self._lock = threading.Lock()
        self._written = 0  # virtual offset: bytes appended, all partitions together
        self._durable = DurableOffset()
        self._dirty: set[Path] = set()
        self._new_dirs: set[Path] = set()  # directories with new files since the last flush
        # One flush at a time owns the durable offset: it publishes only after every
        # fsync of what it took has returned (a second flush waits, then takes the rest).
        self._flush_lock = threading.Lock()

    @property
    def root(self) -> Path:
        return self.directory / "partitions"

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def open(cls, config: StoreConfig) -> PartitionStore:
        """Load every partition and verify it against its recovery point (see
        :class:`PartitionLoader`); :class:`~commitlog.LogDamageError` if log bytes that
        were promised durable are gone (the directory is released first)."""
        self = cls(config)
        clock = Stopwatch()
        unclean = self._begin_open()
        try:
            unclean = self._load_partitions(unclean)
        except BaseException:
            self._release_files()
            self._end_close(clean=False)
            raise
        clock.lap("log_open_s")
        self.open_stats = {"unclean": unclean, **clock.stats}
        try:
            self.checkpoint()
        except OSError as e:  # disk full: the abort marker stays, so the next open validates again
            log.warning("partition store open: could not write recovery points yet: %s", e)
        return self

    def _load_partitions(self, unclean: bool) -> bool:
        """Open every partition directory; returns whether the open is unclean (no
        recovery points count as an unclean stop: everything is validated)."""
        points, from_previous = _load_points(self.directory / "recovery-points")
        unclean = unclean or points is None or from_previous
        promised = points or {}
        self.root.mkdir(exist_ok=True)
        reports: list[LoadReport] = []
        for name in sorted(os.listdir(self.root)):
            topic, _, qid = name.rpartition("-")
            if topic and qid.isdigit():
                key = (topic, int(qid))
                part = self._new_partition(key)
                reports.append(PartitionLoader(part, self.files, promised.get(key, 0), unclean).load())
                self.partitions[key] = part
        for (t, q), point in promised.items():
            if (t, q) not in self.partitions and point > 0:
                raise LogDamageError(
                    str(self.root / f"{t}-{q}"), 0, 0, "the partition's directory is missing", [(t, q, 0, point - 1)]
                )
        _log_open(reports, len(self.partitions), unclean)
        return unclean

    def _new_partition(self, key: QueueKey) -> PartitionLog:
        cl = self.config.commitlog
        return PartitionLog(
            self.root / f"{key[0]}-{key[1]}",
            key[0],
            key[1],
            cl.segment_bytes,
            self.config.index_interval_bytes,
            cl.max_message_bytes,
        )

    def _partition(self, key: QueueKey) -> PartitionLog:
        """The partition of ``key``, created (directory and first segment) on first use."""
        part = self.partitions.get(key)
        if part is None:
            part = self._new_partition(key)
            PartitionLoader(part, self.files, 0, unclean=False).load()
            self._new_dirs.update((part.directory, self.root))  # made durable by the next flush
            self.partitions[key] = part
        return part

    def create_topic(self, topic: str, queue_count: int) -> None:
        """Create the topic and, as Kafka does, every partition's log right away."""
        super().create_topic(topic, queue_count)
        with self._lock:
            for q in range(queue_count):
                self._partition((topic, q))

    def start(self) -> PartitionStore:
        self._start_threads([("clmq-flush", self._flush_loop), ("clmq-housekeeping", self._housekeeping)])
        return self

    def _wake_threads(self) -> None:
        self._durable.flush_requested.set()

    def _close_files(self) -> bool:
        try:
            self.flush()
        except StoreFailedError:  # fsync failed just now: the next open recovers (abort marker stays)
            self.files.close()
            return False
        for part in self.partitions.values():
            part.write_indexes(part.segments[-1])
        try:
            self.checkpoint()
            clean = True
        except OSError as e:  # the data is fsynced; without recovery points the next open validates
            log.error("partition store close: could not write recovery points (%s)", e)
            clean = False
        self.files.close()
        return clean

    def _release_files(self) -> None:
        self.files.close()

    # ------------------------------------------------------------------ append
    def _append(self, messages: Sequence[Message]) -> PutResult:
        by_queue: dict[QueueKey, list[int]] = defaultdict(list)
        for i, m in enumerate(messages):
            by_queue[(m.topic, m.queue_id)].append(i)
        store_ts = now_ms()
        error: BaseException | None = None
        cut_error: OSError | None = None
        with self._lock:
            undo: list[_Undo] = []
            try:
                q_offsets = self._append_all(messages, by_queue, store_ts, undo)
            except BaseException as e:  # whatever it is, no offset stays assigned
                error, cut_error = e, self._rollback(undo)
            end = self._written
        if cut_error is not None:  # outside the lock: failing runs the durability callbacks
            self._fail("rollback of a failed append", cut_error)
        if error is not None:
            return _append_error(error, self.root)
        self._notify_arrivals(set(by_queue))
        if (
            not self.config.commitlog.acks_wait_for_fsync
            and end - self._durable.value >= self.config.commitlog.flush_dirty_bytes
        ):
            self._durable.flush_requested.set()
        return PutResult(PutStatus.OK, "", q_offsets, [], end, store_ts)

    def _append_all(
        self, messages: Sequence[Message], by_queue: dict[QueueKey, list[int]], store_ts: int, undo: list[_Undo]
    ) -> list[int]:
        """Each queue's share of the batch, in turn; the queue offsets of all messages."""
        q_offsets = [0] * len(messages)
        for key, idx in by_queue.items():
            offsets = self._append_to(self._partition(key), [messages[i] for i in idx], store_ts, undo)
            for i, q in zip(idx, offsets):
                q_offsets[i] = q
        return q_offsets

    def _append_to(self, part: PartitionLog, msgs: list[Message], store_ts: int, undo: list[_Undo]) -> list[int]:
        """Encode and write one queue's share of a batch: one pwrite."""
        seg = part.segments[-1]
        state = (len(part.segments), seg.size, seg.count, len(seg.index), len(seg.times), seg.since_index)
        key = (part.topic, part.queue_id)
        batch = self._encoder.encode(msgs, 0, seg.size, {key: part.next_offset}, {}, store_ts)
        data = batch.groups[0].data
        seg, rolled = part.active_for(len(data))
        undo.append((part, part.segments[-2] if rolled else seg, state))
        if rolled:  # positions changed: encode again at the start of the new file
            self._new_dirs.add(part.directory)
            batch = self._encoder.encode(msgs, 0, 0, {key: part.next_offset}, {}, store_ts)
            data = batch.groups[0].data
        self.files.pwrite(seg.path, data, seg.size)
        starts = batch.groups[0].starts
        part.appended(seg, starts, [b - a for a, b in zip(starts, starts[1:] + [seg.size + len(data)])], store_ts)
        self._dirty.add(seg.path)
        self._written += len(data)
        return batch.queue_offsets

    def _rollback(self, undo: list[_Undo]) -> OSError | None:
        """Cut every partition touched by a failed batch back to where it was; the error
        of a cut that failed (then a file may keep bytes no offset owns: the store fails)."""
        failed: OSError | None = None
        for part, seg, (nsegs, size, count, nidx, ntimes, since) in reversed(undo):
            for extra in part.segments[nsegs:]:
                self.files.forget(extra.path)
                extra.path.unlink(missing_ok=True)
            del part.segments[nsegs:]
            try:
                self.files.truncate(seg.path, size)
            except OSError as e:
                log.error("partition %s: could not cut %s back to %d bytes: %s", part.directory, seg.path, size, e)
                failed = failed or e
            seg.size, seg.count, seg.since_index = size, count, since
            del seg.index[nidx:]
            del seg.times[ntimes:]
        return failed

    # ---------------------------------------------------------------- flushing
    def flush(self) -> int:
        """fsync every file written since the last flush, then publish the durable
        offset; returns it. One flush at a time (see ``_flush_lock``). An fsync error
        fails the store (:class:`~commitlog.StoreFailedError`): after it the page cache
        cannot be trusted, so nothing is retried and nothing more is published."""
        with self._flush_lock:
            if self.failure is not None:
                raise self.failure
            with self._lock:
                target, dirty, self._dirty = self._written, self._dirty, set()
                new_dirs, self._new_dirs = self._new_dirs, set()
            try:
                for path in dirty:
                    self.files.sync(path, reopen=True)
                for directory in new_dirs:  # new segments' names, as durable as their bytes
                    fsync_dir(directory)
            except OSError as e:
                self._fail("flush", e)
                raise StoreFailedError("flush", e) from e
            self._durable.publish(target)
            return target

    def _durability(self) -> DurableOffset:
        return self._durable

    def _flush_loop(self) -> None:
        self._durable.run_flusher(
            self.flush,
            lambda: self._written > self._durable.value,
            self._stop,
            self.config.commitlog.flush_interval_ms / 1000,
        )

    def checkpoint(self) -> None:
        """Record each partition's recovery point: all below it is fsynced."""
        with self._checkpoint_lock:
            self._checkpoint()

    def _checkpoint(self) -> None:
        with self._lock:
            points = {key: part.next_offset for key, part in self.partitions.items()}
            written = self._written
        if written > self._durable.value:
            self.flush()
        write_json(
            self.directory / "recovery-points", {"version": 1, "points": [[t, q, n] for (t, q), n in points.items()]}
        )

    def _housekeeping(self) -> None:
        """Checkpoint every ``cq_flush_interval_ms``, retention now and then. A full disk
        is retried next round; any other error ends the thread and fails the store."""
        interval_ms = self.config.cq_flush_interval_ms
        every = max(1, self.config.retention_check_interval_ms // interval_ms)
        rounds = 0
        while not self._stop.wait(interval_ms / 1000) and self.failure is None:
            rounds += 1
            try:
                self.checkpoint()
                if rounds % every == 0:
                    self.apply_retention()
            except OSError as e:
                if e.errno not in _DISK_FULL:
                    raise
                log.warning("partition housekeeping: %s; retried in %d ms", e, interval_ms)

    def apply_retention(self, now: float | None = None) -> int:
        cl = self.config.commitlog
        with self._lock:
            return sum(
                p.delete_before(self.files, cl.retention_ms, cl.retention_bytes, now or time.time())
                for p in self.partitions.values()
            )

    # ------------------------------------------------------------------- reads
    def min_offset(self, topic: str, queue_id: int) -> int:
        part = self.partitions.get((topic, queue_id))
        return part.min_offset if part else 0

    def max_offset(self, topic: str, queue_id: int) -> int:
        part = self.partitions.get((topic, queue_id))
        return part.next_offset if part else 0

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        part = self.partitions.get((topic, queue_id))
        return part.offset_for_timestamp(self.files, timestamp_ms) if part else 0

    def _read(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None
    ) -> tuple[list[Record], int]:
        part = self.partitions[(topic, queue_id)]
        out: list[Record] = []
        limit = max_messages if tags is None else max(max_messages, self.config.max_scan_entries)
        for rec, _raw in part.records_from(self.files, offset, limit):
            offset = rec.queue_offset + 1
            if tags is None or rec.tags in tags:
                out.append(rec)
                if len(out) == max_messages:
                    break
        return out, offset

    def _read_raw(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None, max_bytes: int
    ) -> tuple[list[Span], int, int]:
        part = self.partitions[(topic, queue_id)]
        spans: list[Span] = []
        total = 0
        limit = max_messages if tags is None else max(max_messages, self.config.max_scan_entries)
        for rec, raw in part.records_from(self.files, offset, limit):
            if spans and total + rec.size > max_bytes:
                break
            offset = rec.queue_offset + 1
            if tags is None or rec.tags in tags:
                spans.append(Span(None, rec.commitlog_offset, rec.size, raw))
                total += rec.size
                if len(spans) == max_messages:
                    break
        return spans, len(spans), offset

    @property
    def dispatch_lag_bytes(self) -> int:
        return 0  # readers see messages as soon as they are written: nothing to dispatch

    @property
    def end_offset(self) -> int:
        return self._written

    def catch_up(self) -> None:
        """Nothing to do: partition reads see what was written."""


def _append_error(error: BaseException, root: Path) -> PutResult:
    """The result of an append that failed and was rolled back; anything other than an
    expected outcome (bad message, I/O error) is raised again."""
    if isinstance(error, EncodeError):
        return PutResult(PutStatus.MESSAGE_TOO_LARGE if error.too_large else PutStatus.INVALID_MESSAGE, str(error))
    if isinstance(error, OSError):
        status = PutStatus.DISK_FULL if error.errno in _DISK_FULL else PutStatus.IO_ERROR
        return PutResult(status, f"{error.strerror} while appending to {root}: nothing written")
    raise error


def _load_points(path: Path) -> tuple[dict[QueueKey, int] | None, bool]:
    """Each partition's recovery point (None if there are none to trust: then the open
    validates every partition from its start), and whether they came from the previous
    generation: older but true points, which a clean open must not trust as the end."""
    loaded = load_json(path, _points_error)
    if not loaded.ok:
        return None, False
    raw = loaded.value
    return {(str(t), int(q)): int(n) for t, q, n in raw["points"]}, loaded.source is MetadataSource.PREVIOUS


def _points_error(raw: Any) -> str | None:
    try:
        [(str(t), int(q), int(n)) for t, q, n in raw["points"]]
    except (TypeError, KeyError, ValueError):
        return "not a list of [topic, queue id, offset] points"
    return None


def _log_open(reports: list[LoadReport], partitions: int, unclean: bool) -> None:
    """One line for the whole open, with counts (and the first few reasons)."""
    rebuilt = [r for rep in reports for r in rep.rebuilt]
    cut = [c for rep in reports for c in rep.cut]
    scanned = sum(rep.scanned for rep in reports)
    if not (rebuilt or cut):
        log.info(
            "partition store open (%s): %d partitions, %d segments read whole",
            "unclean" if unclean else "clean",
            partitions,
            scanned,
        )
        return
    log.warning(
        "partition store open (%s): %d partitions; rebuilt the indexes of %d segment(s) that did not check%s;"
        " cut %d torn tail(s) above the recovery point%s; %d segments read whole",
        "unclean" if unclean else "clean",
        partitions,
        len(rebuilt),
        f" ({'; '.join(rebuilt[:3])})" if rebuilt else "",
        len(cut),
        f" ({'; '.join(cut[:3])})" if cut else "",
        scanned,
    )
