"""Durability: fsyncing what was written, and deciding when to.

Invariants:
- One flusher owns the durable offset: a flush holds ``LogState.flush_lock`` from the
  swap of the dirty set through its fsyncs to the publication, so flushes (the flush
  loop, :meth:`CommitLog.flush` callers, close) run one at a time. The durable offset
  therefore only moves forward, and only after every fsync that covers it returned:
  a later flush cannot publish past bytes an earlier one is still fsyncing.
- :meth:`Flusher.flush` publishes as durable only the ``end`` it read under the lock
  together with the dirty set, and only after fsyncing that set (every segment written
  below that end); :meth:`CommitLog.truncate` (holding ``flush_lock`` as well) lowers
  the durable offset with the end.
- An fsync error is final: the page cache can no longer be trusted to hold what the
  failed fsync should have written, so nothing is retried. The flush fails
  ``durable`` with a :class:`StoreFailedError` (waiters and callbacks are released at
  once), raises it, and so does every later flush; the flush loop ends by raising it.
- ``LogState.lock`` is held only to swap out ``dirty``/``dir_dirty`` and read ``end``;
  the fsyncs themselves run outside it, so appends continue during a flush (their
  segments land in the next dirty set).
- A segment deleted by retention or truncation is removed from ``dirty`` under the
  lock, so a flush does not fsync files that no longer belong to the log.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Callable

from clmq.common import StoreFailedError

from ._segment import Segment, fsync_dir
from ._state import LogState


class Flusher:
    """fsyncs the log's dirty segments and runs the flush loop."""

    __slots__ = ("_state",)

    def __init__(self, state: LogState) -> None:
        self._state = state

    def note_written(self, end: int) -> None:
        """After an append ending at ``end``: ask the flush loop to run if policy says so."""
        # Sync flush: start the group commit now, while the writer is still on its way
        # to wait for it (a broker's reply path hops threads before it registers).
        st = self._state
        config = st.config
        requested = st.durable.flush_requested
        if requested.is_set():  # already asked (set() takes a lock and notifies, per append)
            return
        if config.acks_wait_for_fsync or end - st.durable.value >= config.flush_dirty_bytes:
            requested.set()

    def flush(self) -> int:
        """fsync everything written so far; returns (and publishes) the durable offset.

        Raises :class:`StoreFailedError` when an fsync fails, now or before.
        """
        st = self._state
        with st.flush_lock:
            failed = st.durable.failure
            if failed is not None:
                # a fresh error each time: re-raising one object would pile up tracebacks
                if isinstance(failed, StoreFailedError):
                    raise StoreFailedError(failed.where, failed.cause)
                raise StoreFailedError("commitlog flush", failed)
            with st.lock:
                target = st.end
                dirty, st.dirty = st.dirty, set()
                dir_dirty, st.dir_dirty = st.dir_dirty, False
            started = time.perf_counter()
            try:
                for seg in sorted(dirty, key=lambda s: s.base):
                    _sync(seg)
                if dir_dirty:
                    fsync_dir(st.directory)
            except OSError as e:
                error = StoreFailedError("commitlog flush", e)
                st.durable.fail(error)
                raise error from e
            if dirty or dir_dirty:
                st.flush_times.record(time.perf_counter() - started)
            st.durable.publish(target)
            return target

    def wait_durable(self, offset: int, timeout_s: float) -> bool:
        """Block until ``offset`` is durable (group commit); False on timeout."""
        return self._state.durable.wait(offset, timeout_s)

    def on_durable(self, offset: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the flushing thread) once ``offset`` is durable."""
        self._state.durable.on_durable(offset, callback)

    def wake(self) -> None:
        """Make the flush loop run now (for example to notice that it should stop)."""
        self._state.durable.flush_requested.set()

    def flush_loop(self, stop: threading.Event, flush: Callable[[], object]) -> None:
        """The flush loop calling ``flush`` until ``stop`` is set, then a final flush;
        ends by raising :class:`StoreFailedError` when a flush fails."""
        st = self._state
        st.durable.run_flusher(flush, self._pending, stop, st.config.flush_interval_ms / 1000)

    def _pending(self) -> bool:
        # Read without the lock: a stale answer only delays a flush by one interval.
        st = self._state
        return st.end > st.durable.value or st.dir_dirty


def _sync(seg: Segment) -> None:
    """fdatasync one segment; one closed meanwhile (deleted by retention a pass ago)
    has nothing left to make durable."""
    if seg.fd < 0:
        return
    try:
        seg.sync()
    except OSError as e:
        if not (e.errno == errno.EBADF and seg.fd < 0):
            raise
