"""The mutable state of one CommitLog, in one place, with its locking rules.

Every part of the log (appender, reader, flusher, recovery, retention) holds a
reference to the same :class:`LogState`, the single owner of everything that changes.
(The one other mutable object is the appender's encoder, with its string cache; only
the appender uses it, under the lock.)

Who writes what (``lock`` is a plain, non-reentrant ``threading.Lock``), and who may
read it without the lock:

- ``snapshot``: replaced under the lock, in one assignment; read by every reader.
- ``end``: under the lock; read by readers and the flusher's "anything pending?".
- ``queue_offsets``, ``dirty``, ``graveyard``: under the lock only.
- ``dir_dirty``: under the lock; the flusher's "anything pending?" reads it without
  (a stale answer delays a flush by one interval).
- ``confirmed``: stored without the lock by ``set_confirmed_offset`` (one store);
  lowered by ``truncate`` under it; read by readers.
- ``durable``: guarded by its own condition variable; moved up only by a flush holding
  ``flush_lock`` (one flush at a time: swap the dirty set, fsync it, publish), moved
  down only by :meth:`CommitLog.truncate`, which holds ``flush_lock`` too. Once
  ``durable.failure`` is set (an fsync error) it is final: nothing is published again
  and appends are refused (checked under ``lock``).
- ``listeners``: appended to by ``add_append_listener``; called after the lock.
- The fields of the :class:`Segment` objects (``size``, ``sealed``, ``fd``, boundary
  positions) change under the lock (or in recovery, before any other thread exists);
  readers read ``size`` and ``fd`` without it, and never read past ``end``.

Why ``snapshot`` may be read without the lock: it is a frozen :class:`SegmentSet`
replaced by a single attribute store, which is atomic in CPython, so a reader sees
either the old or the new set, each with matching ``segments`` and ``bases``. (The two
separate stores this replaces could be seen half done: new segments with old bases.)
A reader that still holds an old snapshot is safe for a while, because segments leave
a snapshot in one of two ways:

- retention or :meth:`CommitLog.truncate` unlink the files but keep the descriptor
  open, and park the segment in ``graveyard``; it is closed only at the start of the
  *next* retention pass (``retention_check_interval_ms`` later in a broker). So a
  read through an old snapshot works unless it stalls for a whole pass: the safety is
  time-based, not enforced. (A read that loses that race hits ``fd == -1``: it is
  answered as "outside the log" when retention moved ``min_offset`` past it, and
  ``map_chunk`` returns an empty view rather than mapping anonymous zeros.)
- a failed append closes the segments it created at once; they never held a byte
  below ``end`` and every read is bounded by ``end`` (or a limit at or below it), so
  no reader reaches them.

Appends and flushes never fsync while holding ``lock``; :meth:`CommitLog.truncate`
(rare) fsyncs its cut under it, and recovery runs before any other thread exists.
Lock order: ``flush_lock``, then ``lock``, then ``durable``'s condition.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from ._config import CommitLogConfig
from ._durability import DurableOffset
from ._encoder import QueueKey
from ._segment import Segment
from ._segments import SegmentSet
from ._timings import Timings


class LogState:
    """The shared mutable state of one log (see the module docstring for the rules)."""

    __slots__ = (
        "config",
        "confirmed",
        "dir_dirty",
        "directory",
        "dirty",
        "durable",
        "end",
        "flush_lock",
        "flush_times",
        "graveyard",
        "listeners",
        "lock",
        "queue_offsets",
        "snapshot",
    )

    def __init__(self, directory: Path, config: CommitLogConfig) -> None:
        self.directory = directory
        self.config = config
        self.lock = threading.Lock()
        # Serialises flushes (and truncation against them): whoever holds it is *the*
        # flusher, the only one who moves ``durable``. Taken before ``lock``, never after.
        self.flush_lock = threading.Lock()
        self.snapshot = SegmentSet((), ())  # set before use by the opening code
        # The end of the last *completed* append. Readers and the dispatcher never look
        # past it, so a batch rolled back (disk full) was never visible to anyone.
        self.end = 0
        self.queue_offsets: dict[QueueKey, int] = {}
        self.dirty: set[Segment] = set()  # written since the last flush
        self.dir_dirty = False  # a segment file was created or deleted since the last flush
        self.graveyard: list[Segment] = []  # deleted, closed one retention pass later
        self.confirmed: int | None = None
        self.durable = DurableOffset()
        self.flush_times = Timings()  # each flush's fsyncs, for the broker's metrics
        self.listeners: list[Callable[[], None]] = []

    @property
    def confirmed_offset(self) -> int:
        """What consumers may see: the write end, or less while replication lags."""
        end = self.end
        confirmed = self.confirmed
        return end if confirmed is None else min(confirmed, end)

    def notify_append(self) -> None:
        """Tell the listeners that the log (or the confirmed offset) moved."""
        for fn in self.listeners:
            fn()

    def close_files(self) -> None:
        """Close every descriptor, live and deleted (closing twice is harmless)."""
        with self.lock:
            for seg in (*self.snapshot.segments, *self.graveyard):
                seg.close()
