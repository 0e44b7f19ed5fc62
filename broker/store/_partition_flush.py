"""Durability in the partition-per-file mode: fsyncing every file written since the
last flush (group commit over all of them), the flush loop, the recovery points, and
the housekeeping loop that writes them.

Promises: one flush at a time (``PartitionState.flush_lock``), and the durable offset
is published only after every fsync covering it has returned. An fsync error fails the
store (nothing retried, nothing published); housekeeping retries only a full disk.
"""

from __future__ import annotations

import logging
import time

from clmq.commitlog import fsync_dir, write_json
from clmq.common import StoreFailedError

from ._partition_state import DISK_FULL, PartitionState

log = logging.getLogger("clmq.partition")


class PartitionFlusher:
    """fsyncs the partitions' files and writes their recovery points."""

    def __init__(self, parts: PartitionState) -> None:
        self._parts = parts

    def note_written(self, end: int) -> None:
        """After an append ending at ``end``: ask the flush loop to run if policy says so.
        A put that waits for fsync asks itself (:meth:`DurableOffset.wait`); else dirty
        bytes past ``flush_dirty_bytes`` do."""
        durable, cl = self._parts.state.durable, self._parts.state.config.commitlog
        if not cl.acks_wait_for_fsync and end - durable.value >= cl.flush_dirty_bytes:
            durable.flush_requested.set()

    def flush(self) -> int:
        """fsync every file written since the last flush, then publish the durable
        offset; returns it. One flush at a time (see ``flush_lock``). An fsync error
        fails the store (:class:`~commitlog.StoreFailedError`): after it the page cache
        cannot be trusted, so nothing is retried and nothing more is published."""
        parts = self._parts
        with parts.flush_lock:
            failure = parts.state.failure
            if failure is not None:
                raise failure
            with parts.lock:
                target, dirty, parts.dirty = parts.written, parts.dirty, set()
                new_dirs, parts.new_dirs = parts.new_dirs, set()
            try:
                for path in dirty:
                    parts.files.sync(path, reopen=True)
                for directory in new_dirs:  # new segments' names, as durable as their bytes
                    fsync_dir(directory)
            except OSError as e:
                parts.state.fail("flush", e)
                raise StoreFailedError("flush", e) from e
            parts.state.durable.publish(target)
            return target

    def flush_loop(self) -> None:
        """The flush thread: flush when asked (group commit) or every ``flush_interval_ms``."""
        parts = self._parts
        parts.state.durable.run_flusher(
            self.flush,
            lambda: parts.written > parts.state.durable.value,
            parts.state.stop,
            parts.state.config.commitlog.flush_interval_ms / 1000,
        )

    def checkpoint(self) -> None:
        """Record each partition's recovery point: all below it is fsynced."""
        parts = self._parts
        with parts.state.checkpoint_lock:
            with parts.lock:
                points = {key: part.next_offset for key, part in parts.partitions.items()}
                written = parts.written
            if written > parts.state.durable.value:
                self.flush()
            write_json(
                parts.state.directory / "recovery-points",
                {"version": 1, "points": [[t, q, n] for (t, q), n in points.items()]},
            )


def housekeeping_loop(parts: PartitionState, flusher: PartitionFlusher) -> None:
    """Checkpoint every ``cq_flush_interval_ms``, retention now and then. A full disk
    is retried next round; any other error ends the thread and fails the store."""
    config = parts.state.config
    interval_ms = config.cq_flush_interval_ms
    every = max(1, config.retention_check_interval_ms // interval_ms)
    rounds = 0
    while not parts.state.stop.wait(interval_ms / 1000) and parts.state.failure is None:
        rounds += 1
        try:
            flusher.checkpoint()
            if rounds % every == 0:
                apply_retention(parts)
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            log.warning("partition housekeeping: %s; retried in %d ms", e, interval_ms)


def apply_retention(parts: PartitionState, now: float | None = None) -> int:
    """Delete every partition's segments past retention; returns how many went."""
    cl = parts.state.config.commitlog
    with parts.lock:
        return sum(
            p.delete_before(parts.files, cl.retention_ms, cl.retention_bytes, now or time.time())
            for p in parts.partitions.values()
        )
