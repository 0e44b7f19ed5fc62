"""Retention: deleting whole old segments, and closing them one pass later.

Invariants:
- Runs under ``LogState.lock``; only whole segments from the oldest on are deleted,
  never the active one, so the log stays contiguous and ``min_offset`` only grows.
- A deleted segment's files are unlinked at once but its descriptor stays open in
  ``graveyard`` until the start of the next pass: readers holding an older snapshot
  (they take no lock) can finish with it. Segments cut by ``truncate`` go the same way.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from ._segment import Segment
from ._state import LogState

log = logging.getLogger("clmq.commitlog")


class Retention:
    """Deletes segments past ``retention_ms`` or ``retention_bytes``."""

    __slots__ = ("_state", "holders")

    def __init__(self, state: LogState) -> None:
        self._state = state
        # Each holder names the lowest offset it needs kept whatever its age (None:
        # nothing): scheduled messages not yet delivered, half messages still pending.
        self.holders: list[Callable[[], int | None]] = []

    def floor(self) -> int | None:
        """The lowest offset any holder needs (None: none needs any)."""
        floors = [f for f in (holder() for holder in self.holders) if f is not None]
        return min(floors) if floors else None

    def delete_expired(self, now: float | None = None) -> int:
        """Delete expired segments (see :meth:`CommitLog.delete_expired`); returns how many."""
        now = time.time() if now is None else now
        try:  # asked before the log's lock is taken: it may read files (the timer's queue)
            floor = self.floor()
        except Exception as e:  # whatever failed, keeping every segment is safe
            log.error("commitlog retention: no segment deleted this pass, the retention floor failed: %s", e)
            return 0
        return self._delete(lambda segments: self._count_doomed(segments, now, floor))

    def delete_before(self, offset: int) -> int:
        """Delete the oldest segments that end at or below ``offset``, never the active
        one (a follower following its leader's retention); returns how many."""
        return self._delete(lambda segments: sum(1 for s in segments[:-1] if s.end <= offset))

    def _delete(self, count: Callable[[tuple[Segment, ...]], int]) -> int:
        st = self._state
        with st.lock:
            # Deleted a pass ago: a reader has had a whole retention interval to finish.
            for seg in st.graveyard:
                seg.close()
            st.graveyard = []
            snapshot = st.snapshot
            doomed = count(snapshot.segments)
            if doomed:
                # The log's start moves first, then the files go: a reader that finds a
                # file missing then also finds its range below the start (gone, not
                # damage) instead of a hole inside the log.
                st.snapshot = snapshot.tail(doomed)
                st.dir_dirty = True
            for seg in snapshot.segments[:doomed]:
                log.info("commitlog retention: deleting %s", seg.path)
                seg.delete()
                st.graveyard.append(seg)
                st.dirty.discard(seg)
            return doomed

    def _count_doomed(self, segments: tuple[Segment, ...], now: float, floor: int | None) -> int:
        """How many segments, oldest first and never the active one, are past a limit."""
        config = self._state.config
        total = sum(s.size for s in segments)
        doomed = 0
        for seg in segments[:-1]:
            if floor is not None and seg.end > floor:
                break  # it holds records still needed: kept, and every later one
            too_old = config.retention_ms is not None and (now - os.fstat(seg.fd).st_mtime) * 1000 > config.retention_ms
            too_big = config.retention_bytes is not None and total > config.retention_bytes
            if not (too_old or too_big):
                break
            total -= seg.size
            doomed += 1
        return doomed
