"""The CommitLog: one sequential log holding every message of every queue.

Invariants:
- Offsets are byte positions in the log. Segments are contiguous: each one's base is
  the previous one's ``base + length``; only the last segment (the *active* one) grows.
- A single writer (under ``LogState.lock``) appends; queue offsets are assigned there
  from the ``(topic, queue) -> next offset`` table, so that they are dense and never
  reused.
- ``durable_offset <= write_offset``; ``confirmed_offset <= write_offset`` and nothing
  past ``confirmed_offset`` is handed to consumers (replication lowers it).
- No append waits for fsync while holding the lock (flushes fsync outside it); only
  the rare :meth:`CommitLog.truncate` makes its cut durable before releasing it.
- Flushes run one at a time and an fsync error is final: the log then refuses appends
  (STORE_FAILED) and every flush raises :class:`StoreFailedError`.
- Every open verifies what was promised (segment chain; at a clean open the end and
  the last record; at an unclean one nothing below the checkpoint is cut) and raises
  :class:`LogDamageError` rather than dropping promised bytes; reads inside the log
  raise :class:`CorruptRecordError` rather than answering "not there".
- Every file operation goes through :data:`clmq.commitlog.fileops.OPS`.

:class:`CommitLog` is a facade over parts that each state their own invariants:

- :mod:`._state` — :class:`LogState`, the one owner of all mutable state and of the
  locking rules (including why readers need no lock);
- :mod:`._segments` — :class:`SegmentSet`, the immutable snapshot of the segments;
- :mod:`._appender` — the single writer: appends, rollback, rolling, truncation
  (with :mod:`._raw` validating raw appends);
- :mod:`._reader` — lock-free reads;
- :mod:`._flush` — fsync and the flush loop;
- :mod:`._recovery` — opening, and validating the tail after a crash (with
  :mod:`._scan` walking segments);
- :mod:`._retention` — deleting old segments, closing them one pass later.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

from clmq.common import Message, PackedMessages, Record

from ._appender import Appender
from ._config import CommitLogConfig
from ._durability import DurableOffset
from ._encoder import QueueKey
from ._flush import Flusher
from ._reader import Reader
from ._recovery import Repairs, load_segments, open_clean, recover
from ._results import AppendResult, AppendStatus, now_ms
from ._retention import Retention
from ._scan import ScanResult
from ._state import LogState
from ._timings import Timings

__all__ = ["AppendResult", "AppendStatus", "CommitLog", "QueueKey", "ScanResult", "now_ms"]


class CommitLog:
    """Segmented, append-only log. Use :meth:`open`; close with :meth:`close`."""

    def __init__(self, directory: Path, config: CommitLogConfig) -> None:
        self.directory = directory
        self.config = config
        self._state = LogState(directory, config)
        self._flusher = Flusher(self._state)
        self._appender = Appender(self._state, self._flusher)
        self._reader = Reader(self._state)
        self._retention = Retention(self._state)

    @classmethod
    def open(
        cls,
        directory: Path | str,
        config: CommitLogConfig,
        *,
        clean: bool,
        checkpoint_offset: int | None,
        expected_end: int | None = None,
    ) -> CommitLog:
        """Open (creating if needed) the log in ``directory``, verifying what was promised.

        Every open checks that each segment but the last ends where the next one
        starts. After a clean shutdown (``clean=True``) the log must end at
        ``expected_end`` (the checkpoint's durable offset; not checked when None) with
        a whole last record and a good CRC. After an unclean one the log is validated
        from the start of the segment holding ``checkpoint_offset`` (from the first
        segment when there is no checkpoint) and a torn or corrupt tail at or past
        ``checkpoint_offset`` is durably truncated. Damage to bytes that were promised
        raises :class:`LogDamageError` (file, byte range, reason) and changes nothing.
        Boundary indexes that fail their checks are rebuilt (one log line says so).
        """
        self = cls(Path(directory), config)
        st = self._state
        repairs = Repairs()
        load_segments(st)
        try:
            if clean:
                open_clean(st, expected_end, self._appender.roll_locked, repairs)
            else:
                recover(st, checkpoint_offset, self._appender.roll_locked, repairs)
        except BaseException:
            st.close_files()
            raise
        finally:
            repairs.report(st)
        st.end = st.snapshot.active.end
        st.durable.publish(st.end)
        return self

    # ------------------------------------------------------------------ offsets
    @property
    def write_offset(self) -> int:
        """The end of the last completed append."""
        return self._state.end

    @property
    def min_offset(self) -> int:
        """The first offset still in the log (retention advances it)."""
        return self._state.snapshot.segments[0].base

    @property
    def flush_times(self) -> Timings:
        """How long flushes took (the fsyncs of one flush together): a histogram."""
        return self._state.flush_times

    @property
    def durable_offset(self) -> int:
        """How far the log is fsynced."""
        return self._state.durable.value

    @property
    def durability(self) -> DurableOffset:
        """The durable offset and its waiters (shared with the store built on this log)."""
        return self._state.durable

    @property
    def confirmed_offset(self) -> int:
        """How far consumers may read: the write end, or less while replication lags."""
        return self._state.confirmed_offset

    def set_confirmed_offset(self, offset: int | None) -> None:
        """Limit what is dispatched to consumers (replication); None follows the write end."""
        self._state.confirmed = offset
        self._state.notify_append()

    def add_append_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (from the appending thread, outside the lock) after every append."""
        self._state.listeners.append(fn)

    def queue_offset_table(self) -> dict[QueueKey, int]:
        """A copy of the next offset per queue."""
        with self._state.lock:
            return dict(self._state.queue_offsets)

    def set_queue_offset_table(self, table: dict[QueueKey, int]) -> None:
        """Install the next offset per queue (recomputed from the consume queues)."""
        with self._state.lock:
            self._state.queue_offsets = dict(table)

    # ---------------------------------------------------------------- appending
    def append(self, messages: Sequence[Message]) -> AppendResult:
        """Append messages as one batch, in order; one system call per segment touched.

        Nothing is written unless every message can be: a message over
        ``max_message_bytes`` or a full disk fails the whole batch.
        """
        return self._appender.append(messages)

    def append_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int]) -> AppendResult:
        """Append packed messages (as producers send them) as one batch, in order.

        Each batch's queue ids must be below its entry in ``queue_counts``. All or
        nothing, as :meth:`append`; malformed bytes give MALFORMED_BATCH and a queue id
        out of range INVALID_QUEUE_ID. ``batch_sizes`` of the result counts the
        messages of each batch.
        """
        return self._appender.append_packed(batches, queue_counts)

    def append_raw(self, offset: int, data: bytes) -> AppendResult:
        """Append already-formatted bytes at ``offset`` (a follower copying its leader).

        ``offset`` must equal the write offset and ``data`` must be whole records and
        blank markers whose embedded offsets match where they land; every record's CRC
        is checked before anything is written. Queue offsets are taken from the records.
        """
        return self._appender.append_raw(offset, data)

    def truncate(self, offset: int) -> None:
        """Durably cut the log to ``offset`` (a record boundary), e.g. for a follower.

        The caller recomputes queue offsets afterwards (the store does).
        """
        self._appender.truncate(offset)

    def restart_at(self, base: int) -> None:
        """Durably delete every segment and start an empty log at ``base`` (a follower
        whose leader's log starts past this log's end: it copies from there). Queue
        offsets start again from the records appended next."""
        self._appender.restart_at(base)

    # ------------------------------------------------------------------ reading
    def segment_path(self, offset: int) -> str:
        """The file holding ``offset`` (for error messages)."""
        return self._reader.segment_path(offset)

    def file_span(self, offset: int, size: int) -> tuple[Path, int] | None:
        """``(segment path, file position)`` of ``[offset, offset + size)`` if those bytes
        are written and lie in one segment (for zero-copy sends), else None."""
        return self._reader.file_span(offset, size)

    def segments(self) -> list[tuple[int, int, Path]]:
        """``(base, length, path)`` of every segment, oldest first."""
        return self._reader.segments()

    def boundaries(self, base: int) -> list[int]:
        """Log offsets of record starts spaced about ``boundary_interval_bytes`` apart."""
        return self._reader.boundaries(base)

    def read_bytes(self, offset: int, size: int) -> bytes | None:
        """Raw bytes of ``[offset, offset + size)`` if they lie in one segment, else None.

        None means "not in the log" (below :attr:`min_offset`, past the end) or "not in
        one segment"; an I/O error or a short read inside the log raises
        :class:`CorruptRecordError` (check ``read``), never None.
        """
        return self._reader.read_bytes(offset, size)

    def read_record(self, offset: int, size: int | None = None) -> Record | None:
        """The record at ``offset``, CRC-checked; None if the offset fell out of the log.

        Raises :class:`CorruptRecordError` when the bytes there are not a valid record.
        """
        return self._reader.read_record(offset, size)

    def read_chunk(self, offset: int, max_bytes: int, limit: int | None = None) -> tuple[int, bytes]:
        """Up to ``max_bytes`` raw bytes from ``offset`` within one segment, not past ``limit``.

        Returns ``(offset, data)``; if ``offset`` is at a segment's blank marker the
        caller sees the marker and moves to the next segment's base itself.
        """
        return self._reader.read_chunk(offset, max_bytes, limit)

    def map_chunk(self, offset: int, max_bytes: int, limit: int | None = None) -> tuple[int, memoryview]:
        """Like :meth:`read_chunk`, but a read-only memory map instead of a copy.

        For readers that look at a fraction of each record (headers): only the pages
        touched are faulted in and nothing is copied. The view keeps the map alive.
        """
        return self._reader.map_chunk(offset, max_bytes, limit)

    def next_segment_base(self, offset: int) -> int:
        """The base of the segment after the one holding ``offset``."""
        return self._reader.next_segment_base(offset)

    def iter_records(self, start: int | None = None, end: int | None = None) -> Iterator[Record]:
        """Every record in ``[start, end)``, CRC-checked, in log order."""
        return self._reader.iter_records(start, end)

    # ----------------------------------------------------------------- flushing
    def flush(self) -> int:
        """fsync everything written so far; returns (and publishes) the durable offset.

        Flushes run one at a time. An fsync error is final: this and every later flush
        raise :class:`StoreFailedError`, waiters are released, appends are refused
        (STORE_FAILED); reopening the directory recovers what was durable.
        """
        return self._flusher.flush()

    def wait_durable(self, offset: int, timeout_s: float) -> bool:
        """Block until ``offset`` is durable (group commit); False on timeout."""
        return self._flusher.wait_durable(offset, timeout_s)

    def on_durable(self, offset: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the flushing thread) once ``offset`` is durable."""
        self._flusher.on_durable(offset, callback)

    def wake_flusher(self) -> None:
        """Make the flush loop run now (for example to notice that it should stop)."""
        self._flusher.wake()

    def run_flusher(self, stop: threading.Event) -> None:
        """The flush loop: group commit in sync mode, interval/dirty bytes in async mode.

        Run it in a thread; it returns after ``stop`` is set (with a final flush), or
        raises :class:`StoreFailedError` when an fsync fails.
        """
        # ``self.flush``, looked up now rather than the flusher's own: whoever wraps the
        # instance's ``flush`` (a test counting fsyncs) sees the loop's flushes too.
        self._flusher.flush_loop(stop, self.flush)

    # ---------------------------------------------------------------- retention
    def delete_expired(self, now: float | None = None) -> int:
        """Delete whole segments past ``retention_ms`` or ``retention_bytes``; never the active one.

        Returns the number of segments deleted; the log's minimum offset advances.
        """
        return self._retention.delete_expired(now)

    def hold_retention(self, floor: Callable[[], int | None]) -> None:
        """Keep every segment from the one holding ``floor()`` on, whatever its age or
        the log's size (retention by time or bytes deletes only below it; None: no
        floor). Each call adds a holder; the lowest floor of all of them holds: the
        broker's timer holds the scheduled messages it has yet to deliver, its
        transactions the half messages still pending."""
        self._retention.holders.append(floor)

    def delete_before(self, offset: int) -> int:
        """Delete the oldest whole segments that end at or below ``offset``, never the
        active one (a follower follows its leader's retention); returns how many."""
        return self._retention.delete_before(offset)

    def close(self) -> None:
        """Flush and close every file (closed even when the flush raises
        :class:`StoreFailedError`)."""
        try:
            self.flush()
        finally:
            self._state.close_files()

    def abandon(self) -> None:
        """Close descriptors without flushing: what a crash leaves behind (tests, fencing)."""
        self._state.close_files()
