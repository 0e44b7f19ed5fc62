"""The CommitLog mode's background upkeep: writing queue entries to their files and
the checkpoint after them, and retention. The housekeeping thread runs
:func:`housekeeping_loop`; open, close and callers checkpoint through :func:`checkpoint`.

A full disk (ENOSPC) while writing queue files is retried next round (nothing is lost:
entries stay in memory and the previous checkpoint stays in force); any other error
ends the thread, and its guard fails the store."""

from __future__ import annotations

import errno
import logging

from clmq.common import CorruptRecordError

from ._checkpoint import Checkpoint, CheckpointRows
from ._log_parts import LogParts

log = logging.getLogger("clmq.store")


def checkpoint(parts: LogParts, sync: bool = False, full: bool = True) -> Checkpoint:
    """Write queue entries to their files (``full``: all, and the key index; else the
    queues with at least ``cq_flush_min_bytes`` waiting) and record what is on disk;
    one at a time.

    Raises OSError (disk full) with nothing lost: entries that could not be written
    stay in memory and the previous checkpoint stays in force.
    """
    with parts.state.checkpoint_lock:
        return _checkpoint(parts, sync, full)


def _checkpoint(parts: LogParts, sync: bool, full: bool) -> Checkpoint:
    config = parts.state.config
    dispatched = parts.dispatcher.dispatched_offset  # read first: entries below it are in memory
    oldest = parts.queues.flush(sync=sync, min_bytes=0 if full else config.cq_flush_min_bytes)
    if oldest is not None:  # re-dispatch must start before entries that only memory holds
        dispatched = min(dispatched, oldest)
    # The table is carried forward: the checkpointed extents of queues not loaded (set
    # at open) and of loaded queues as last seen, updated with the queues that changed.
    changed = parts.queues.changed_extents()
    parts.manifest.update(changed)
    if parts.index is not None and full:
        # The index says itself what it holds (its files' headers), so a crash re-indexes
        # from there: it is made durable with the full flush only. Every second it
        # rewrote its whole slot table (random keys dirty most of its 20 MB) and
        # fdatasynced it, which held the log's group commits ~10 ms once a second: the
        # p99 of sync-flush produce at 10k msgs/s.
        parts.index.persist(sync=True)
    saved = parts.saved
    rows = saved.rows if saved is not None and saved.rows is not None else CheckpointRows()
    rows.track(parts.manifest, changed)
    durable = parts.log.durable_offset
    if saved is not None and not rows.stale and (saved.log_durable, saved.dispatched) == (durable, dispatched):
        return saved  # unchanged (an idle or read-only second): the file already says it
    cp = Checkpoint(durable, dispatched, dict(parts.manifest), rows=rows)
    cp.save(parts.state.directory / "checkpoint")
    parts.saved = cp
    return cp


def housekeeping_loop(parts: LogParts) -> None:
    """Checkpoint every ``cq_flush_interval_ms`` (writing all queues every
    ``cq_full_flush_interval_ms``), retention every ``retention_check_interval_ms``,
    until the store stops."""
    config = parts.state.config
    interval = config.cq_flush_interval_ms / 1000
    every = max(1, config.retention_check_interval_ms // config.cq_flush_interval_ms)
    full_every = max(1, config.cq_full_flush_interval_ms // config.cq_flush_interval_ms)
    rounds = 0
    while not parts.state.stop.wait(interval):
        try:
            checkpoint(parts, full=(rounds + 1) % full_every == 0)
            rounds += 1
            if rounds % every == 0:
                apply_retention(parts)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise  # EIO and the like: the page cache cannot be trusted (the thread's guard fails the store)
            log.warning("store housekeeping: %s; retrying in %d ms", e, config.cq_flush_interval_ms)


def apply_retention(parts: LogParts, now: float | None = None) -> int:
    """Delete expired log segments, the queue files that only point into them and the
    key index files whose every message is gone."""
    deleted = parts.log.delete_expired(now)
    parts.entries.forget_missing()  # every pass: what the last one dropped is closed now
    if parts.index is not None:
        parts.index.delete_before(parts.log.min_offset)  # key index files whose messages are all gone
    if deleted:
        for key in parts.queues.known():  # queues not loaded yet are trimmed when they are
            cq = parts.queues.queue(*key)
            if not cq.loaded:
                continue
            try:
                cq.delete_before(parts.log.min_offset)
            except CorruptRecordError as e:  # one damaged queue must not fail the housekeeping thread
                parts.mark_for_rebuild(key[0], key[1], e)
    return deleted
