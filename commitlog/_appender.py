"""The single writer: encoding, writing, rolling and cutting the log's tail.

Invariants:
- Every method that changes the log runs under ``LogState.lock`` (the ``*_locked``
  ones expect the caller to hold it); that is what makes the appender the single
  writer and queue offsets dense: they are taken from ``queue_offsets`` under it.
- All or nothing: an append that fails (bad input, disk full) restores the queue
  offsets it took, cuts the active segment back, and removes the segments it rolled
  to; ``end`` moves only after every byte of a batch is written, so a failed batch
  was never visible to a reader.
- Records never cross segments: a full segment ends in a blank marker, is sealed
  (extended to ``segment_bytes``) and followed by a new, empty active segment.
- Once durability failed (``durable.failure``, an fsync error), nothing more is
  written: every append answers STORE_FAILED, checked under the lock.
- A failed append whose rollback cannot cut the active segment back (ftruncate
  error) fails the log the same way: its file length no longer says where the log ends.
- Every file operation goes through :data:`clmq.commitlog.fileops.OPS`.
- Changes of the segment set are ordered so that a crash leaves a chain every open
  accepts: a roll seals (extends) the old segment before creating the next, and a
  truncation removes the later segments (directory fsync) before cutting the file.
- Listeners and the flush request run after the lock is released.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from clmq.common import CorruptRecordError, Message, PackedMessages, StoreFailedError

from . import fileops
from ._encoder import BatchEncoder, EncodedBatch, EncodeError, QueueKey, restore_offsets
from ._flush import Flusher
from ._raw import split_raw
from ._results import ENCODE_STATUS, AppendResult, AppendStatus, now_ms
from ._segment import Segment, fsync_dir
from ._segments import SegmentSet
from ._state import LogState

log = logging.getLogger("clmq.commitlog")

# (segment base, file position, undo table, store timestamp) -> the encoded batch
Encode = Callable[[int, int, dict[QueueKey, int], int], EncodedBatch]


class Appender:
    """Appends (encoded, packed or raw) and truncation of one log.

    The active segment is taken as ``snapshot.segments[-1]`` rather than through
    ``SegmentSet.active``: the same thing, without a property call on the append path.
    """

    __slots__ = ("_broken", "_encoder", "_flusher", "_state")

    def __init__(self, state: LogState, flusher: Flusher) -> None:
        self._state = state
        self._flusher = flusher
        # Set under the lock when a file operation left the log's files in doubt; the
        # durability is failed with it right after the lock is released (failing runs
        # callbacks, which must not run under the lock).
        self._broken: StoreFailedError | None = None
        config = state.config
        self._encoder = BatchEncoder(config.segment_bytes, config.max_message_bytes, config.store_host)

    # ------------------------------------------------------------ encoded appends
    def append(self, messages: Sequence[Message]) -> AppendResult:
        """Encode and append ``messages`` as one batch (see :meth:`CommitLog.append`)."""
        encoder, st = self._encoder, self._state
        return self._run(lambda base, pos, undo, ts: encoder.encode(messages, base, pos, st.queue_offsets, undo, ts))

    def append_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int]) -> AppendResult:
        """Append packed batches as one batch (see :meth:`CommitLog.append_packed`)."""
        encoder, st = self._encoder, self._state
        return self._run(
            lambda base, pos, undo, ts: encoder.encode_packed(
                batches, queue_counts, base, pos, st.queue_offsets, undo, ts
            )
        )

    def _run(self, encode: Encode) -> AppendResult:
        with self._state.lock:
            result = self._append_locked(encode)
        self._fail_if_broken()
        if result.ok:
            self._after_write(result.end_offset)
        return result

    def _append_locked(self, encode: Encode) -> AppendResult:
        st = self._state
        if st.durable.failure is not None or self._broken is not None:
            return self._refused()
        store_ts = now_ms()
        orig = st.snapshot.segments[-1]
        orig_size = orig.size
        undo: dict[QueueKey, int] = {}
        try:
            batch = encode(orig.base, orig.size, undo, store_ts)
        except (EncodeError, UnicodeError, ValueError) as e:
            restore_offsets(st.queue_offsets, undo)
            kind = e.kind if isinstance(e, EncodeError) else "invalid"
            return AppendResult(ENCODE_STATUS[kind], str(e))
        try:
            for group in batch.groups:
                self._write_locked(group.start, group.data, group.starts, group.sealed)
        except OSError as e:
            self._rollback_locked(orig, orig_size, undo)
            status = AppendStatus.DISK_FULL if e.errno in (28, 122) else AppendStatus.IO_ERROR
            return AppendResult(status, f"{e.strerror} while appending to {st.directory}: nothing written")
        st.end = end = st.snapshot.segments[-1].end
        return AppendResult(
            AppendStatus.OK,
            "",
            batch.commitlog_offsets[0] if batch.commitlog_offsets else end,
            end,
            store_ts,
            batch.queue_offsets,
            batch.commitlog_offsets,
            batch.batch_sizes,
        )

    # ---------------------------------------------------------------- raw appends
    def append_raw(self, offset: int, data: bytes) -> AppendResult:
        """Append validated, already-formatted bytes (see :meth:`CommitLog.append_raw`)."""
        with self._state.lock:
            result = self._append_raw_locked(offset, data)
        self._fail_if_broken()
        if result.ok:
            self._after_write(result.end_offset)
        return result

    def _append_raw_locked(self, offset: int, data: bytes) -> AppendResult:
        st = self._state
        if st.durable.failure is not None or self._broken is not None:
            return self._refused()
        if offset != st.end:
            return AppendResult(AppendStatus.OFFSET_MISMATCH, f"raw append at {offset}, log ends at {st.end}")
        orig = st.snapshot.segments[-1]
        orig_size = orig.size
        undo: dict[QueueKey, int] = {}
        try:
            pieces = split_raw(data, offset, orig.base, orig_size, st.config.segment_bytes, st.queue_offsets, undo)
        except CorruptRecordError as e:
            restore_offsets(st.queue_offsets, undo)
            return AppendResult(AppendStatus.INVALID_MESSAGE, str(e))
        try:
            for piece, starts, sealed in pieces:
                self._write_locked(st.snapshot.segments[-1].size, piece, starts, sealed)
        except OSError as e:
            self._rollback_locked(orig, orig_size, undo)
            return AppendResult(AppendStatus.DISK_FULL if e.errno == 28 else AppendStatus.IO_ERROR, str(e))
        st.end = st.snapshot.segments[-1].end
        return AppendResult(AppendStatus.OK, start_offset=offset, end_offset=st.end)

    # -------------------------------------------------------------- tail changes
    def _write_locked(self, start: int, data: bytes | bytearray, starts: list[int], sealed: bool) -> None:
        """Write one segment's share of a batch at file position ``start``; one pwrite."""
        st = self._state
        seg = st.snapshot.segments[-1]
        seg.write(start, data)
        seg.size = start + len(data)
        st.dirty.add(seg)
        seg.boundaries.append_to_file(seg.boundaries.note(starts))
        if sealed:
            self.roll_locked()

    def roll_locked(self) -> None:
        """Seal the active segment (it ends in a blank marker) and start the next."""
        st = self._state
        config = st.config
        old = st.snapshot.segments[-1]
        old.seal(config.segment_bytes)  # first: a crash in between leaves a sealed last segment
        new = Segment(st.directory, old.base + config.segment_bytes, config.boundary_interval_bytes, create=True)
        st.snapshot = st.snapshot.extended(new)
        st.dir_dirty = True

    def _rollback_locked(self, orig: Segment, orig_size: int, undo: dict[QueueKey, int]) -> None:
        """Undo a partly written batch so that a failed append leaves no trace."""
        st = self._state
        restore_offsets(st.queue_offsets, undo)
        snapshot = st.snapshot
        keep = snapshot.index(orig.base) + 1
        added = snapshot.segments[keep:]
        st.snapshot = snapshot.head(keep)
        # Closed at once, not via the graveyard: they never held a byte below ``end``,
        # so no read (all are bounded by ``end``) ever reached them.
        for seg in added:
            seg.close()
            seg.delete()
        st.dirty.difference_update(added)
        try:
            fileops.OPS.ftruncate(orig.fd, orig_size)
        except OSError as e:
            log.exception("commitlog: could not cut %s back to %d after a failed append", orig.path, orig_size)
            self._broken = StoreFailedError("commitlog rollback", e)
        orig.size, orig.sealed = orig_size, False
        orig.boundaries.truncate(orig_size)

    def truncate(self, offset: int) -> None:
        """Durably cut the log to ``offset`` (see :meth:`CommitLog.truncate`)."""
        try:
            self._truncate(offset)
        finally:
            self._fail_if_broken()

    def _truncate(self, offset: int) -> None:
        st = self._state
        # flush_lock first: a flush under way must not publish its (older, higher) end
        # after the cut lowered the durable offset.
        with st.flush_lock, st.lock:
            if offset >= st.end:
                return
            snapshot = st.snapshot
            i = snapshot.index(offset)
            later = snapshot.segments[i + 1 :]
            for seg in later:
                seg.delete()
                st.graveyard.append(seg)  # readers may still hold it: closed a retention pass later
                st.dirty.discard(seg)
            st.snapshot = snapshot.head(i + 1)
            seg = snapshot.segments[i]
            try:
                if later:  # gone for good before the cut: a crash never leaves a short middle segment
                    fsync_dir(st.directory)
                seg.truncate(offset - seg.base)
            except OSError as e:  # the cut may or may not be on disk: trust nothing more
                self._broken = StoreFailedError("commitlog truncate", e)
                raise
            seg.sealed = False
            st.end = offset
            st.durable.lower(offset)
            if st.confirmed is not None:
                st.confirmed = min(st.confirmed, offset)

    def restart_at(self, base: int) -> None:
        """Durably empty the log and start it again at ``base`` (see :meth:`CommitLog.restart_at`)."""
        try:
            self._restart_at(base)
        finally:
            self._fail_if_broken()

    def _restart_at(self, base: int) -> None:
        st = self._state
        with st.flush_lock, st.lock:
            for seg in st.snapshot.segments:
                seg.delete()
                st.graveyard.append(seg)  # readers may still hold it: closed a retention pass later
                st.dirty.discard(seg)
            try:
                fsync_dir(st.directory)  # the old files are gone before the new start exists
                new = Segment(st.directory, base, st.config.boundary_interval_bytes, create=True)
                fsync_dir(st.directory)
            except OSError as e:
                self._broken = StoreFailedError("commitlog restart", e)
                raise
            st.snapshot = SegmentSet.of([new])
            st.end = base
            st.queue_offsets = {}
            st.durable.lower(base)
            st.durable.publish(base)
            if st.confirmed is not None:
                st.confirmed = min(st.confirmed, base)

    def _after_write(self, end: int) -> None:
        self._flusher.note_written(end)
        self._state.notify_append()

    def _refused(self) -> AppendResult:
        failure = self._state.durable.failure or self._broken
        return AppendResult(AppendStatus.STORE_FAILED, f"{failure}: nothing written")

    def _fail_if_broken(self) -> None:
        """After the lock: fail durability when a file operation under it went wrong."""
        if self._broken is not None:
            self._state.durable.fail(self._broken)
