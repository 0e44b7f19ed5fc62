"""Durability: fsyncing what was written, and deciding when to.

Invariants:
- :meth:`Flusher.flush` publishes as durable only the ``end`` it read under the lock
  together with the dirty set, and only after fsyncing that set (every segment written
  below that end); :meth:`CommitLog.truncate` lowers the durable offset with the end.
- The lock is held only to swap out ``dirty``/``dir_dirty`` and read ``end``; the
  fsyncs themselves run outside it, so appends continue during a flush (their
  segments land in the next dirty set).
- A segment deleted by retention or truncation is removed from ``dirty`` under the
  lock, so a flush does not fsync files that no longer belong to the log.
"""

from __future__ import annotations

import threading
from typing import Callable

from ._config import FlushMode
from ._segment import fsync_dir
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
        if config.flush_mode is FlushMode.SYNC or end - st.durable.value >= config.flush_dirty_bytes:
            st.durable.flush_requested.set()

    def flush(self) -> int:
        """fsync everything written so far; returns (and publishes) the durable offset."""
        st = self._state
        with st.lock:
            target = st.end
            dirty, st.dirty = st.dirty, set()
            dir_dirty, st.dir_dirty = st.dir_dirty, False
        for seg in sorted(dirty, key=lambda s: s.base):
            if seg.fd >= 0:
                seg.sync()
        if dir_dirty:
            fsync_dir(st.directory)
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

    def run(self, stop: threading.Event, flush: Callable[[], object]) -> None:
        """The flush loop calling ``flush`` until ``stop`` is set, then a final flush."""
        st = self._state
        st.durable.run_flusher(flush, self._pending, stop, st.config.flush_interval_ms / 1000)

    def _pending(self) -> bool:
        # Read without the lock: a stale answer only delays a flush by one interval.
        st = self._state
        return st.end > st.durable.value or st.dir_dirty
