"""Appends in the partition-per-file mode: a batch grouped by queue and written with
one system call per queue file, all or nothing (a failed batch is cut back in every
partition it touched)."""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Callable, Collection, Sequence

from clmq.commitlog import BatchEncoder, EncodeError, QueueKey, now_ms
from clmq.common import Message, PackedMessages

from ._partition_flush import PartitionFlusher
from ._partition_log import PartitionLog, PartSegment
from ._partition_state import DISK_FULL, PartitionState
from ._puts import append_unpacked
from ._results import PutResult, PutStatus

log = logging.getLogger("clmq.partition")

# How to cut a partition back after a failed batch: the partition, the segment written
# to, and (segment count, size, record count, index length, time index length,
# since_index) as they were before the batch.
_Undo = tuple[PartitionLog, PartSegment, tuple[int, int, int, int, int, int]]


class PartitionWriter:
    """The partition mode's :class:`~._puts.Appender`. It writes one queue's share of a
    batch before it encodes the next, so a put checks every field first."""

    checks_fields = False

    def __init__(
        self, parts: PartitionState, flusher: PartitionFlusher, on_arrivals: Callable[[Collection[QueueKey]], None]
    ) -> None:
        self._parts = parts
        self._flusher = flusher
        self._on_arrivals = on_arrivals
        # Whole batches go to one file: no segment splitting (and so no blank markers).
        cl = parts.state.config.commitlog
        self._encoder = BatchEncoder(1 << 62, cl.max_message_bytes, cl.store_host)

    def append(self, messages: Sequence[Message]) -> PutResult:
        """Append a checked batch, all or nothing; readers see it at once."""
        parts = self._parts
        by_queue: dict[QueueKey, list[int]] = defaultdict(list)
        for i, m in enumerate(messages):
            by_queue[(m.topic, m.queue_id)].append(i)
        store_ts = now_ms()
        error: BaseException | None = None
        cut_error: OSError | None = None
        with parts.lock:
            undo: list[_Undo] = []
            try:
                q_offsets = self._append_all(messages, by_queue, store_ts, undo)
            except BaseException as e:  # whatever it is, no offset stays assigned
                error, cut_error = e, self._rollback(undo)
            end = parts.written
        if cut_error is not None:  # outside the lock: failing runs the durability callbacks
            parts.state.fail("rollback of a failed append", cut_error)
        if error is not None:
            return append_error(error, parts.root)
        self._on_arrivals(set(by_queue))
        self._flusher.note_written(end)
        return PutResult(PutStatus.OK, "", q_offsets, [], end, store_ts)

    def append_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int]) -> PutResult:
        """Through message objects, every field checked first."""
        return append_unpacked(self._parts.state, batches, self.append)

    def _append_all(
        self, messages: Sequence[Message], by_queue: dict[QueueKey, list[int]], store_ts: int, undo: list[_Undo]
    ) -> list[int]:
        """Each queue's share of the batch, in turn; the queue offsets of all messages."""
        q_offsets = [0] * len(messages)
        for key, idx in by_queue.items():
            offsets = self._append_to(self._parts.partition(key), [messages[i] for i in idx], store_ts, undo)
            for i, q in zip(idx, offsets):
                q_offsets[i] = q
        return q_offsets

    def _append_to(self, part: PartitionLog, msgs: list[Message], store_ts: int, undo: list[_Undo]) -> list[int]:
        """Encode and write one queue's share of a batch: one pwrite."""
        parts = self._parts
        seg = part.segments[-1]
        state = (len(part.segments), seg.size, seg.count, len(seg.index), len(seg.times), seg.since_index)
        key = (part.topic, part.queue_id)
        batch = self._encoder.encode(msgs, 0, seg.size, {key: part.next_offset}, {}, store_ts)
        data = batch.groups[0].data
        seg, rolled = part.active_for(len(data))
        undo.append((part, part.segments[-2] if rolled else seg, state))
        if rolled:  # positions changed: encode again at the start of the new file
            parts.new_dirs.add(part.directory)
            batch = self._encoder.encode(msgs, 0, 0, {key: part.next_offset}, {}, store_ts)
            data = batch.groups[0].data
        parts.files.pwrite(seg.path, data, seg.size)
        starts = batch.groups[0].starts
        part.appended(seg, starts, [b - a for a, b in zip(starts, starts[1:] + [seg.size + len(data)])], store_ts)
        parts.dirty.add(seg.path)
        parts.written += len(data)
        return batch.queue_offsets

    def _rollback(self, undo: list[_Undo]) -> OSError | None:
        """Cut every partition touched by a failed batch back to where it was; the error
        of a cut that failed (then a file may keep bytes no offset owns: the store fails)."""
        files = self._parts.files
        failed: OSError | None = None
        for part, seg, (nsegs, size, count, nidx, ntimes, since) in reversed(undo):
            for extra in part.segments[nsegs:]:
                files.forget(extra.path)
                extra.path.unlink(missing_ok=True)
            del part.segments[nsegs:]
            try:
                files.truncate(seg.path, size)
            except OSError as e:
                log.error("partition %s: could not cut %s back to %d bytes: %s", part.directory, seg.path, size, e)
                failed = failed or e
            seg.size, seg.count, seg.since_index = size, count, since
            del seg.index[nidx:]
            del seg.times[ntimes:]
        return failed


def append_error(error: BaseException, root: Path) -> PutResult:
    """The result of an append that failed and was rolled back; anything other than an
    expected outcome (bad message, I/O error) is raised again."""
    if isinstance(error, EncodeError):
        return PutResult(PutStatus.MESSAGE_TOO_LARGE if error.too_large else PutStatus.INVALID_MESSAGE, str(error))
    if isinstance(error, OSError):
        status = PutStatus.DISK_FULL if error.errno in DISK_FULL else PutStatus.IO_ERROR
        return PutResult(status, f"{error.strerror} while appending to {root}: nothing written")
    raise error
