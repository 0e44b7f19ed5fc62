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
  (``StoreBase._fail``), except a full disk (ENOSPC) when writing queue files,
  which the housekeeping thread retries (nothing is lost: entries stay in memory).
"""

from __future__ import annotations

import bisect
import errno
import itertools
import logging
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from clmq.commitlog import CommitLog, DurableOffset
from clmq.common import OFF_STORE_TS, CorruptRecordError, LogDamageError, Message, PackedMessages, Record
from clmq.consumequeue import (
    ENTRY_DTYPE,
    ENTRY_SIZE,
    ConsumeQueueSet,
    Dispatcher,
    EntryReader,
    FileSpan,
    affected_queues,
    tag_hash,
)
from clmq.consumequeue import contiguous_runs as _contiguous_runs  # noqa: F401 (tests/test_store.py checks it here)

from ._base import ManyRead, ReadAsk, Stopwatch, StoreBase, StoreConfig, StoreLockedError, check_get_args
from ._checkpoint import Checkpoint
from ._partition_store import PartitionStore
from ._recovery import RebuildList, Recovery, recover_queues
from ._results import GetStatus, PutResult, RawRead, Span

__all__ = ["Store", "StoreConfig", "StoreLockedError"]

QUEUE_BYTES_CHUNK_ENTRIES = 65_536  # index entries read at once when a queue's bytes are summed

log = logging.getLogger("clmq.store")

REBUILD_FILE = "rebuild-queues"  # queues marked for rebuild at the next open
_NOT_MARKED = frozenset({"crc32c", "read"})  # the record or the log's read failed: rebuilding the queue would not help


class Store(StoreBase):
    """The CommitLog store. Open with :meth:`open`, then :meth:`start` the background threads.

    ``Store.open`` with ``storage_mode="partition-per-file"`` returns a
    :class:`~clmq.broker.store.PartitionStore` instead (the same API).
    """

    # Set by :meth:`open`, which builds them in recovery order (the log, then the queues
    # checked against it, then the dispatcher that brings them up to the log's end).
    log: CommitLog
    queues: ConsumeQueueSet
    dispatcher: Dispatcher
    _saved: Checkpoint | None  # the last checkpoint written
    _rebuild: RebuildList  # queues marked for rebuild at the next open
    _entries: EntryReader  # reads records through entries, checking their identity

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
            self._open_parts(unclean)
        except BaseException:
            self._release_partial()
            raise
        return self

    def _open_parts(self, unclean: bool) -> None:
        config, clock = self.config, Stopwatch()
        checkpoint = Checkpoint.load(self.directory / "checkpoint")
        # A checkpoint of the previous generation (the current one was damaged) is old:
        # what happened since is unknown, as after a crash.
        unclean = unclean or checkpoint is None or checkpoint.from_previous
        self.queues = ConsumeQueueSet(
            self.directory / "consumequeue", config.cq_entries_per_file, config.max_open_files
        )
        self.log = self._open_log(checkpoint, unclean)
        clock.lap("log_open_s")
        self._rebuild = RebuildList(self.directory / REBUILD_FILE)
        marked = dict(self._rebuild.marked)
        plan = recover_queues(self.log, self.queues, checkpoint, unclean, marked)
        clock.lap("queue_check_s")
        self._entries = EntryReader(self.log)
        self.dispatcher = Dispatcher(self.log, self.queues, plan.start, config.dispatch_chunk_bytes)
        self.dispatcher.add_listener(self._notify_arrivals)
        appended = self.queues.appended_entries
        clock.stats["redispatched_records"] = (
            self.dispatcher.catch_up()
        )  # serve nothing until queues agree with the log
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
            self._rebuild.clear(set(marked))  # rebuilt and written: unmark
        except OSError as e:  # e.g. disk full: entries stay in memory until there is room
            log.warning("store open: could not write consume queues yet: %s", e)
        clock.lap("queue_files_s")
        self._report_rebuild(plan, self.queues.appended_entries - appended, clock)
        self.open_stats = {"unclean": unclean, **clock.stats}
        log.info("store opened (%s): %s", "after an unclean stop" if unclean else "clean", self.open_stats)

    def _open_log(self, checkpoint: Checkpoint | None, unclean: bool) -> CommitLog:
        """Open the log; a clean open expects it to end where the checkpoint says."""
        durable = checkpoint.log_durable if checkpoint is not None else None
        try:
            return CommitLog.open(
                self.directory / "commitlog",
                self.config.commitlog,
                clean=not unclean,
                checkpoint_offset=durable,
                expected_end=None if unclean else durable,
            )
        except LogDamageError as e:  # name what is lost, from the queue files (slow, but only here)
            raise e.with_queues(affected_queues(self.queues.root, e.start, e.end)) from None

    def _report_rebuild(self, plan: Recovery, entries: int, clock: Stopwatch) -> None:
        """One line for everything the open rebuilt (a store may have 100,000 queues)."""
        clock.stats["queues_rebuilt"] = len(plan.rebuilt)
        if not plan.rebuilt:
            return
        redone = self.dispatcher.dispatched_offset - plan.start
        log.warning(
            "store open: %d queue(s) rebuilt from the log, %d entries re-dispatched from %d log bytes "
            "(from offset %d): %s%s",
            len(plan.rebuilt),
            entries,
            redone,
            plan.start,
            "; ".join(plan.rebuilt[:5]),
            " ..." if len(plan.rebuilt) > 5 else "",
        )

    def _release_partial(self) -> None:
        """After a failed open: close what was opened and free the directory (the abort
        marker stays, so the next open validates)."""
        if hasattr(self, "_entries"):
            self._entries.close()
        if hasattr(self, "queues"):
            self.queues.files.close()
        if hasattr(self, "log"):
            self.log.abandon()
        self._end_close(clean=False)

    def start(self) -> Store:
        """Start flushing, dispatching and housekeeping in background threads."""
        self._start_threads(
            [
                ("clmq-flush", lambda: self.log.run_flusher(self._stop)),
                ("clmq-dispatch", lambda: self.dispatcher.dispatch_loop(self._stop)),
                ("clmq-housekeeping", self._housekeeping),
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
        self._entries.close()
        self.log.close()
        return clean

    def _release_files(self) -> None:
        self._entries.close()
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
                if e.errno != errno.ENOSPC:
                    raise  # EIO and the like: the page cache cannot be trusted (_guarded fails the store)
                log.warning("store housekeeping: %s; retrying in %d ms", e, self.config.cq_flush_interval_ms)

    def apply_retention(self, now: float | None = None) -> int:
        """Delete expired log segments and the queue files that only point into them."""
        deleted = self.log.delete_expired(now)
        self._entries.forget_missing()  # every pass: what the last one dropped is closed now
        if deleted:
            for key in self.queues.known():  # queues not loaded yet are trimmed when they are
                cq = self.queues.queue(*key)
                if not cq.loaded:
                    continue
                try:
                    cq.delete_before(self.log.min_offset)
                except CorruptRecordError as e:  # one damaged queue must not fail the housekeeping thread
                    self._mark_for_rebuild(key[0], key[1], e)
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
        self.dispatcher.catch_up()  # every queue is complete up to here (the confirmed offset), then cut
        self.log.truncate(offset)
        self._entries.forget_missing()  # a segment made again under the same name must be read anew
        for key in self.queues.known():
            self.queues.queue(*key).truncate_past(self.log.write_offset)
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
        after retention; each queue continues at the offsets the next records carry.
        Callers must not append concurrently."""
        self.dispatcher.catch_up()
        self.log.restart_at(base)
        self._entries.forget_missing()
        self.dispatcher.dispatched_offset = base
        self.log.set_queue_offset_table(self.queues.next_offsets())

    # --------------------------------------------------------------------- get
    def _mark_for_rebuild(self, topic: str, queue_id: int, error: CorruptRecordError) -> None:
        """Record durably that the queue must be rebuilt from the log (at the next open)."""
        if error.check in _NOT_MARKED:
            return
        try:
            if self._rebuild.add((topic, queue_id), f"{error.check} at {error.file}:{error.offset}"):
                log.error("consume queue %s/%d marked for rebuild at the next open: %s", topic, queue_id, error)
        except OSError as e:  # the read's own error says what is wrong; this only delays the rebuild
            log.error("could not mark consume queue %s/%d for rebuild: %s", topic, queue_id, e)

    def min_offset(self, topic: str, queue_id: int) -> int:
        return self.bounds(topic, queue_id)[0]

    def max_offset(self, topic: str, queue_id: int) -> int:
        """One past the last dispatched message of the queue."""
        return self.queues.queue(topic, queue_id).next_offset

    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        try:
            return self.queues.queue(topic, queue_id).bounds(self.log.min_offset)
        except CorruptRecordError as e:
            self._mark_for_rebuild(topic, queue_id, e)
            raise

    def queue_bytes(self, topic: str, queue_id: int, max_entries: int) -> int | None:
        """Bytes of the records a queue still holds (its entries' sizes summed); None
        when it holds more than ``max_entries`` (summing would read too much index)."""
        lo, hi = self.bounds(topic, queue_id)
        if hi - lo > max_entries:
            return None
        try:
            cq = self.queues.queue(topic, queue_id)
            total, offset = 0, lo
            while offset < hi:
                at, raw = cq.read_entries(offset, min(QUEUE_BYTES_CHUNK_ENTRIES, hi - offset))
                if not raw:
                    break
                entries = np.frombuffer(raw, ENTRY_DTYPE)
                total += int(entries["size"].sum(dtype=np.uint64))  # a hole marker has size 0
                offset = at + len(entries)
            return total
        except CorruptRecordError as e:
            self._mark_for_rebuild(topic, queue_id, e)
            raise

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        """The first queue offset stored at or after ``timestamp_ms`` (max offset if none)."""
        cq = self.queues.queue(topic, queue_id)
        log_min = self.log.min_offset

        def stored_at_or_after(entry: tuple[int, int, int]) -> bool:
            if entry[0] < log_min:
                return False
            raw = self.log.read_bytes(entry[0] + OFF_STORE_TS, 8)
            return raw is not None and struct.unpack("<Q", raw)[0] >= timestamp_ms

        try:
            return cq.search(stored_at_or_after)
        except CorruptRecordError as e:
            self._mark_for_rebuild(topic, queue_id, e)
            raise

    def _read(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None
    ) -> tuple[list[Record], int]:
        scan = max_messages if tags is None else max(max_messages, self.config.max_scan_entries)
        try:
            cq = self.queues.queue(topic, queue_id)
            at, raw = cq.read_entries(offset, scan)
            picked, qoffs, next_offset = _select(self.log.min_offset, str(cq.directory), at, raw, max_messages, tags)
            records = self._entries.records(picked, qoffs, topic, queue_id)
        except CorruptRecordError as e:
            self._mark_for_rebuild(topic, queue_id, e)
            raise
        return [r for r in records if tags is None or r.tags in tags], next_offset

    def _read_raw(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None, max_bytes: int
    ) -> tuple[list[Span], int, int]:
        scan = max_messages if tags is None else max(max_messages, self.config.max_scan_entries)
        try:
            cq = self.queues.queue(topic, queue_id)
            at, raw = cq.read_entries(offset, scan)
            picked, qoffs, next_offset = _select(
                self.log.min_offset, str(cq.directory), at, raw, max_messages, tags, max_bytes
            )
            found, count = self._entries.spans(picked, qoffs, topic.encode(), queue_id)
        except CorruptRecordError as e:
            self._mark_for_rebuild(topic, queue_id, e)
            raise
        return [Span(*span) for span in found], count, next_offset

    def read_raw_many(
        self, asks: Sequence[ReadAsk], max_messages: int, max_per_queue: int, max_bytes: int
    ) -> list[ManyRead]:
        """:meth:`StoreBase.read_raw_many`, the records of all queues read together
        (:meth:`EntryReader.spans_many`: sorted by log position, one pread per
        neighbourhood, headers checked with array operations): every queue's entries
        are picked within the bounds first, then the records read. A queue whose
        entries or records are not what they should be (damage, retention meanwhile, a
        segment end) is read alone as by :meth:`read_raw`, and the queues after it are
        picked again from there: the answers are the per-queue loop's."""
        out: list[ManyRead] = []
        found = nbytes = 0
        while len(out) < len(asks):
            steps, end_found, end_nbytes = _plan_many(
                self, asks, len(out), found, nbytes, (max_messages, max_per_queue, max_bytes)
            )
            got = iter(self._entries.spans_many([st.read.pick for st in steps if isinstance(st.read, _Planned)]))
            found, nbytes = end_found, end_nbytes
            for st in steps:
                res = st.read.result(next(got)) if isinstance(st.read, _Planned) else st.read
                if isinstance(st.read, _Planned) and res is None:  # read alone below, from the counts before it
                    found, nbytes = st.found, st.nbytes
                    break
                out.append(res)
            if len(out) < len(asks):
                res, found, nbytes = self.read_one_of_many(
                    asks[len(out)], found, nbytes, max_messages, max_per_queue, max_bytes
                )
                out.append(res)
        return out

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


@dataclass(slots=True)
class _Planned:
    """A queue of a many-queue read whose entries are picked: its records to read."""

    pick: tuple[np.ndarray, np.ndarray, bytes, int]  # entries, their queue offsets, topic, queue id
    next_offset: int
    bounds: tuple[int, int]
    nbytes: int

    def result(self, got: tuple[list[FileSpan | bytes], int] | None) -> RawRead | None:
        """Its :class:`RawRead` from what :meth:`EntryReader.spans_many` read; None
        when that was not every record picked (the queue is then read alone)."""
        if got is None or got[1] != len(self.pick[0]):
            return None
        spans = [Span(None, 0, len(s), s) if isinstance(s, bytes) else Span(*s) for s in got[0]]
        return RawRead(GetStatus.FOUND, spans, got[1], self.next_offset, *self.bounds)


@dataclass(slots=True)
class _Step:
    """An ask's place in a many-queue read: the counts before it, and its read."""

    found: int
    nbytes: int
    read: ManyRead | _Planned


PLAN_CHUNK_ASKS = 256  # asks whose entries are fetched before their picks are worked out together


@dataclass(slots=True)
class _Head:
    """An ask whose queue holds entries at its offset: those entries (``raw`` from queue
    offset ``at``, up to the request's per-queue limit) and its queue's bounds."""

    ask: ReadAsk
    tag_set: set[str] | None
    at: int
    raw: bytes
    bounds: tuple[int, int]


def _heads(store: Store, asks: Sequence[ReadAsk], per_queue: int) -> tuple[list[RawRead | _Head], bool]:
    """Each ask's early answer (no such queue, an offset outside it) or its entries, in
    order; whether it stopped before an ask whose look-up failed (read that one alone)."""
    out: list[RawRead | _Head] = []
    for ask in asks:
        topic, queue_id, offset, tags = ask
        tag_set = check_get_args(topic, queue_id, offset, per_queue, tags, 1)
        try:
            early, lo, hi = store.check_get(topic, queue_id, offset)
            if early is not None:
                out.append(RawRead(early[0], next_offset=early[1], min_offset=lo, max_offset=hi))
                continue
            scan = per_queue if tag_set is None else max(per_queue, store.config.max_scan_entries)
            at, raw = store.queues.queue(topic, queue_id).read_entries(offset, scan)
        except CorruptRecordError:
            return out, True
        out.append(_Head(ask, tag_set, at, raw, (lo, hi)))
    return out, False


def _plan_many(
    store: Store, asks: Sequence[ReadAsk], begin: int, found: int, nbytes: int, limits: tuple[int, int, int]
) -> tuple[list[_Step], int, int]:
    """The asks from ``begin`` on picked in order within the bounds ``limits`` (max
    messages, per queue, max bytes) as :meth:`StoreBase.read_one_of_many` would, and the
    counts after them. It stops before an ask whose picking failed (read it alone).
    Entries are looked at a chunk of asks at a time, with array operations over all of
    them: per queue they cost more than its records' reading did."""
    max_messages, max_per_queue, max_bytes = limits
    steps: list[_Step] = []
    i = begin
    while i < len(asks):
        if found >= max_messages or nbytes >= max_bytes:
            steps += [_Step(found, nbytes, None) for _ in range(i, len(asks))]
            break
        heads, stopped = _heads(store, asks[i : i + PLAN_CHUNK_ASKS], max_per_queue)
        picker = _Picker(store, heads, limits)
        for head in heads:
            step = picker.step(head, found, nbytes)
            if step is None:  # its picking failed: read it alone
                return steps, found, nbytes
            steps.append(step)
            found, nbytes = picker.found, picker.nbytes
        i += len(heads)
        if stopped:
            break
    return steps, found, nbytes


class _Picker:
    """Works out the picks of a chunk of heads in order (the counts run on from one to
    the next). A queue whose entries are all live records and is read without a tag
    filter (the usual one) is picked from arrays made once for the chunk; others as by
    :func:`_select`."""

    def __init__(self, store: Store, heads: list[RawRead | _Head], limits: tuple[int, int, int]) -> None:
        self.store, self.limits = store, limits
        self.found = self.nbytes = 0
        raws = [h.raw for h in heads if isinstance(h, _Head)]
        self.entries = np.frombuffer(b"".join(raws), ENTRY_DTYPE)
        sizes = self.entries["size"].astype(np.int64)
        odd = (sizes == 0) | (self.entries["offset"] < store.log.min_offset)  # holes, retention
        self.cum = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self.odd = np.concatenate([[0], np.cumsum(odd)]).tolist()
        self.starts = iter(itertools.accumulate((len(r) // ENTRY_SIZE for r in raws), initial=0))

    def step(self, head: RawRead | _Head, found: int, nbytes: int) -> _Step | None:
        """The head's step after ``found`` records of ``nbytes``; None if picking failed."""
        max_messages, max_per_queue, max_bytes = self.limits
        self.found, self.nbytes = found, nbytes
        base = next(self.starts) if isinstance(head, _Head) else 0
        if found >= max_messages or nbytes >= max_bytes:
            return _Step(found, nbytes, None)
        if isinstance(head, RawRead):
            return _Step(found, nbytes, head)
        limit, room = min(max_per_queue, max_messages - found), max_bytes - nbytes
        n = len(head.raw) // ENTRY_SIZE
        try:
            read = (
                self._simple(head, base, n, limit, room) if self._plain(head, base, n) else self._any(head, limit, room)
            )
        except CorruptRecordError:
            return None
        if isinstance(read, _Planned):
            if nbytes and nbytes + read.nbytes > max_bytes:  # its first record alone is past the bound: next time
                self.nbytes = max_bytes
                return _Step(found, nbytes, None)
            self.found, self.nbytes = found + len(read.pick[0]), nbytes + read.nbytes
        return _Step(found, nbytes, read)

    def _plain(self, head: _Head, base: int, n: int) -> bool:
        return head.tag_set is None and n > 0 and self.odd[base + n] == self.odd[base]

    def _simple(self, head: _Head, base: int, n: int, limit: int, room: int) -> _Planned:
        """:func:`_select` for entries that are all live records, no tag filter."""
        k = min(limit, n)
        cum = self.cum
        keep = max(1, bisect.bisect_right(cum, cum[base] + room, base + 1, base + k + 1) - base - 1)
        full = k == limit or keep < k
        topic, queue_id, _offset, _tags = head.ask
        picked = self.entries[base : base + keep]
        qoffs = np.arange(head.at, head.at + keep, dtype=np.int64)
        return _Planned(
            (picked, qoffs, topic.encode(), queue_id),
            head.at + (keep if full else n),
            head.bounds,
            cum[base + keep] - cum[base],
        )

    def _any(self, head: _Head, limit: int, room: int) -> RawRead | _Planned:
        """The pick of :func:`_select` (the entries the per-queue read would scan)."""
        topic, queue_id, _offset, _tags = head.ask
        scan = limit if head.tag_set is None else max(limit, self.store.config.max_scan_entries)
        cq = self.store.queues.queue(topic, queue_id)
        raw = head.raw[: scan * ENTRY_SIZE]
        picked, qoffs, next_offset = _select(
            self.store.log.min_offset, str(cq.directory), head.at, raw, limit, head.tag_set, room
        )
        if not len(picked):
            return RawRead(GetStatus.NO_MATCHED_MESSAGE, [], 0, next_offset, *head.bounds)
        return _Planned((picked, qoffs, topic.encode(), queue_id), next_offset, head.bounds, int(picked["size"].sum()))


def _select(
    log_min: int,
    where: str,
    at: int,
    raw: bytes,
    max_messages: int,
    tag_set: set[str] | None,
    max_bytes: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The entries to read from ``raw`` (entries from queue offset ``at`` of the
    queue in directory ``where``), their queue offsets, and the queue offset after
    the last one looked at. Entries below ``log_min`` fell out of retention."""
    entries = np.frombuffer(raw, ENTRY_DTYPE)
    live = entries["offset"] >= log_min
    mask = entries["size"] > 0  # size 0: a hole marker
    if not live.all():  # below the log's start: retention, which only ever takes a queue's head
        _retained_prefix(entries, mask, live, at, where, log_min)
        mask &= live
    if tag_set is not None:
        mask &= np.isin(entries["tag"], np.array([tag_hash(t) for t in tag_set], dtype=np.uint64))
    idx = np.flatnonzero(mask)[:max_messages]
    full = len(idx) == max_messages
    if max_bytes is not None and len(idx):
        cum = np.cumsum(entries["size"][idx].astype(np.int64))
        keep = max(1, int(np.searchsorted(cum, max_bytes, side="right")))  # the first record always
        full, idx = full or keep < len(idx), idx[:keep]
    next_offset = at + (int(idx[-1]) + 1 if full else len(entries))
    return entries[idx], idx + at, next_offset


def _retained_prefix(
    entries: np.ndarray, real: np.ndarray, live: np.ndarray, at: int, where: str, log_min: int
) -> None:
    """Entries pointing below the log's start must be a prefix (retention deletes the
    oldest records first); one after a live entry is damage, not retention."""
    first_live = np.flatnonzero(real & live)
    if not len(first_live):
        return
    late = np.flatnonzero(real & ~live)
    late = late[late > first_live[0]]
    if len(late):
        i = int(late[0])
        raise CorruptRecordError(
            where,
            at + i,
            "consume queue entry",
            f"a commit-log offset >= {log_min} (the log's start)",
            str(int(entries["offset"][i])),
        )
